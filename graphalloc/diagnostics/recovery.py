"""Faults and the way back: ``check()``, ``reset_faults()``, ``recover()``.

A fault reported by ``check()`` (:class:`~graphalloc.errors.DeviceFaultError`, a
:class:`~graphalloc.errors.SubmissionError`) or a launch whose restore failed leaves the
allocator *faulted*: it refuses steps. The host ledger is the truth and the device tables
its projection, so the way back is to project again (:func:`recover`,
:func:`graphalloc.device.restore.project_all`); :func:`reset_faults` only clears a report,
and is refused while the tables disagree with the host, so no step ever runs on tables
that are still wrong. These read the device on purpose (sanctioned sync points).

Invariants: after ``recover()`` returns, ``audit()`` is empty and the allocator holds what
one that never faulted holds; ``faulted`` is False only when the last audit was clean (or
a state dict just loaded, :func:`clear_faults`). Each function takes the allocator's
:class:`~graphalloc.parts.DeviceParts` and its pipeline (:class:`~graphalloc.parts.PipelinePart`:
the fault flag, the submissions, the pending step); the open blocks' rule (no reset or
recover inside a ``scheduler_step()`` or ``free_group()`` block) is the allocator's
(:func:`graphalloc.operations.idle`), checked before these run. Cost: ``check()`` one 80-byte read;
``reset_faults()`` one audit; ``recover()`` one synchronisation, every table written once
and one audit.
"""

from __future__ import annotations

import torch

from ..errors import ContractError, IntegrityError, PendingStepError
from ..parts import DeviceParts, PipelinePart
from . import integrity
from .inspection import first_error
from .sync_points import sync_allowed

__all__ = ["check", "clear_faults", "reset_faults", "recover"]


def check(parts: DeviceParts, pipeline: PipelinePart, sync: bool) -> None:
    if not isinstance(sync, bool):
        raise ContractError(f"check(sync=...) takes a bool, got {sync!r}")
    error = first_error(parts, pipeline, sync)
    if error is not None:
        pipeline.faulted = True
        raise error


def clear_faults(parts: DeviceParts, pipeline: PipelinePart) -> None:
    """Zero the error word and the step count; steps are accepted again (the caller knows
    the device tables are right: a state dict just loaded and audited)."""
    parts.state.err_buf.zero_()
    parts.state.seen_buf.zero_()
    pipeline.submissions.reset()
    pipeline.faulted = False


def _idle(pipeline: PipelinePart, what: str) -> None:
    if pipeline.pending is not None:
        raise PendingStepError(f"{what}() with a planned step pending: run() or cancel() it "
                               "first")


def reset_faults(parts: DeviceParts, pipeline: PipelinePart) -> None:
    """Clear a reported fault, refused while the device tables disagree with the host: then
    nothing changes and ``IntegrityError`` names the first finding (``recover()`` is the
    way back)."""
    _idle(pipeline, "reset_faults")
    findings = [f for f in integrity.audit(parts) if f.kind != "device_fault"]
    if findings:
        pipeline.faulted = True
        raise IntegrityError(
            f"reset_faults(): the device tables disagree with the host ledger ({findings[0]}"
            f"; {len(findings)} finding(s) in all), so steps stay refused: recover() rebuilds "
            "the device tables from the host ledger")
    clear_faults(parts, pipeline)


def recover(parts: DeviceParts, pipeline: PipelinePart) -> None:
    """Wait for the device, write every device table again from the host ledger, clear the
    error word and the step count, audit; steps are accepted again when the audit is clean
    (else ``IntegrityError``, steps stay refused)."""
    from ..device.restore import project_all

    _idle(pipeline, "recover")
    try:
        parts.ledger.check_host_invariants()
    except IntegrityError as exc:
        pipeline.faulted = True
        raise IntegrityError(f"recover(): the host ledger itself is broken ({exc}); there is "
                             "nothing to rebuild the device from: build a new allocator or "
                             "load_state_dict() a good state") from None
    with sync_allowed():
        if parts.config.device.type == "cuda":
            torch.cuda.synchronize(parts.config.device)  # sync ok: recover() waits on purpose
        project_all(parts)
        clear_faults(parts, pipeline)
        pipeline.output_epoch += 1  # outputs of earlier steps are not vouched for
        findings = integrity.audit(parts)
    if findings:
        pipeline.faulted = True
        more = "" if parts.config.ring_mode else " (a planner bug: please report it)"
        raise IntegrityError(
            f"recover(): the device still disagrees with the host after the rebuild "
            f"({findings[0]}; {len(findings)} finding(s) in all){more}. Ring mode keeps no "
            "host copy of page ids, so a damaged req_to_token or ring_pages cannot be "
            "rebuilt: build a new allocator or load_state_dict() a good state. Steps stay "
            "refused")
