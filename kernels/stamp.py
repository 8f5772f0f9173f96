"""The step stamp: how the device tells the host which submitted steps really ran.

An engine that replays its own graph tells the allocator a step ran by calling
``mark_submitted(p)``; nothing else proves it did. A ``mark_submitted`` without the replay
(or ``alloc.launch(i)``) leaves the host ledger ahead of the device tables, silently. The
stamp makes that visible at the next ``check()``.

Protocol (layout: :mod:`graphalloc.kernels.abi`, "Step stamp")::

    host, at plan time     stamp_buf[i] = s      # the step's stamp: a plan serial, > 0,
                                                 # never reused (a cancelled plan burns
                                                 # one); 0 for a step without rows
    device, program 0 of each step kernel (release, allocate, fused; the twins alike),
    before its row is read:
        old = atomic_max(seen[SEEN_MAX], stamp_buf[i])
        if old < stamp_buf[i]: atomic_add(seen[SEEN_COUNT], 1)
    host, at check()       seen[SEEN_COUNT] == submitted steps with rows (+1 while a
                           planned step is pending: it may have been replayed already)

The two kernels of a non-fused step carry the same stamp, so the step counts once; a
replay of a buffer whose step ran already counts nothing; a step with no rows carries
stamp 0, so even a full-grid replay of its padded buffer counts nothing, and the host does
not count it either. Stamps grow with every plan, so a count
below the host's is a submitted step that never ran, and the host names it exactly when its
stamp is above ``seen[SEEN_MAX]``; a count above it is a step that ran but was never
submitted (a cancelled step's buffer replayed).

Cost: per launched kernel, program 0 only, one 8-byte read of the pinned stamp and one
8-byte atomic (a second one when the step is new); no other program reads it (a value every
program read from host memory would cost hundreds of microseconds). Nothing is read back
until ``check()``, which synchronises anyway.

``record_stamp`` (a device function the step kernels call) and ``record_stamp_torch`` (the
twins' form) do the same; :func:`stamp_args` gives a launch its two pointers and the
``STAMP`` constexpr (off: nothing compiled in, for launches outside an allocator).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .abi import SEEN_COUNT, SEEN_MAX, SEEN_WORDS
from .errors import TensorSpecError

__all__ = ["record_stamp", "record_stamp_torch", "stamp_args", "check_stamp",
           "new_seen_word"]

_MAX, _COUNT = tl.constexpr(SEEN_MAX), tl.constexpr(SEEN_COUNT)


def new_seen_word(device: torch.device | str) -> torch.Tensor:
    """The device word the step kernels count steps in: int64 ``[SEEN_WORDS]``, zeroed."""
    return torch.zeros(SEEN_WORDS, dtype=torch.int64, device=device)


@triton.jit
def record_stamp(stamp_ptr, seen_ptr, pid):
    """Program 0 of a step kernel: count the step once (see the module docstring)."""
    if pid == 0:
        stamp = tl.load(stamp_ptr)
        old = tl.atomic_max(seen_ptr + _MAX, stamp)
        if old < stamp:
            tl.atomic_add(seen_ptr + _COUNT, stamp * 0 + 1)


def record_stamp_torch(stamp: torch.Tensor | None, seen: torch.Tensor | None) -> None:
    """Twin of :func:`record_stamp` (fixed-shape, sync-free; the stamp may be pinned)."""
    if stamp is None:
        return
    value = stamp.reshape(1).to(seen.device, non_blocking=True)
    newer = seen[SEEN_MAX:SEEN_MAX + 1] < value
    seen[SEEN_COUNT:SEEN_COUNT + 1] += newer.to(torch.int64)
    torch.maximum(seen[SEEN_MAX:SEEN_MAX + 1], value, out=seen[SEEN_MAX:SEEN_MAX + 1])


def check_stamp(stamp, seen, table: torch.Tensor) -> None:
    """Launcher checks (attribute reads only): both or neither; ``stamp`` int64 with one
    element, on the tables' device or pinned; ``seen`` int64 ``[SEEN_WORDS]`` there."""
    if stamp is None and seen is None:
        return
    if stamp is None or seen is None:
        raise TensorSpecError("stamp and seen go together: pass both (the allocator's "
                              "DescriptorRing.stamp(i) and DeviceState.seen_buf) or neither")
    for name, t, n in (("stamp", stamp, 1), ("seen", seen, SEEN_WORDS)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.numel() < n:
            raise TensorSpecError(f"{name} must be an int64 tensor of at least {n} "
                                  f"element(s), got {t!r:.60}")
    if seen.device != table.device:
        raise TensorSpecError(f"seen is on {seen.device} but the tables on {table.device}")
    if stamp.device != table.device and not (stamp.device.type == "cpu" and stamp.is_pinned()):
        raise TensorSpecError(f"stamp is on {stamp.device} but the tables on {table.device}: "
                              "pass pinned host memory or a device tensor")


def stamp_args(stamp, seen, err) -> tuple:
    """A launch's ``(stamp_ptr, seen_ptr, STAMP)``: the error word stands in when off."""
    if stamp is None:
        return err, err, False
    return stamp, seen, True
