"""The undo journal: every write a step's planning makes to host state, recorded so the
step can be taken back.

One transaction is open at a time (one step is planned, then run or cancelled, before the
next is planned). The numpy reference planner writes the ledger and the page mirror in
place through :meth:`Journal.put` / :meth:`Journal.add`, which keep the old values; the
compiled planner keeps its own undo log over the same arrays (in C, for speed) and is
driven through the same three calls by :class:`graphalloc.plan.transaction.Transaction`:

================  ===============================================================
call              effect
================  ===============================================================
``mark()``        a position in the log: the start of a transaction or a dry run
``rollback(m)``   undo every write after ``m``, newest first (a refusal, a cancel,
                  a dry run such as ``fits()``)
``commit()``      forget the log (the step was submitted: its writes are final)
================  ===============================================================

Cost: O(values written) per write (the old values are copied), O(entries) per rollback.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Journal"]


class Journal:
    """Undo log of in-place writes to numpy arrays (see the module docstring)."""

    __slots__ = ("_log",)

    def __init__(self) -> None:
        self._log: list = []

    def put(self, arr: np.ndarray, index, values) -> None:
        """``arr[index] = values``, journaled (``index``: an int, an int array or a tuple of
        them; no duplicate indices)."""
        self._log.append((arr, index, arr[index].copy()))
        arr[index] = values

    def add(self, arr: np.ndarray, index, delta) -> None:
        """``arr[index] += delta`` counting repeated indices, journaled."""
        self._log.append((arr, index, arr[index].copy()))
        np.add.at(arr, index, delta)

    def mark(self) -> int:
        return len(self._log)

    def rollback(self, mark: int = 0) -> None:
        """Undo every write after ``mark`` (newest first)."""
        log = self._log
        while len(log) > mark:
            arr, index, old = log.pop()
            arr[index] = old

    def commit(self) -> None:
        """Keep every write: the log is forgotten."""
        self._log.clear()

    def __len__(self) -> int:
        return len(self._log)
