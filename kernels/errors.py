"""One exception hierarchy for graphalloc (defined at the bottom layer: the kernels raise it too).

Two kinds of failure exist:

* A host contract violated by the caller (an unaligned segment, an unknown
  request, too little capacity, ...). It raises a subclass of
  :class:`ContractError` *before* any host or device structure changes.
* A fact only the device can see (an unmapped SWA peer, a sink page popped
  from a free list, ...). The kernels record it in the device error word; the
  next :meth:`HybridAllocator.check` raises :class:`DeviceFaultError` naming
  the row, request, page and rule.

Every message states the rule, the values and the fix.
"""

from __future__ import annotations

from .abi import (
    ERR_CODE,
    ERR_CODES,
    ERR_COUNT,
    ERR_PAGE,
    ERR_REQ,
    ERR_ROW,
    ERR_STAGE,
    FAULT_NAMES,
    STAGE_NAMES,
    FaultCode,
)

__all__ = [
    "GraphallocError",
    "ContractError",
    "ConfigError",
    "UnknownRequestError",
    "UnknownHandleError",
    "CapacityError",
    "AlignmentError",
    "OverlapError",
    "PositionError",
    "FrontierError",
    "NestedGroupError",
    "TensorSpecError",
    "BatchTooLargeError",
    "PendingStepError",
    "RingOverflowError",
    "SpeculativeStateError",
    "StaleResultError",
    "StateError",
    "SharedPageError",
    "RecorderError",
    "LaunchError",
    "CaptureError",
    "SubmissionError",
    "IntegrityError",
    "DeviceFaultError",
    "ReplicaDivergenceError",
    "FaultCode",
    "FAULT_NAMES",
]


class GraphallocError(Exception):
    """Base class of every error graphalloc raises."""


class ContractError(GraphallocError, ValueError):
    """A host-side contract was violated. Nothing was changed.

    ``refusal``: the planner's refusal behind the error (a
    :class:`graphalloc.plan.refusals.RefusalInfo`: code, kind, row, value, limit), or None
    when the error was raised before planning (a malformed input, a configuration)."""

    refusal = None  # set on errors made from a planner's refusal (plan.refusals.to_error)


class ConfigError(ContractError):
    """The allocator configuration is inconsistent."""


class UnknownRequestError(ContractError):
    """A request row is out of range, free, already released, or pending release."""


class UnknownHandleError(ContractError):
    """A prefix-sharing handle is out of range, was never taken, or was dropped already."""


class CapacityError(ContractError):
    """An allocation cannot be met whole; nothing was allocated."""


class AlignmentError(ContractError):
    """A segment or frontier is not on a page boundary."""


class OverlapError(ContractError):
    """Two segments of one step share a full page, or one request appears twice."""


class PositionError(ContractError):
    """A position lies outside ``[0, max_context_len)`` or beyond what was allocated."""


class FrontierError(ContractError):
    """A sliding-window frontier would move backwards (only ``load_back`` moves it back)."""


class NestedGroupError(ContractError):
    """``free_group()`` blocks cannot be nested."""


class TensorSpecError(ContractError, TypeError):
    """A caller tensor has the wrong dtype, device or shape."""


class BatchTooLargeError(ContractError):
    """A step needs more descriptor rows, pages or tokens than the frozen capacity."""


class PendingStepError(ContractError):
    """A planned step was not executed before the next one was planned."""


class StaleResultError(ContractError):
    """A step's result was read after a later step overwrote its output buffers."""


class RingOverflowError(ContractError):
    """SWA ring mode: an allocation would reuse a ring page whose owner is still mapped."""


class SpeculativeStateError(ContractError):
    """Speculative decoding: a commit with no speculative step to resolve, a plain decode or
    extend of a request whose speculative tail is not committed, or a third speculative step
    in flight."""


class StateError(ContractError):
    """A state dict or load-back was refused; the allocator keeps its previous state."""


class SharedPageError(ContractError):
    """A write into a page more than one holder references: a slot of a shared page is never
    written (a trim into a shared page, then an allocation, would overwrite the prefix every
    holder reads)."""


class RecorderError(ContractError):
    """A ``scheduler_step()`` / ``free_group()`` block used wrongly: a call on a block that
    has closed, or a direct allocator mutation while a ``scheduler_step()`` block is open."""


class LaunchError(GraphallocError, RuntimeError):
    """Launching a planned step raised; the step was taken back (the allocator is exactly as
    before the plan). The original exception is the ``__cause__``."""


class CaptureError(GraphallocError, RuntimeError):
    """Capturing a CUDA graph failed. Nothing was kept: the stream left capture mode and the
    process stays usable (the allocator under construction was not built). The original
    exception is the ``__cause__``."""


class SubmissionError(GraphallocError, RuntimeError):
    """Raised by ``check()``: the steps the host marked submitted and the steps the device
    ran differ (a ``mark_submitted(p)`` without a replay of p's buffer, or a replay of a step
    never submitted). Attributes: ``expected`` (steps with rows submitted since the last
    reset), ``seen`` (steps the device counted), ``step`` and ``buffer_index`` (the step
    named, when one can be; else None). The allocator refuses steps until ``recover()``
    (``reset_faults()`` only once ``audit()`` is clean)."""

    def __init__(self, message: str, expected: int, seen: int, step: int | None,
                 buffer_index: int | None):
        super().__init__(message)
        self.expected, self.seen, self.step, self.buffer_index = (expected, seen, step,
                                                                  buffer_index)


class IntegrityError(GraphallocError, AssertionError):
    """An integrity check found a broken invariant (leak, double owner, bad mapping)."""


class DeviceFaultError(GraphallocError, RuntimeError):
    """The device recorded a fault; raised by ``check()``.

    Attributes mirror the first-error record: ``codes`` (all bits seen),
    ``count`` (faulting lanes), and the first fault's ``code``, ``stage``
    (``"release"`` or ``"alloc"``), descriptor ``row``, request ``req`` and
    ``page``. After a fault the allocator refuses further steps until ``recover()``
    rebuilds the device tables from the host ledger (``reset_faults()`` clears the report
    only when ``audit()`` is clean).
    """

    def __init__(self, codes: int, count: int, code: int, stage: str, row: int, req: int,
                 page: int):
        names = [name for bit, name in FAULT_NAMES.items() if codes & bit]
        super().__init__(
            f"device fault: {FAULT_NAMES.get(code, f'code {code}')} at {stage} row {row}, "
            f"request {req}, page {page}; {count} faulting lane(s) in all, kinds: "
            f"{'; '.join(names)}. The allocator refuses further steps until recover() (it "
            "rebuilds the device tables from the host ledger); audit() shows the damage."
        )
        self.codes, self.count, self.code = codes, count, code
        self.stage, self.row, self.req, self.page = stage, row, req, page

    @classmethod
    def from_error_word(cls, words) -> DeviceFaultError | None:
        """The error for an error word read back to the host (a sequence of ``ERR_WORDS``
        ints, layout ``graphalloc.kernels.abi``), or ``None`` when it records no fault."""
        if not words[ERR_CODES]:
            return None
        return cls(words[ERR_CODES], words[ERR_COUNT], words[ERR_CODE],
                   STAGE_NAMES.get(words[ERR_STAGE], "?"), words[ERR_ROW], words[ERR_REQ],
                   words[ERR_PAGE])


class ReplicaDivergenceError(GraphallocError, RuntimeError):
    """Tensor-parallel replicas of one allocator no longer hold the same state.

    Raised on every rank by the periodic consistency check of
    :class:`graphalloc.replicas.ReplicatedAllocator` (all ranks see the same
    gathered digests, so all raise together and none is left waiting in a
    collective). Attributes: ``step`` (the first replica step whose digests
    differ), ``rank`` (the first global rank that differs from the reference
    there), ``ranks`` (every differing rank), ``reference_rank`` (the majority
    value's rank, ties to the planner), ``fields`` (which parts differ:
    ``ledger``, ``full_to_swa``, ...) and ``last_equal_step`` (the last step
    known equal on every rank, ``-1`` if none was compared).
    """

    def __init__(self, step: int, rank: int, ranks: list, reference_rank: int, fields: list,
                 last_equal_step: int):
        super().__init__(
            f"replica divergence: rank {rank} differs from rank {reference_rank} at step "
            f"{step} in {', '.join(fields)} (differing ranks: {ranks}; all ranks agreed up to "
            f"step {last_equal_step}). Every rank must apply the same operations in the same "
            "order: in replicated mode the same inputs to a deterministic scheduler, in "
            "broadcast mode one follow() per planner step. The caches are no longer "
            "interchangeable: stop serving, then rebuild the diverged ranks from the planner's "
            "state_dict()."
        )
        self.step, self.rank, self.ranks = step, rank, list(ranks)
        self.reference_rank, self.fields = reference_rank, list(fields)
        self.last_equal_step = last_equal_step
