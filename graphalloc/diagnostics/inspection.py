"""The sanctioned synchronisation points of an allocator: faults, audits, snapshots, state.

These read the device on purpose (inside :func:`~graphalloc.diagnostics.sync_points.sync_allowed`,
so they may be called under ``torch.cuda.set_sync_debug_mode("error")``); nothing on the
per-step path calls them. ``check()`` belongs where the engine synchronises anyway: it waits
for the submitted steps (each descriptor buffer's event), reads the 8-word device error
word and the 2-word step count in one transfer, and raises
:class:`~graphalloc.errors.DeviceFaultError` naming the stage, row, request and page, or
:class:`~graphalloc.errors.SubmissionError` when the steps the device ran are not the steps
the host submitted (:mod:`graphalloc.device.stamps`).
"""

from __future__ import annotations

import torch

from ..errors import DeviceFaultError, GraphallocError
from ..kernels.abi import ERR_WORDS
from ..parts import DeviceParts, PipelinePart
from .sync_points import sync_allowed

__all__ = ["read_fault", "read_words"]


def read_words(config, state, ring=None, sync: bool = False) -> tuple[list, list]:
    """``(error word, seen word)`` as lists of ints, after the submitted steps finished
    (``ring``'s events; ``sync=True`` synchronises the whole device first, for work on
    other streams). Reads the device."""
    with sync_allowed():
        if config.device.type == "cuda":
            if sync:
                torch.cuda.synchronize(config.device)  # sync ok: requested by the caller
            elif ring is not None:
                ring.wait_submitted()
        words = torch.cat((state.err_buf, state.seen_buf)).cpu().tolist()  # sync ok: check
    return words[:ERR_WORDS], words[ERR_WORDS:]


def read_fault(config, state, sync: bool = False) -> DeviceFaultError | None:
    """The fault a kernel recorded since the last reset, or ``None`` (reads the device)."""
    return DeviceFaultError.from_error_word(read_words(config, state, None, sync)[0])


def first_error(parts: DeviceParts, pipeline: PipelinePart,
                sync: bool = False) -> GraphallocError | None:
    """What ``check()`` raises: a device fault first, then a submission mismatch; None when
    healthy (the steps checked are then forgotten). ``parts``: the allocator's
    :class:`~graphalloc.parts.DeviceParts`; ``pipeline``: its
    :class:`~graphalloc.parts.PipelinePart`."""
    err, seen = read_words(parts.config, parts.state, parts.ring, sync)
    fault = DeviceFaultError.from_error_word(err)
    if fault is not None:
        return fault
    pending = pipeline.pending
    pending_rows = pending is not None and bool(pending.n_release_rows or pending.n_alloc_rows)
    return pipeline.submissions.verify(seen, pending_rows)
