"""Misuse gets a typed error, raised before anything changes: counts and positions are
integers, validated and never coerced; rows on a device say to pass the host copy; wrong
step-argument shapes, bad plan handles, launch indices, double submission and bad
constructors are refused; a double release names itself (regressions found from outside)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import assert_same_snapshot
from small import small

import graphalloc as ga
from graphalloc import errors as E


@pytest.mark.parametrize("value", [1.5, "2", True, [[1]], np.array([2.5]), None, math.nan,
                                   math.inf, 2**63, torch.tensor([1.0]),
                                   torch.tensor([1], device="meta")])
def test_counts_are_validated_not_coerced(value):
    a = small()
    r = a.admit()
    a.alloc_extend([r], [6])
    before = a.snapshot()
    with pytest.raises(E.ContractError):
        a.alloc_extend([r], value if isinstance(value, list) else [value])
    with pytest.raises(E.ContractError):
        a.advance_frontier([r], [value] if not isinstance(value, (list, np.ndarray,
                                                                   torch.Tensor)) else value)
    assert_same_snapshot(before, a.snapshot())


def test_rows_on_a_cuda_like_device_say_pass_the_host_copy():
    a = small()
    r = a.admit()
    with pytest.raises(E.TensorSpecError, match="host copy"):
        a.alloc_decode(torch.tensor([r], device="meta"))


def test_misuse_gets_typed_errors():
    a = small()
    r = a.admit()
    a.alloc_extend([r], [3])
    before = a.snapshot()
    for call in (lambda: a.step(extend=[r]),  # not a (rows, n) pair
                 lambda: a.step(extend=([r], [1], [2])),  # a 3-tuple
                 lambda: a.step(advance=([r], [0], 0)),
                 lambda: a.step(evict=True),  # rows only: evict_all=True for every row
                 lambda: a.run(None), lambda: a.mark_submitted(None),
                 lambda: a.launch(-1), lambda: a.launch(len(a.ring)),
                 lambda: a.launch(0),  # outside a capture: only the pending step's buffer
                 lambda: ga.HybridAllocator(None), lambda: ga.StepGraph(a),
                 lambda: ga.HybridAllocator(a.config, executor="fast"),
                 lambda: ga.HybridAllocator(a.config, fused_step="yes")):
        with pytest.raises(E.GraphallocError):
            call()
    assert_same_snapshot(before, a.snapshot())
    p = a.plan(decode=[r])
    a.run(p)
    with pytest.raises(E.PendingStepError, match="already submitted"):
        a.mark_submitted(p)  # would count the step twice
    assert a.steps_run == 3  # the admit, the extend, the decode


def test_errors_name_the_operation_and_a_double_release():
    a = small()
    r = a.admit()
    with pytest.raises(E.UnknownRequestError, match="decode"):
        a.alloc_decode([9])
    a.release([r])
    with pytest.raises(E.UnknownRequestError, match="already released"):
        a.release([r])


def test_numpy_integers_configure_and_bools_do_not():
    cfg = ga.AllocatorConfig(page_size=np.int64(4), num_full_pages=8, num_swa_pages=8,
                             max_reqs=2, max_context_len=16, sliding_window=np.int32(3))
    assert type(cfg.page_size) is int and cfg.page_size == 4
    for bad in (dict(page_size=True), dict(swa_ring_pages=3.5), dict(validate="yes")):
        with pytest.raises(E.ConfigError):
            ga.AllocatorConfig(**{**dict(page_size=4, num_full_pages=8, num_swa_pages=8,
                                         max_reqs=2, max_context_len=16, sliding_window=3),
                                  **bad})
