"""The sanctioned host/device synchronisation points.

The fast path (planning, launching, replaying) never synchronises; the
integrity checks, snapshots, ``check()`` and recovery read the device on
purpose. They run inside :func:`sync_allowed`, which lifts
``torch.cuda.set_sync_debug_mode("error")`` for their duration, so an engine
(or a test) can keep the debug mode on around its whole loop and still call them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["sync_allowed"]


@contextlib.contextmanager
def sync_allowed() -> Iterator[None]:
    if not torch.cuda.is_available():
        yield
        return
    old = torch.cuda.get_sync_debug_mode()
    if old:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        if old:
            torch.cuda.set_sync_debug_mode(old)
