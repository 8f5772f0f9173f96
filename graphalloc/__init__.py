"""graphalloc: a graph-captured, sync-free paged KV-cache allocator for hybrid
full-attention + sliding-window-attention models.

Layers, highest first (most users want the first):

* :class:`HybridAllocator` -- admit / extend / decode / evict / release, one step each,
  or :meth:`HybridAllocator.step` for a whole scheduler step;
* :class:`StepGraph` -- replays each step from a captured CUDA graph;
* ``graphalloc.planner`` / ``graphalloc.kernels`` -- the descriptor planner and the kernels.
"""

from .allocator import AllocResult, HybridAllocator, PlannedStep
from .config import AllocatorConfig
from .errors import *  # noqa: F403
from .errors import __all__ as _errors_all
from .graph import StepGraph, capture_graph, describe_graph
from .replicas import ReplicatedAllocator

__all__ = [
    "HybridAllocator", "AllocatorConfig", "AllocResult", "PlannedStep", "StepGraph",
    "ReplicatedAllocator",
    "capture_graph", "describe_graph", *_errors_all,
]
