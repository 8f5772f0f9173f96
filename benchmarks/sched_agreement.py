"""What every implementation of the scheduler benchmark must report alike, step by step.

Each driver reports ``last_counts`` after every step (FULL allocated, SWA allocated, FULL
freed, SWA freed pages); a driver with ``prefix_cache`` also reports ``state()`` (free,
used, cached pages of the FULL pool, then of the SWA pool) and ``hit_tokens`` per request.

Without a prefix cache (graphalloc, and both baselines on a trace without a prefix
workload): the four counts equal the trace's ``expect`` at every step.

With one (the baselines on a prefix workload; graphalloc runs the same trace with its
cache off, against ``expect``, as above)::

    every step      FULL allocated, SWA allocated, FULL freed == the trace's expect_cache
                    (freed = content dropped: the partial last page of each release);
                    free + used + cached == the pool, per pool (no page lost)
    every request   hit tokens == the trace's (what a cache that never evicts gives)
    every step      the FULL pool's (free, used, cached) equal across the caching
                    implementations: they cache the same FULL pages
    reported        SWA freed and the SWA pool's state: they differ by design (SGLang
                    frees a request's SWA pages outside the window unless the tree owns
                    them, and locks SWA by tree node; vLLM keeps every full SWA block
                    cached in its free queue), so do not compare SWA page ids or counts

With a pool small enough to evict (``strict=False``) only conservation is required; the
counts, hits and states are reported (which entries each engine evicts differs, and a
hit lost to eviction is recomputed: the allocations differ too). Page ids are never
compared: each implementation hands out its own.
"""

from __future__ import annotations

import numpy as np
from sched_baselines import NULL_CLOCK

__all__ = ["AgreementError", "FIELDS", "expected_counts", "record", "replay",
           "check_agreement", "check_prefix", "live_ids"]

FIELDS = ("full_allocated", "swa_allocated", "full_freed", "swa_freed")
STATE_FIELDS = ("full_free", "full_used", "full_cached", "swa_free", "swa_used",
                "swa_cached")


class AgreementError(AssertionError):
    """Implementations freed or allocated different page counts at some step, hit
    different prefixes, or lost pages."""


def expected_counts(driver, st) -> tuple[tuple, int]:
    """The step's expected counts for ``driver`` and how many leading fields compare."""
    if getattr(driver, "prefix_cache", False):
        return st.expect_cache, 3
    return st.expect, 4


def _disagreement(st, k: int, name: str, got: dict, expect, later: int = 0):
    fields = ", ".join(FIELDS[:len(expect)])
    return AgreementError(
        f"{name} differs at step {k} ({st.phase}, {st.step_class}: {len(st.release)} "
        f"releases, {len(st.evict)} evictions, {len(st.decode)} decodes, "
        f"{len(st.extend_ids)} chunks){f' and {later} later steps' if later else ''}: the "
        f"trace expects ({fields}) = {list(expect)}, got {got}")


def record(driver, st, k: int, counts: np.ndarray, states, strict: bool = True) -> None:
    """After ``driver.step(st)``: keep its counts (and, when ``states`` is given, its pool
    state) as step ``k``; raise :class:`AgreementError` if a page was lost or, when
    ``strict``, if the counts differ from the trace's."""
    got = driver.last_counts
    counts[k] = got
    if states is not None:
        s = states[k] = driver.state()
        n_full, n_swa = driver.pool_sizes
        if sum(s[:3]) != n_full or sum(s[3:]) != n_swa:
            raise AgreementError(
                f"{driver.name} lost pages at step {k}: (free, used, cached) FULL "
                f"{list(s[:3])} of {n_full}, SWA {list(s[3:])} of {n_swa}")
    if strict:
        expect, m = expected_counts(driver, st)
        if tuple(got[:m]) != tuple(expect):
            raise _disagreement(st, k, driver.name, {driver.name: [int(x) for x in got]},
                                expect)


def replay(driver, steps, start: int, stop: int, counts: np.ndarray, states=None,
           strict: bool = True) -> None:
    """Run steps ``[start, stop)`` untimed, recording each step's counts (and state);
    the first step that differs from the trace (or loses a page) raises at once."""
    for k in range(start, stop):
        st = steps[k]
        driver.step(st, NULL_CLOCK)
        record(driver, st, k, counts, states, strict)


def check_agreement(trace, counts: dict, stop: int, cached=(), strict: bool = True) -> dict:
    """Per step, every implementation's counts equal the trace's (``cached``: the names
    running with a prefix cache, compared on ``expect_cache``'s three fields and only
    when ``strict``): raises :class:`AgreementError` naming the first step that differs."""
    expect = trace.expected(0, stop)
    expect_cache = trace.expected_cache(0, stop) if cached else None
    for name, got in counts.items():
        if name in cached:
            if not strict:
                continue
            exp, m = expect_cache, 3
        else:
            exp, m = expect, 4
        bad = np.flatnonzero((got[:stop, :m] != exp).any(axis=1))
        if len(bad):
            k = int(bad[0])
            others = {n: [int(x) for x in c[k]] for n, c in counts.items()}
            raise _disagreement(trace.steps[k], k, name, others, [int(x) for x in exp[k]],
                                len(bad) - 1)
    out = {"steps_compared": int(stop), "equal": True,
           "totals": [int(x) for x in expect.sum(axis=0)], "fields": list(FIELDS)}
    if cached:
        out["totals_with_cache"] = [int(x) for x in expect_cache.sum(axis=0)]
        out["compared_with_cache"] = ("full_allocated, swa_allocated, full_freed" if strict
                                      else "nothing (small pool: conservation only)")
    return out


def check_prefix(trace, drivers: dict, counts: dict, states: dict, stop: int,
                 strict: bool = True) -> dict:
    """Hits, FULL pool states and what each caching implementation freed and cached over
    steps ``[0, stop)`` (module docstring); raises :class:`AgreementError` when
    ``strict`` and hits or FULL states differ."""
    hits = trace.hits(stop)
    admitted = hits >= 0
    prompt = int(trace.fill[admitted].sum())
    out = {"workload": trace.spec.prefix, "strict": strict,
           "trace_hit_rate": float(hits[admitted].sum()) / prompt if prompt else 0.0,
           "requests_admitted": int(admitted.sum()), "impls": {}}
    for name, d in drivers.items():
        got = d.hit_tokens[admitted]
        c, s = counts[name][:stop], states[name][:stop]
        equal = bool(np.array_equal(got, hits[admitted]))
        out["impls"][name] = {
            "hit_rate": float(got.sum()) / prompt if prompt else 0.0,
            "hits_equal_trace": equal,
            "recomputed_tokens": int(d.recomputed_tokens),
            "freed_total": [int(x) for x in c[:, 2:].sum(axis=0)],
            "evicted_pages": [int(x) for x in d.evicted_pages],
            "final_state": [int(x) for x in s[-1]] if len(s) else None,
            "peak_cached": [int(s[:, 2].max()), int(s[:, 5].max())] if len(s) else None}
        if strict and not equal:
            bad = np.flatnonzero(got != hits[admitted])[0]
            rid = int(np.flatnonzero(admitted)[bad])
            raise AgreementError(f"{name} hits {int(d.hit_tokens[rid])} tokens of request "
                                 f"{rid}, the trace {int(hits[rid])}")
    names = list(drivers)
    same = all(np.array_equal(states[names[0]][:stop, :3], states[n][:stop, :3])
               for n in names[1:])
    out["full_state_equal"] = bool(same)
    out["state_fields"] = list(STATE_FIELDS)
    if strict and not same:
        k = int(np.flatnonzero((states[names[0]][:stop, :3] != states[names[1]][:stop, :3])
                               .any(axis=1))[0])
        raise AgreementError(f"the FULL pool states differ at step {k}: " + ", ".join(
            f"{n} {list(states[n][k, :3])}" for n in names) + " (free, used, cached)")
    return out


def live_ids(trace, stop: int) -> list[int]:
    live: set = set()
    for st in trace.steps[:stop]:
        live.update(st.admit.tolist())
        live.difference_update(st.release.tolist())
    return sorted(live)


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run benchmarks/bench_scheduler.py "
            "instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
