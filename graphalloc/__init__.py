"""graphalloc: a graph-captured, sync-free paged KV-cache allocator for hybrid
full-attention + sliding-window-attention models.

Layers, highest first (most users want the first):

* :class:`HybridAllocator` -- every operation is one :class:`Step`: ``alloc.step(...)`` for a
  whole scheduler step, the single operations, ``scheduler_step()`` / ``free_group()`` blocks;
  with ``page_tables=PageTableSpec(...)`` every step also writes its batch's attention page
  tables (``alloc.tables``; host copies on ``PlannedStep.tables``, a :class:`PlannedTables`);
* :class:`StepGraph` -- replays each step from a captured CUDA graph;
* ``graphalloc.plan`` / ``graphalloc.kernels`` -- the planner pair and the kernels.

A model is a list of layer kinds (``AllocatorConfig(layers=[FullAttention(...),
SlidingWindow(...), ChunkedLocal(...), RecurrentState(...)])``), each served by a pool
(``graphalloc.pools``).

Rooms by stage: ``pools`` (one per layer kind: its rules, sizing, audit), ``state`` (ledger,
page references, journal), ``plan`` (Step, planners,
refusals, recorder), ``device`` (descriptor ring, tables, executors, graphs), ``sharing``
(prefix cache), ``attention`` (page tables), ``diagnostics``, ``replicas``,
``integrations``; ``kernels`` at the bottom.
"""

from .allocator import AllocResult, HybridAllocator, PlannedStep
from .attention.spec import PageTableSpec
from .attention.tables import PlannedTables
from .config import AllocatorConfig
from .device.graph import StepGraph, capture_graph, describe_graph
from .errors import *  # noqa: F403
from .errors import __all__ as _errors_all
from .plan.step import Step
from .pools import ChunkedLocal, FullAttention, RecurrentState, SlidingWindow
from .replicas.allocator import ReplicatedAllocator

__all__ = [
    "HybridAllocator", "AllocatorConfig", "Step", "AllocResult", "PlannedStep", "StepGraph",
    "ReplicatedAllocator", "PageTableSpec", "PlannedTables", "FullAttention", "SlidingWindow",
    "ChunkedLocal", "RecurrentState",
    "capture_graph", "describe_graph", *_errors_all,
]
