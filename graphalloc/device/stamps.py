"""The host half of the step stamp: which submitted steps the device must have run.

An engine that replays its own graph reports each step with ``mark_submitted(p)``; the
allocator cannot see the replay. Every planned step with rows gets a stamp (a plan serial,
> 0, never reused: a cancelled plan burns its stamp; 0 for a step without rows), written
beside its descriptor buffer; the
step kernels count each stamp they see once on the device (:mod:`graphalloc.kernels.stamp`).
:class:`SubmissionLedger` counts, on the host, the submitted steps that had rows and were
launched by code that stamps (every executor here, ``alloc.launch(i)``), and ``check()``
compares the two counts after waiting for the submitted steps::

    device count <  host count            a submitted step never ran (mark_submitted
                                          without a replay): SubmissionError naming it
    device count >  host count (+1 while  a step ran that was never submitted (a cancelled
                   a step with rows is    step's buffer replayed; a launch that raises
                   pending)               takes its own stamp off the count when it undoes
                                          the step, graphalloc.device.restore)
    otherwise                             clean; the steps checked are forgotten

The step named is exact when its stamp lies above the largest stamp the device saw (the
usual case: the latest steps were not replayed); otherwise the error names the range of
steps since the last clean check. After a :class:`~graphalloc.errors.SubmissionError` the
host ledger and the device tables disagree: the allocator refuses steps until
``recover()``, which rebuilds the device tables from the host ledger (``reset_faults()``
alone is refused while ``audit()`` shows the damage).

Invariants: stamps only grow; ``n_expected`` counts steps since the last reset; the
unchecked list holds at most ``max_unchecked`` entries (the oldest are dropped: naming
then degrades to a range, detection does not). Cost per submitted step: one int add and
one deque append; ``verify`` O(unchecked steps).
"""

from __future__ import annotations

import collections

from ..errors import SubmissionError
from ..kernels.abi import SEEN_COUNT, SEEN_MAX

__all__ = ["SubmissionLedger"]


class SubmissionLedger:
    """Stamps and submitted-step counts of one allocator (see the module docstring)."""

    def __init__(self, ring, max_unchecked: int = 4096):
        self.ring = ring
        self.last_stamp = 0  # the last stamp handed out
        self.n_expected = 0  # submitted steps with rows, launched by stamping code
        # (step number, stamp, buffer) of those steps since the last clean check
        self.unchecked: collections.deque = collections.deque(maxlen=max_unchecked)

    def stamp(self, buffer_index: int, has_rows: bool) -> int:
        """A new stamp for a step with rows (0 for one without: a launch over its padded
        buffer -- a full-grid graph replays one -- counts nothing, and the host expects
        nothing), written beside descriptor buffer ``buffer_index``; returns it."""
        value = 0
        if has_rows:
            self.last_stamp += 1
            value = self.last_stamp
        self.ring.stamp_np[buffer_index] = value
        return value

    def submitted(self, step_number: int, stamp: int, buffer_index: int) -> None:
        """A step with rows was submitted, its kernels launched by stamping code."""
        self.n_expected += 1
        self.unchecked.append((step_number, stamp, buffer_index))

    def reset(self) -> None:
        """The device word was zeroed (``reset_faults()``, ``recover()``): count from
        here."""
        self.n_expected = 0
        self.unchecked.clear()

    def verify(self, seen: list, pending_rows: bool) -> SubmissionError | None:
        """Compare the device's ``seen`` word (read after the submitted steps finished) with
        the host's count; the error, or None (and the checked steps are forgotten)."""
        count, top = int(seen[SEEN_COUNT]), int(seen[SEEN_MAX])
        expected = self.n_expected
        if count < expected:
            return self._missing(count, top)
        if count > expected + pending_rows:
            return SubmissionError(
                f"the device ran {count - expected - pending_rows} step(s) with rows that were "
                f"never submitted (the host submitted {expected} since the last reset, the "
                f"device counted {count}): a cancelled step's buffer was replayed. The device "
                "tables have changed behind the host ledger; the allocator refuses steps until "
                "recover() (it rebuilds the device tables from the host ledger)", expected,
                count, None, None)
        self.unchecked.clear()
        return None

    def _missing(self, count: int, top: int) -> SubmissionError:
        expected = self.n_expected
        never = [entry for entry in self.unchecked if entry[1] > top]
        if never:
            step, stamp, index = never[0]
            which = (f"step #{step} (descriptor buffer {index}, stamp {stamp}) never ran: "
                     f"its stamp is above every stamp the device saw ({top})")
        elif self.unchecked:
            step, _, index = self.unchecked[0]
            which = (f"one of steps #{step} .. #{self.unchecked[-1][0]} (submitted since the "
                     "last clean check) never ran")
        else:
            step = index = None
            which = "the steps never run were submitted before the last clean check"
        return SubmissionError(
            f"{expected - count} submitted step(s) with device work never ran on the device "
            f"(the host submitted {expected} since the last reset, the device counted "
            f"{count}): {which}. mark_submitted(p) was called without replaying the graph "
            "over p's descriptor buffer (or alloc.launch(p.buffer_index)); the host ledger is "
            "now ahead of the device tables. The allocator refuses steps until "
            "recover() (it rebuilds the device tables from the host ledger)", expected,
            count, step, index)
