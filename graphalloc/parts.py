"""The narrow parts an allocator is made of, and the protocols the layers below it use.

:class:`~graphalloc.HybridAllocator` composes its parts once, at construction, and hands
each layer below it only the parts that layer uses, through the protocols declared here --
never the allocator itself. Nothing below the allocator calls up (SPEC: a part gets the
narrow parts it uses, never the object that owns it; vLLM's block pool knows nothing of its
managers, its managers nothing of the scheduler)::

    front-end floor   seams / engine plug-ins / recorder / free group / replicas /
                      the prefix cache's client (take, drop: it submits Steps)
    allocator.py      composes the parts below, names every one of them
    plan              StepPipeline(DeviceParts, planner, executor, reclaim policy)
    device            executors (bind(DeviceParts)), restore(DeviceParts)
    diagnostics       integrity / checkpoint / recovery (DeviceParts, PipelinePart)
    kernels           StepKernels, launched by the executors

:class:`DeviceParts` is the bundle of the allocator's host ledger and device parts (config,
ledger, device tables, descriptor ring, step kernels, attention tables), built once by the
allocator; the protocols name what each consumer reads of it. A :class:`ReclaimPolicy` is
what the pipeline consults when a step is short of pages or state slots (the prefix cache's
index of entries, :class:`~graphalloc.sharing.prefix_cache.CacheIndex`).

Invariants: a part never holds the allocator, a front end or the pipeline's owner; the
bundle's members are fixed for the allocator's life (captured graphs hold their addresses).
Cost: none at run time (the protocols are for readers and type checkers; the bundle is a
frozen record read by attribute).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

__all__ = ["DeviceParts", "LedgerPart", "RingPart", "KernelsPart", "PlannerPart",
           "ExecutorPart", "ReclaimPolicy", "GroupMasks", "PipelinePart"]


@runtime_checkable
class LedgerPart(Protocol):
    """The host ledger (:class:`graphalloc.state.ledger.Ledger`): per-request and per-handle
    arrays, the free rings' host mirrors, the journal of a step's writes."""

    journal: Any
    states: Any

    def arrays(self) -> dict: ...

    def assign(self, arrays: dict) -> None: ...

    def check_host_invariants(self) -> None: ...


@runtime_checkable
class RingPart(Protocol):
    """The descriptor ring (:class:`graphalloc.device.descriptor.DescriptorRing`): pinned
    buffers the host writes and the kernels read, each fenced by an event, in the sections
    of its ``layout`` (:class:`graphalloc.device.layout.DescriptorLayout`)."""

    np_bufs: list
    layout: Any

    def __len__(self) -> int: ...

    def acquire(self) -> int: ...

    def submitted(self, index: int) -> None: ...

    def write(self, index: int, release_rows, alloc_rows, fusable: bool = False) -> None: ...

    def release_rows(self, index: int): ...

    def alloc_rows(self, index: int): ...


@runtime_checkable
class KernelsPart(Protocol):
    """The step kernels (:class:`graphalloc.device.backend.StepKernels`): one call launches
    a step's sections from a descriptor buffer."""

    fused: bool
    released: bool

    def __call__(self, release_rows, alloc_rows, **sections) -> None: ...

    def launch_states(self, state_rows, counts) -> None: ...


@runtime_checkable
class PlannerPart(Protocol):
    """The compiled planner (:class:`graphalloc.plan.compiled.CompiledPlanner`): plans into
    a descriptor buffer, with its own undo log."""

    def plan(self, arrays, epoch: int, index, released, dropped, reclaim): ...

    def mark(self) -> int: ...

    def rollback(self, mark: int) -> None: ...

    def commit(self) -> None: ...


@runtime_checkable
class ExecutorPart(Protocol):
    """How a planned step reaches the device (:mod:`graphalloc.device.executor`): bound once
    to the :class:`DeviceParts`, then ``execute(planned)`` per step."""

    name: str
    plans_locally: bool
    stamps_steps: bool

    def bind(self, parts: DeviceParts) -> None: ...

    def execute(self, planned) -> None: ...


@runtime_checkable
class ReclaimPolicy(Protocol):
    """What a step short of pages or state slots may drop: ``n_unlocked`` entries could go,
    ``offer(limit)`` gives ``(tombstone order, drop order)`` handle arrays for the planner,
    ``on_reclaimed(reclaimed)`` hears which a submitted step dropped."""

    @property
    def n_unlocked(self) -> int: ...

    def offer(self, limit: int) -> tuple: ...

    def on_reclaimed(self, reclaimed: list) -> None: ...


@runtime_checkable
class GroupMasks(Protocol):
    """The open free group as the planner sees it: ``released`` (bool per request row) and
    ``dropped`` (bool per handle), rows and handles whose frees run at the block's end, so
    a step planned inside the block refuses them."""

    released: Any
    dropped: Any


@runtime_checkable
class PipelinePart(Protocol):
    """The step pipeline as the diagnostics see it (:class:`graphalloc.plan.pipeline
    .StepPipeline`): the pending step, the submissions a ``check()`` verifies, the fault
    flag, the output epoch."""

    pending: Any
    submissions: Any
    faulted: bool
    output_epoch: int


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class DeviceParts:
    """The allocator's parts below it, built once: ``config`` (the frozen geometry),
    ``ledger`` (:class:`LedgerPart`), ``state`` (the device tables,
    :class:`graphalloc.device.tables.DeviceState`), ``ring`` (:class:`RingPart`),
    ``kernels`` (:class:`KernelsPart`), ``tables`` (the attention tables or ``None``)."""

    config: Any
    ledger: Any
    state: Any
    ring: Any
    kernels: Any
    tables: Any = None
