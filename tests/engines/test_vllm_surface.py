"""The vLLM plug-in's surface equals what vLLM 0.33's scheduler calls on its KV-cache manager.

Default suite. With vLLM installed, the names are read from the installed scheduler's source
(every ``self.kv_cache_manager.<name>``) and each method's parameters from vLLM's own
``KVCacheManager``; without it, from the committed list of the 0.33 surface below. The
plug-in's parameters must start with vLLM's, in order (it may add keyword-only ones).
"""

from __future__ import annotations

import importlib.util
import inspect
import re

import pytest

from graphalloc.integrations.vllm_blocks import LazyBlocks
from graphalloc.integrations.vllm_manager import GraphallocKVCacheManager

HAVE_VLLM = importlib.util.find_spec("vllm") is not None

# vLLM 0.33.0: what Scheduler calls on self.kv_cache_manager (read from its source).
SURFACE_033 = (
    "allocate_slots", "block_pool", "cache_blocks", "coordinator", "empty_kv_cache_blocks",
    "estimate_cached_tokens", "evict_blocks", "finalize_partial_tail_offloads", "free",
    "get_block_ids", "get_block_ids_for_computed_tokens", "get_blocks", "get_computed_blocks",
    "get_computed_blocks_for_connector", "make_prefix_cache_stats",
    "mamba_shared_prefix_checkpoint", "new_step_starts", "pop_blocks_for_free",
    "record_blocks_for_zeroing", "record_prefix_cache_stats", "remove_skipped_blocks",
    "reset_prefix_cache", "take_boundary_state_offloads", "take_events",
    "take_kv_cache_block_copies", "take_new_block_ids", "truncate_computed_blocks", "usage")
ATTRIBUTES = {"block_pool", "coordinator", "empty_kv_cache_blocks",
              "mamba_shared_prefix_checkpoint"}
PARAMS_033 = {
    "__init__": ["kv_cache_config", "max_model_len", "scheduler_block_size", "hash_block_size",
                 "max_in_flight_tokens", "enable_caching", "use_eagle",
                 "num_hash_lookahead_tokens", "num_prefill_lookahead", "log_stats",
                 "enable_kv_cache_events", "dcp_world_size", "pcp_world_size",
                 "metrics_collector", "watermark", "enable_mamba_shared_prefix_checkpoint"],
    "allocate_slots": ["request", "num_new_tokens", "num_new_computed_tokens",
                       "new_computed_blocks", "num_lookahead_tokens",
                       "num_external_computed_tokens", "delay_cache_blocks",
                       "num_encoder_tokens", "full_sequence_must_fit", "reserved_blocks",
                       "has_scheduled_reqs", "skip_zeroing_group_ids"],
    "get_computed_blocks": ["request", "max_cache_hit_length"],
    "free": ["request"],
    "cache_blocks": ["request", "num_computed_tokens"],
    "get_blocks": ["request_id"],
    "get_block_ids": ["request_id"],
}


def _surface() -> tuple[str, ...]:
    if not HAVE_VLLM:
        return SURFACE_033
    from vllm.v1.core.sched import scheduler
    src = inspect.getsource(scheduler)
    return tuple(sorted(set(re.findall(r"self\.kv_cache_manager\.([A-Za-z_]+)", src))))


def _params(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def _expected_params() -> dict:
    if not HAVE_VLLM:
        return PARAMS_033
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    out = {}
    for name in set(_surface()) | {"__init__"}:
        fn = getattr(KVCacheManager, name, None)
        if callable(fn) and not isinstance(inspect.getattr_static(KVCacheManager, name),
                                           property):
            out[name] = _params(fn)
    return out


@pytest.mark.parametrize("name", _surface())
def test_every_name_the_scheduler_calls_exists(name):
    if name in ATTRIBUTES:
        src = inspect.getsource(GraphallocKVCacheManager.__init__)
        assert f"self.{name} =" in src, f"the plug-in never sets {name}"
    else:
        assert hasattr(GraphallocKVCacheManager, name), f"the plug-in lacks {name}"


def test_usage_is_a_property_as_in_vllm():
    assert isinstance(inspect.getattr_static(GraphallocKVCacheManager, "usage"), property)


@pytest.mark.parametrize("name,params", sorted(_expected_params().items()))
def test_parameters_start_with_vllms(name, params):
    ours = _params(getattr(GraphallocKVCacheManager, name))
    assert ours[:len(params)] == params, f"{name}: vLLM {params}, plug-in {ours}"
    extra = inspect.signature(getattr(GraphallocKVCacheManager, name)).parameters
    for p in list(extra.values())[len(params) + 1:]:  # +1: self
        assert p.kind is inspect.Parameter.KEYWORD_ONLY or p.default is not p.empty, p


def test_blocks_answer_as_kv_cache_blocks():
    for name in ("get_block_ids", "blocks", "get_unhashed_block_ids", "new_empty", "__add__"):
        assert hasattr(LazyBlocks, name)
    assert _params(LazyBlocks.get_block_ids) == ["allow_none", "group_ids"]


def test_graphalloc_imports_without_vllm_and_the_class_is_lazy():
    import graphalloc.integrations.vllm_scheduler as mod
    assert "GraphallocScheduler" in mod.__all__
    assert "GraphallocScheduler" not in vars(mod)  # built on first access, importing vLLM
