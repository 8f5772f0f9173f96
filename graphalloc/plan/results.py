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

import weakref

import torch

from ..errors import ContractError, StaleResultError

__all__ = ["AllocResult", "PlannedStep"]


def _none():
    return None


def _weak(obj):
    """A weak reference to ``obj`` (results never keep an allocator alive)."""
    if obj is None:
        return _none
    return obj if isinstance(obj, weakref.ref) else weakref.ref(obj)


class AllocResult:
    """Slots a step allocated, for the model's KV writes.

    ``rows``, ``first_lane`` and ``n_tokens`` are host numpy arrays; ``full_slots`` /
    ``swa_slots`` are ``[n_step_tokens]`` views of the static output buffers (valid from
    when the step runs on the stream until the next allocating step runs; access after a
    later allocating step was submitted raises :class:`StaleResultError`). Cost: O(1) per
    access (a slice).
    """

    __slots__ = ("rows", "first_lane", "n_tokens", "out_full_buf", "out_swa_buf",
                 "n_step_tokens", "step_index", "owner")

    def __init__(self, rows, first_lane, n_tokens, out_full_buf, out_swa_buf,
                 n_step_tokens: int, step_index: int = 0, owner=None):
        self.rows, self.first_lane, self.n_tokens = rows, first_lane, n_tokens
        self.out_full_buf, self.out_swa_buf = out_full_buf, out_swa_buf  # views on access
        self.n_step_tokens = n_step_tokens
        self.step_index = step_index  # the allocator's output_epoch once submitted
        # the planning pipeline, weakly (a weak reference as given: no call per step)
        self.owner = owner if type(owner) is weakref.ref else _weak(owner)

    def _check_fresh(self) -> None:
        owner = self.owner()
        if owner is not None and owner.output_epoch > self.step_index:
            raise StaleResultError(
                f"this result belongs to an earlier step; a step that allocated "
                f"(output epoch {owner.output_epoch}) has been submitted since and overwrote "
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

    def window_slots(self, pool: int) -> torch.Tensor:
        """``[n_step_tokens]`` slots of this step's new tokens in window pool ``pool`` of the
        model, in lane order: ``pool = 0`` is :attr:`swa_slots`; a further pool p >= 1 is a
        device gather of its ``full_to_swa`` at :attr:`full_slots` (a new tensor, sync-free;
        read it after the step ran on the stream, like the output buffers). Cost: O(1) host,
        one gather on the device."""
        if pool == 0:
            return self.swa_slots
        owner = self.owner()
        windows = () if owner is None else owner.state.windows
        if isinstance(pool, bool) or not isinstance(pool, int) or not 0 < pool <= len(windows):
            raise ContractError(f"window_slots: pool must be 0 (the first window pool) or a "
                                f"further window pool 1 .. {len(windows)}, got {pool!r}")
        return windows[pool - 1].full_to_swa[self.full_slots]

    def slots_of(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (full, SWA) slots of ``rows[i]``'s tokens."""
        a, b = int(self.first_lane[i]), int(self.first_lane[i] + self.n_tokens[i])
        return self.full_slots[a:b], self.swa_slots[a:b]

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        rows, n_tok = list(map(int, self.rows)), list(map(int, self.n_tokens))  # host numpy
        return (f"AllocResult(step={self.step_index}, rows={rows}, n_tokens={n_tok}, "
                f"n_step_tokens={self.n_step_tokens})")


class PlannedStep:
    """A step planned on the host and written into descriptor buffer ``buffer_index``; it
    must be run (:meth:`HybridAllocator.run`, or the engine's replay followed by
    :meth:`HybridAllocator.mark_submitted`) or cancelled (:meth:`HybridAllocator.cancel`:
    the allocator is then exactly as before the plan) before the next step is planned.

    ``pages_freed`` / ``pages_allocated``: ``{"full": n, "swa": n}``; ``pages_evicted``: SWA
    pages freed by frontier moves; ``fusable``: release and allocation may run as one
    launch; ``reclaimed``: the prefix cache's entries the step dropped; ``tables``: the
    attention tables' host copies (:class:`~graphalloc.attention.tables.PlannedTables`)
    when the allocator writes page tables; ``state_counts``: the step's ``(n_copy,
    n_table)`` recurrent-state rows, None when it has none; ``state_copies``: int64
    ``[n_copy, 2]`` (source slot, destination slot) the step copies in every registered state
    tensor (an engine copying its own states reads these), None without state rows."""

    __slots__ = ("buffer_index", "n_release_rows", "n_alloc_rows", "n_tokens", "_freed",
                 "_allocated", "result", "fusable", "pages_evicted", "submitted", "owner_ref",
                 "cancelled", "reclaimed", "tables", "state_counts",
                 "state_copies")

    def __init__(self, buffer_index: int, n_release_rows: int, n_alloc_rows: int,
                 n_tokens: int, pages_freed, pages_allocated, result=None,
                 fusable: bool = False, pages_evicted: int = 0, *, owner_ref=None,
                 reclaimed=(), tables=None, state_counts=None, state_copies=None):
        self.buffer_index, self.n_release_rows, self.n_alloc_rows = (buffer_index,
                                                                      n_release_rows,
                                                                      n_alloc_rows)
        self.n_tokens, self.result, self.fusable = n_tokens, result, fusable
        self._freed = pages_freed if type(pages_freed) is tuple else _pair(pages_freed)
        self._allocated = (pages_allocated if type(pages_allocated) is tuple
                           else _pair(pages_allocated))
        self.pages_evicted, self.submitted, self.cancelled = pages_evicted, False, False
        self.owner_ref = owner_ref if type(owner_ref) is weakref.ref else _weak(owner_ref)
        self.reclaimed, self.tables = reclaimed, tables
        self.state_counts = state_counts  # (n_copy, n_table) state rows; None: none
        self.state_copies = state_copies  # int64 [n_copy, 2]: (source, destination) slots

    @property
    def pages_freed(self) -> dict:
        return {"full": self._freed[0], "swa": self._freed[1]}

    @property
    def pages_allocated(self) -> dict:
        return {"full": self._allocated[0], "swa": self._allocated[1]}

    @property
    def owner(self):
        """The step pipeline that planned this step (the allocator's ``pipeline``; ``None``
        once it is gone)."""
        return self.owner_ref()

    def fits_rows(self, n_release_rows: int, n_alloc_rows: int) -> bool:
        """Whether this step may run on a launch captured for that many rows of each
        table (``HybridAllocator.launch(i, n_rows=(R, A))``): its release and allocation
        rows are packed at the front of the tables, so it fits when it has at most R and
        A of them. O(1)."""
        return self.n_release_rows <= n_release_rows and self.n_alloc_rows <= n_alloc_rows

    def __repr__(self) -> str:
        return (f"PlannedStep(buffer={self.buffer_index}, release_rows={self.n_release_rows}, "
                f"alloc_rows={self.n_alloc_rows}, tokens={self.n_tokens}, "
                f"submitted={self.submitted}, cancelled={self.cancelled})")


def _pair(pages) -> tuple[int, int]:
    if isinstance(pages, dict):
        return int(pages.get("full", pages.get("pages", 0))), int(pages.get("swa", 0))
    return pages
