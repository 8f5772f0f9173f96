"""vLLM's v1 ``Scheduler`` with graphalloc as its KV-cache manager, named by vLLM's option.

Contract. ``GraphallocScheduler`` is vLLM's own ``Scheduler`` (``GraphallocAsyncScheduler``
its ``AsyncScheduler``, vLLM 0.33's default) (every scheduling rule
unchanged) whose ``kv_cache_manager`` is a
:class:`~graphalloc.integrations.vllm_manager.GraphallocKVCacheManager` built from the
same arguments vLLM gives its own manager. The integration is the scheduler-class option::

    vllm serve MODEL --scheduler-cls graphalloc.integrations.vllm_scheduler.GraphallocAsyncScheduler

(``SchedulerConfig.scheduler_cls``: vLLM imports the dotted name and builds the class with
its usual arguments). vLLM is imported when the class is first asked for, never when
graphalloc is imported: ``import graphalloc`` without vLLM installed is unchanged. The
class is built once per process (module ``__getattr__``), a subclass of the installed
vLLM's ``Scheduler``.

Cost: construction builds vLLM's manager once (the base class does) and then graphalloc's;
per step, vLLM's scheduler calls the plug-in as it calls its own manager.
"""

from __future__ import annotations

__all__ = ["GraphallocScheduler", "GraphallocAsyncScheduler", "build_scheduler_class"]  # noqa: F822 (built on first access)

_CLASSES: dict[str, type] = {}


def build_scheduler_class(name: str = "GraphallocScheduler"):
    """vLLM's ``Scheduler`` (``GraphallocScheduler``) or ``AsyncScheduler``
    (``GraphallocAsyncScheduler``: vLLM 0.33's default, async scheduling) subclass that
    swaps in graphalloc's manager. Imports vLLM; built once per process."""
    if name in _CLASSES:
        return _CLASSES[name]
    if name == "GraphallocScheduler":
        from vllm.v1.core.sched.scheduler import Scheduler as base
    elif name == "GraphallocAsyncScheduler":
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as base
    else:
        raise AttributeError(name)

    from .vllm_manager import GraphallocKVCacheManager

    class GraphallocScheduler(base):
        """vLLM's scheduler; its KV-cache manager is graphalloc's (see the module)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            own = self.kv_cache_manager
            sched = self.scheduler_config
            self.kv_cache_manager = GraphallocKVCacheManager(
                kv_cache_config=self.kv_cache_config, max_model_len=self.max_model_len,
                scheduler_block_size=self.block_size, hash_block_size=self.hash_block_size,
                max_in_flight_tokens=self.vllm_config.max_in_flight_tokens,
                enable_caching=own.enable_caching, use_eagle=own.use_eagle,
                log_stats=self.log_stats, enable_kv_cache_events=own.enable_kv_cache_events,
                dcp_world_size=self.dcp_world_size, pcp_world_size=1,
                watermark=sched.watermark, max_num_seqs=sched.max_num_seqs,
                max_num_batched_tokens=sched.max_num_batched_tokens,
                num_lookahead_tokens=self.num_lookahead_tokens)

    GraphallocScheduler.__module__ = __name__
    GraphallocScheduler.__name__ = GraphallocScheduler.__qualname__ = name
    _CLASSES[name] = GraphallocScheduler
    return GraphallocScheduler


def __getattr__(name: str):
    if name in ("GraphallocScheduler", "GraphallocAsyncScheduler"):
        return build_scheduler_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
