"""Recurrent-state slots through the seams: what vLLM's Mamba groups and SGLang's Mamba pool
need (a slot per request, admitted and freed with it, a cache hit's state restored inside
the step), back-pressure when the slots are short, and typed errors without slots."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_integration_sglang import Batch, Req

import graphalloc as ga
from graphalloc.integrations.sglang import SGLangAllocator
from graphalloc.integrations.vllm import GraphallocKVCacheManager

PS = 4


def config(n_slots: int, cache: bool):
    cfg = ga.AllocatorConfig.for_engine(
        max_running_requests=4, chunked_prefill_size=32, max_context_len=64, page_size=PS,
        model_sliding_window=9, num_full_pages=80, num_swa_pages=60, max_reqs=6,
        num_state_slots=n_slots)
    if cache:
        cfg = dataclasses.replace(cfg, max_handles=4, max_alloc_rows=2 * cfg.max_alloc_rows)
    return cfg


def vllm(n_slots: int, cache: bool = False):
    cfg = config(n_slots, cache)
    ssm = torch.zeros(n_slots + 1, 3)
    alloc = ga.HybridAllocator(cfg, prefix_cache=cache, state_tensors=[ssm])
    return alloc, GraphallocKVCacheManager(alloc, enable_caching=cache), ssm


def test_vllm_state_block_per_request_with_back_pressure():
    alloc, mgr, _ = vllm(3)
    for rid in ("a", "b", "c"):
        assert mgr.allocate_slots(rid, 8) is not None
    before = alloc.snapshot()
    assert mgr.allocate_slots("d", 8) is None  # three slots, three requests: back-pressure
    assert "d" not in mgr
    mgr.run_step()
    ids = {rid: mgr.state_block_id(rid) for rid in ("a", "b", "c")}
    assert sorted(ids.values()) == [1, 2, 3]
    for rid, slot in ids.items():
        assert int(alloc.req_to_state[mgr.row_of(rid)]) == slot
    assert alloc.n_free("state") == 0 and before is not None
    mgr.free("a")  # the release gives its slot back in the same step as d's admit
    assert mgr.allocate_slots("d", 8) is not None
    mgr.run_step()
    assert mgr.state_block_id("d") == ids["a"]
    with pytest.raises(ga.UnknownRequestError):
        mgr.state_block_id("a")
    alloc.check_integrity()


def test_vllm_cache_hit_restores_the_snapshot_inside_the_step():
    alloc, mgr, ssm = vllm(6, cache=True)
    prompt = list(range(100, 108))  # two whole blocks
    assert mgr.allocate_slots("a", 8) is not None
    mgr.run_step()
    ssm[mgr.state_block_id("a")] = 7.0  # the model's prefill wrote a's state
    mgr.free("a", token_ids=prompt)  # cached at its committed length (page-aligned)
    mgr.run_step()
    blocks, n_hit = mgr.get_computed_blocks("b", prompt + [5])
    assert n_hit == 8
    assert mgr.allocate_slots("b", 1, num_new_computed_tokens=n_hit,
                              new_computed_blocks=blocks) is not None
    mgr.run_step()
    slot = mgr.state_block_id("b")
    assert torch.equal(ssm[slot], torch.full((3,), 7.0))  # copied from the snapshot
    assert slot not in (0, int(alloc.handle_to_state[alloc.live_handles()[0]]))
    alloc.check_integrity()


def test_vllm_unaligned_insert_caches_nothing_with_states():
    alloc, mgr, _ = vllm(6, cache=True)
    assert mgr.allocate_slots("a", 7) is not None  # 7 tokens: no state at a page boundary
    mgr.run_step()
    mgr.free("a", token_ids=list(range(7)))
    mgr.run_step()
    assert len(alloc.prefix_cache) == 0 and alloc.live_handles().size == 0
    alloc.check_integrity()


def test_sglang_mamba_pool_view():
    cfg = config(4, cache=False)
    alloc = ga.HybridAllocator(cfg)
    seam = SGLangAllocator(alloc)
    reqs = [Req(rid=i, prompt_len=6, max_new_tokens=2) for i in range(2)]
    assert seam.mamba_available_size() == 4
    out = seam.prepare_for_extend(Batch(reqs=reqs, prefix_lens=[0, 0], extend_lens=[6, 6]))
    assert out is not None
    rows = [r.req_pool_idx for r in reqs]
    mapping = seam.req_index_to_mamba_index_mapping
    assert mapping.shape == (cfg.max_reqs,) and sorted(mapping[rows].tolist()) == [1, 2]
    assert seam.get_mamba_indices(rows).tolist() == mapping[rows].tolist()
    assert torch.equal(seam.get_mamba_indices(torch.tensor(rows)), mapping[rows])
    assert seam.mamba_available_size() == 2
    with pytest.raises(ga.UnknownRequestError):
        seam.get_mamba_indices([cfg.max_reqs])
    alloc.check_integrity()


def test_without_state_slots_the_state_surfaces_refuse():
    cfg = dataclasses.replace(config(0, cache=False))
    alloc = ga.HybridAllocator(cfg)
    seam, mgr = SGLangAllocator(alloc), GraphallocKVCacheManager(alloc)
    with pytest.raises(ga.ConfigError):
        _ = seam.req_index_to_mamba_index_mapping
    with pytest.raises(ga.ConfigError):
        seam.mamba_available_size()
    with pytest.raises(ga.ConfigError):
        mgr.state_block_id("x")
