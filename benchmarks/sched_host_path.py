"""graphalloc's host path alone in the scheduler benchmark: the step with tables, nothing launched.

On a CPU run the allocator's kernels run as their Torch twins inside the step, eagerly,
where a GPU would run them asynchronously after one graph replay. The benchmark subtracts
that eager device part from graphalloc's host time (``host_us_no_device``), but what is
left still runs after tens to hundreds of milliseconds of eager tensor work that flushed
the CPU's caches, so it overstates the host path severalfold. :class:`Run` measures the
host path itself: a second :class:`sched_graphalloc.GraphallocDriver` with tables whose
executor launches nothing (``launch=False``) -- free rows, normalise, plan (the compiled
planner), the descriptor and table rows written, the executor called -- on the same
trace, its measured steps in turn with vLLM's manager (``bench_scheduler._in_turn``: the
order swapped every step, so load on the machine and each other's use of the caches fall
on both alike). On a GPU the step would add one graph-replay call (a few microseconds of
host time) that this figure does not have.

Its page counts are checked against the trace at every step as the measured drivers' are
(``sched_agreement.record``: the same work planned); its device state is never written,
so the device checks do not apply. Cost: graphalloc's step (its docstrings) plus one
``perf_counter_ns`` pair per step.
"""

from __future__ import annotations

import gc
import time

import numpy as np
from sched_agreement import record
from sched_baseline_kernels import NULL_CLOCK
from sched_graphalloc import GraphallocDriver

__all__ = ["Run", "start"]


def _stats(samples) -> dict | None:
    a = np.asarray(samples, dtype=np.float64)
    if not a.size:
        return None
    p20, p50, p80, p90 = np.percentile(a, (20, 50, 80, 90))
    return {"p50": float(p50), "p90": float(p90), "p20": float(p20), "p80": float(p80),
            "mean": float(a.mean()), "n": int(a.size)}


class Run:
    """graphalloc + tables with nothing launched, replayed up to the measured steps by
    :meth:`start`, then one timed :meth:`step` per iteration (in order), :meth:`finish`
    for the measured steps no measured step accompanied, :meth:`result` the record. One
    that raises keeps its error; its later steps are skipped."""

    def __init__(self, trace, cfg, strict: bool = True):
        spec = trace.spec
        cache = (dict(tokens=trace.tokens, prompt_lens=trace.fill) if spec.prefix else {})
        self.trace, self.cfg, self.strict = trace, cfg, strict
        self.driver = None
        self.cache = cache
        self.counts = np.zeros((len(trace.steps), 4), dtype=np.int64)
        self.host: list[float] = []
        self.plan: list[float] = []
        self.error = None
        self.next = 0

    def _guard(self, fn) -> None:
        if self.error is not None:
            return
        try:
            fn()
        except Exception as exc:  # recorded, the run goes on
            self.error = f"{type(exc).__name__}: {exc}"

    def _one(self, st, timed: bool) -> None:
        if st.index != self.next:
            raise RuntimeError(f"host path: step {st.index} given, {self.next} due")
        d = self.driver
        t0 = time.perf_counter_ns()
        d.step(st, NULL_CLOCK)
        t1 = time.perf_counter_ns()
        if timed:
            self.host.append((t1 - t0) / 1e3)
            self.plan.append(d.plan_ns / 1e3)
        record(d, st, st.index, self.counts, None, self.strict)
        self.next += 1

    def start(self, m0: int) -> Run:
        """Build the driver and replay steps ``[0, m0)`` (untimed)."""
        def go():
            self.driver = GraphallocDriver(
                self.cfg, tables=True, launch=False, n_requests=self.trace.n_requests,
                prefix_cache=bool(self.cache), **self.cache)
            for st in self.trace.steps[:m0]:
                self._one(st, False)
        self._guard(go)
        return self

    def step(self, st) -> None:
        """One timed iteration, trace step ``st`` (the next one; the caller keeps the
        collector off, as for its drivers)."""
        self._guard(lambda: self._one(st, True))

    def finish(self, stop: int) -> None:
        """Step alone (collector off) up to trace step ``stop``."""
        gc.collect()
        gc.disable()
        try:
            while self.error is None and self.next < stop:
                self.step(self.trace.steps[self.next])
        finally:
            gc.enable()

    def result(self) -> dict:
        """``host_us`` (the whole step, nothing launched) and ``plan_us`` (its planning:
        the call to the executor), or ``{"error": ...}``."""
        if self.error is not None:
            return {"error": self.error}
        return {"host_us": _stats(self.host), "plan_us": _stats(self.plan),
                "counts_checked": bool(self.strict), "steps": int(self.next)}

    def close(self) -> None:
        if self.driver is not None:
            self.driver.close()


def start(trace, cfg, m0: int, strict: bool = True) -> Run:
    """A :class:`Run` replayed up to step ``m0`` (``strict``: its page counts must equal
    the trace's at every step, as the measured drivers')."""
    return Run(trace, cfg, strict).start(m0)


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run benchmarks/bench_scheduler.py "
            "instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
