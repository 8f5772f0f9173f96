"""graphalloc's Mamba slot allocator against the behaviours of SGLang's
``MambaSlotAllocator`` (written from the rules), a model on random calls and, when SGLang
is installed, SGLang's own allocator on the same calls (both are FIFO: the same ids)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from graphalloc.errors import ContractError
from graphalloc.integrations.sglang_mamba import GraphallocMambaSlotAllocator as Slots


def test_slot_zero_is_never_handed_out_and_a_short_pool_says_none():
    a = Slots(4, "cpu")
    assert a.alloc(5) is None and a.available_size() == 4
    got = a.alloc(4)
    assert sorted(got.tolist()) == [1, 2, 3, 4] and a.available_size() == 0
    assert a.alloc(1) is None
    a.free(got[1:3])
    assert a.available_size() == 2 and sorted(a.alloc(2).tolist()) == sorted(got[1:3].tolist())
    with pytest.raises(ContractError):
        Slots(0, "cpu")


def test_a_group_takes_slots_ahead_and_gives_the_unused_back():
    a = Slots(8, "cpu")
    a.alloc_group_begin(3)
    assert a.available_size() == 5
    one, two = a.alloc(1), a.alloc(1)
    assert one.numel() == two.numel() == 1 and int(one) != int(two)
    a.alloc_group_end()
    assert a.available_size() == 6
    a.check()


@pytest.mark.parametrize("seed", range(4))
def test_random_calls_keep_every_slot_with_one_holder(seed):
    rng = np.random.default_rng(seed)
    a, held = Slots(12, "cpu"), []
    for _ in range(200):
        if rng.random() < 0.55:
            n = int(rng.integers(1, 4))
            out = a.alloc(n)
            if n > 12 - len(held):
                assert out is None
                continue
            held += out.tolist()
        elif held:
            k = int(rng.integers(1, len(held) + 1))
            a.free(torch.tensor(held[:k]))
            held = held[k:]
        assert a.available_size() == 12 - len(held)
        assert len(set(held)) == len(held) and 0 not in held
    a.check()


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                    reason="SGLang is not installed")
@pytest.mark.parametrize("seed", range(3))
def test_the_same_slots_as_sglangs_own_allocator(seed):
    from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
    rng = np.random.default_rng(seed)
    ours, theirs = Slots(10, "cpu"), MambaSlotAllocator(10, "cpu")
    held = []
    for _ in range(150):
        op = rng.integers(3)
        if op == 0:
            n = int(rng.integers(1, 4))
            a, b = ours.alloc(n), theirs.alloc(n)
            assert (a is None) == (b is None)
            if a is not None:
                assert a.tolist() == b.tolist()
                held += a.tolist()
        elif op == 1 and held:
            k = int(rng.integers(1, len(held) + 1))
            ours.free(torch.tensor(held[:k]))
            theirs.free(torch.tensor(held[:k]))
            held = held[k:]
        else:
            n = int(rng.integers(0, 3))
            ours.alloc_group_begin(n)
            theirs.alloc_group_begin(n)
            for _ in range(int(rng.integers(0, n + 1))):
                a, b = ours.alloc(1), theirs.alloc(1)
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.tolist() == b.tolist()
                    held += a.tolist()
            ours.alloc_group_end()
            theirs.alloc_group_end()
        assert ours.available_size() == theirs.available_size()
