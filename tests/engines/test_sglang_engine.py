"""With SGLang installed (its own environment: ``make engines-sglang``): graphalloc's
allocator is one of SGLang's out-of-tree paged allocators, and SGLang's own allocation
path produces the same schedule on it as on SGLang's allocator (one small seeded
workload; the conformance run has the full set). Skipped cleanly without SGLang."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                reason="SGLang is not installed")

TOOLS = Path(__file__).resolve().parents[2] / "tools" / "engines"


@pytest.fixture(scope="module")
def sg():
    sys.path.insert(0, str(TOOLS))
    import sglang_import
    yield sglang_import.import_sglang()
    sys.path.remove(str(TOOLS))


def test_an_out_of_tree_paged_allocator_in_sglangs_contract(sg):
    from graphalloc.integrations.sglang_subclass import sglang_classes
    cls = sglang_classes()["paged"]
    assert issubclass(cls, sg["paged"].PagedTokenToKVPoolAllocator)
    a = cls(size=16 * 8, page_size=16, dtype=torch.float16, device="cpu",
            kvcache=types.SimpleNamespace(), need_sort=False)
    out = a.alloc(32)
    pages = sorted(set((out // 16).tolist()))
    assert len(pages) == 2
    for p in pages:
        assert sorted(s for s in out.tolist() if s // 16 == p) == [p * 16 + i for i in range(16)]
    assert getattr(cls, "uses_legacy_real_length_alloc", False) is False


@pytest.mark.parametrize("ps,window", [(16, 64), (64, 32)])
def test_sglangs_allocation_path_schedules_the_same_on_graphalloc(sg, ps, window):
    sys.path.insert(0, str(TOOLS))
    from sglang_loop import Loop, Workload
    w = Workload("small", page_size=ps, window=window, n_requests=10, full_pages=64,
                 swa_pages=24, prompt_tokens=(8, 200), output_tokens=(4, 60), seed=ps)
    runs = {}
    for kind in ("sglang", "graphalloc"):
        loop = Loop(sg, kind, w)
        runs[kind] = []
        while not loop.done() and loop.n_iter < 3000:
            runs[kind].append(loop.iteration(observe=True))
            if kind == "graphalloc":
                assert loop.owners_disjoint()
        assert loop.done()
    assert runs["sglang"] == runs["graphalloc"]
    assert any(h[2] for r in runs["sglang"] for h in r.get("held", {}).values())  # evicted


def test_sglangs_radix_cache_behaves_the_same_on_graphalloc(sg):
    """SGLang's UnifiedRadixCache (FULL + SWA, tombstones) and its Req objects, prompts
    sharing a system prompt across two tenants: the same schedule, hits, evictable sizes
    and pages on both allocators, with real prefix hits."""
    sys.path.insert(0, str(TOOLS))
    from sglang_loop import Workload
    from sglang_radix_loop import RadixLoop
    w = Workload("radix-small", page_size=16, window=32, radix=True, n_requests=24,
                 full_pages=64, swa_pages=24, prompt_tokens=(8, 80), output_tokens=(4, 40),
                 system_tokens=64, system_prompts=1, max_running=4, seed=4)
    runs = {}
    for kind in ("sglang", "graphalloc"):
        loop = RadixLoop(sg, kind, w)
        runs[kind] = []
        while not loop.done() and loop.n_iter < 3000:
            runs[kind].append(loop.iteration(observe=True))
            if kind == "graphalloc":
                assert loop.owners_disjoint()
        assert loop.done()
    assert runs["sglang"] == runs["graphalloc"]
    assert sum(h for r in runs["sglang"] for h in r.get("hits", ())) > 0
