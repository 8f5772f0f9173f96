"""What a planned step hands back: the plan handle and the slots it allocated.

:class:`PlannedStep` is the host half's receipt: which descriptor buffer holds the
step, whether it may run fused, and (once run) that it was submitted.
:class:`AllocResult` gives the model the slots of the tokens the step allocated;
its device views are views of the allocator's static output buffers, which the next
step that allocates overwrites, so a result refuses access (``StaleResultError``) once a
later step that allocated has been submitted.

Lane order of a step's outputs (:mod:`graphalloc.plan.step`): ``decode`` rows, then
``extend`` rows, then ``load_back`` rows, each in the order given; row ``rows[i]``'s tokens
are lanes ``[first_lane[i], first_lane[i] + n_tokens[i])``.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np
import torch

from ..errors import StaleResultError

__all__ = ["AllocResult", "PlannedStep"]


def _none():
    return None


def _weak(obj):
    """A weak reference to ``obj`` (results never keep an allocator alive)."""
    if obj is None:
        return _none
    return obj if isinstance(obj, weakref.ref) else weakref.ref(obj)


@dataclasses.dataclass(eq=False)
class AllocResult:
    """Slots a step allocated, for the model's KV writes.

    ``rows``, ``first_lane`` and ``n_tokens`` are host numpy arrays; ``full_slots`` /
    ``swa_slots`` are ``[n_step_tokens]`` views of the static output buffers (valid from
    when the step runs on the stream until the next step runs; access after a later step
    was submitted raises :class:`StaleResultError`). Cost: O(1) per access (a slice).
    """

    rows: np.ndarray
    first_lane: np.ndarray
    n_tokens: np.ndarray
    out_full_buf: torch.Tensor  # the static output buffers (the views are made on access:
    out_swa_buf: torch.Tensor  # slicing a tensor costs microseconds on the per-step path)
    n_step_tokens: int
    step_index: int = 0  # the allocator's output_epoch once this step was submitted
    owner: object = dataclasses.field(default=None, repr=False)  # the allocator, weakly

    def __post_init__(self) -> None:
        self.owner = _weak(self.owner)

    def _check_fresh(self) -> None:
        alloc = self.owner()
        if alloc is not None and alloc.output_epoch > self.step_index:
            raise StaleResultError(
                f"this result belongs to an earlier step; a step that allocated "
                f"(output epoch {alloc.output_epoch}) has been submitted since and overwrote "
                "the output buffers. Read a step's slots before the next allocating step "
                "runs (or copy them)")

    @property
    def full_slots(self) -> torch.Tensor:
        """``[n_step_tokens]`` full slots of this step's new tokens, in lane order."""
        self._check_fresh()
        return self.out_full_buf[:self.n_step_tokens]

    @property
    def swa_slots(self) -> torch.Tensor:
        """``[n_step_tokens]`` SWA slots of this step's new tokens, in lane order."""
        self._check_fresh()
        return self.out_swa_buf[:self.n_step_tokens]

    def slots_of(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (full, SWA) slots of ``rows[i]``'s tokens."""
        a, b = int(self.first_lane[i]), int(self.first_lane[i] + self.n_tokens[i])
        return self.full_slots[a:b], self.swa_slots[a:b]

    def __repr__(self) -> str:
        rows, n_tok = list(map(int, self.rows)), list(map(int, self.n_tokens))  # host numpy
        return (f"AllocResult(step={self.step_index}, rows={rows}, n_tokens={n_tok}, "
                f"n_step_tokens={self.n_step_tokens})")


@dataclasses.dataclass(eq=False)
class PlannedStep:
    """A step planned on the host and written into descriptor buffer ``buffer_index``; it
    must be run (:meth:`HybridAllocator.run`, or the engine's replay followed by
    :meth:`HybridAllocator.mark_submitted`) or cancelled (:meth:`HybridAllocator.cancel`:
    the allocator is then exactly as before the plan) before the next step is planned."""

    buffer_index: int
    n_release_rows: int
    n_alloc_rows: int
    n_tokens: int
    pages_freed: dict
    pages_allocated: dict
    result: AllocResult | None = None
    fusable: bool = False  # release and allocation may run as one launch (StepBuilder.fusable)
    pages_evicted: int = 0  # SWA pages freed by frontier moves (window eviction, advances)
    submitted: bool = False
    owner_ref: object = dataclasses.field(default=None, repr=False)  # the allocator, weakly
    cancelled: bool = False
    reclaimed: list = dataclasses.field(default_factory=list)  # (handle, tombstone) dropped
    tables: object = None  # the step's attention tables' host copies (PlannedTables)

    def __post_init__(self) -> None:
        self.owner_ref = _weak(self.owner_ref)

    @property
    def owner(self):
        """The allocator that planned this step (``None`` once it is gone)."""
        return self.owner_ref()

    def fits_rows(self, n_release_rows: int, n_alloc_rows: int) -> bool:
        """Whether this step may run on a launch captured for that many rows of each
        table (``HybridAllocator.launch(i, n_rows=(R, A))``): its release and allocation
        rows are packed at the front of the tables, so it fits when it has at most R and
        A of them. O(1)."""
        return self.n_release_rows <= n_release_rows and self.n_alloc_rows <= n_alloc_rows
