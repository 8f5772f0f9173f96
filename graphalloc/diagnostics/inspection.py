"""The sanctioned synchronisation points of an allocator: faults, audits, snapshots, state.

These read the device on purpose (inside :func:`~graphalloc.diagnostics.sync_points.sync_allowed`,
so they may be called under ``torch.cuda.set_sync_debug_mode("error")``); nothing on the
per-step path calls them. ``check()`` belongs where the engine synchronises anyway: it reads
the 8-word device error word (waiting for the steps already queued) and raises
:class:`~graphalloc.errors.DeviceFaultError` naming the stage, row, request and page.
"""

from __future__ import annotations

import torch

from ..errors import DeviceFaultError
from .sync_points import sync_allowed

__all__ = ["read_fault"]


def read_fault(config, state, sync: bool = False) -> DeviceFaultError | None:
    """The fault a kernel recorded since the last reset, or ``None`` (reads the device;
    ``sync=True`` synchronises the whole device first, for faults from other streams)."""
    with sync_allowed():
        if sync and config.device.type == "cuda":
            torch.cuda.synchronize(config.device)  # sync ok: requested by the caller
        words = state.err_buf.cpu().tolist()  # sync ok: the documented check point
    return DeviceFaultError.from_error_word(words)
