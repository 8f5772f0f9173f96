"""Letting a test go on stepping over device tables it corrupted on purpose.

After a fault ``reset_faults()`` is refused while the tables disagree with the host
(``recover()`` is the way back, and it would repair the damage). A test of how the kernels
contain a fault that the damage causes later (a sink marker popped, say) needs the damage to
stay: :func:`keep_damage` clears the reported fault and nothing else. Never in an engine.
"""

from __future__ import annotations

from graphalloc.diagnostics.recovery import clear_faults

__all__ = ["keep_damage"]


def keep_damage(alloc) -> None:
    """Zero the error word and the step count, accept steps again; the tables stay as they
    are."""
    clear_faults(alloc.parts, alloc.pipeline)
