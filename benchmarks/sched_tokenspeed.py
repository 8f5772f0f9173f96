"""TokenSpeed's real scheduler as a peer in the scheduler benchmark, on the same trace.

TokenSpeed (``tokenspeed-scheduler`` on the package index: its C++ scheduler with Python
bindings, no GPU needed) is not a re-implementation: it is the peer's own code, installed.
It is a whole scheduler -- it chooses which requests run and how prefills are chunked --
so it cannot be made to take the trace's decisions step by step; it is given the trace's
WORK instead and plans its own iterations::

    per iteration k     advance(ExecutionEvent): the sampled token of every request its
                        previous plan decoded or finished prefilling (ExtendResult), and
                        Finish for the requests the trace releases at step k (deferred
                        until TokenSpeed decodes them, if it still prefills them)
                        submit_requests(RequestSpec per request the trace admits at k:
                        its prompt, the trace's token ids)
                        next_execution_plan(): TokenSpeed's plan of the iteration (the
                        forward batch, its block tables, pages to copy or zero)

Timed: those three calls (host, perf_counter_ns), per iteration, over the trace's
measured steps after its bootstrap and warm-up; ``plan_us`` is ``next_execution_plan``
alone. Reading the plan back into Python (request ids, input lengths) is the benchmark's
bookkeeping and is not timed. Configuration from the trace: two cache groups, FULL and
sliding-window (the model window), ``block_granularity`` = the page size, device pages =
3 x (both baseline pools) + 64 (a device page holds one page of each group, and it
reserves each request's prompt + ``max_new_tokens`` -- the trace's output length -- ahead:
so it never runs short and never retracts), ``max_batch_size`` =
graphalloc's ``max_reqs``, ``max_scheduled_tokens`` = the chunked-prefill budget, mixed
prefill + decode batches (as the trace), its prefix cache on with a prefix workload and
off otherwise, no host tier.

Nothing is compared page by page (TokenSpeed hands out its own pages on its own
schedule): what is reported is the iteration's host cost, the requests it scheduled
(mean per plan) and the FULL pages free at the end. Without ``tokenspeed_scheduler``
importable, :data:`AVAILABLE` is False and the benchmark says the peer was skipped and
why. ``--tokenspeed-path`` appends a directory (the site-packages of a separate virtual
environment) to ``sys.path``, after the project's own packages.
"""

from __future__ import annotations

import sys
import time

import numpy as np

__all__ = ["AVAILABLE", "REASON", "VERSION", "load", "measure", "markdown_lines",
           "graphalloc_key", "placeholder_argv"]

AVAILABLE, REASON, VERSION = False, "not loaded", None
FACTOR = 3.0
_ts = None


def load(path: str | None = None) -> bool:
    """Import ``tokenspeed_scheduler`` (``path`` appended to ``sys.path`` first)."""
    global AVAILABLE, REASON, VERSION, _ts
    if path and path not in sys.path:
        sys.path.append(path)
    try:
        import tokenspeed_scheduler as ts
    except ImportError as exc:
        AVAILABLE, REASON = False, f"tokenspeed_scheduler is not importable ({exc})"
        return False
    try:
        from importlib import metadata
        VERSION = metadata.version("tokenspeed-scheduler")
    except Exception:  # installed without metadata on this path
        VERSION = "unknown"
    _ts, AVAILABLE, REASON = ts, True, ""
    return True


def _stats(samples) -> dict | None:
    a = np.asarray(samples, dtype=np.float64)
    if not a.size:
        return None
    p20, p50, p80, p90 = np.percentile(a, (20, 50, 80, 90))
    return {"p50": float(p50), "p90": float(p90), "p20": float(p20), "p80": float(p80),
            "mean": float(a.mean()), "n": int(a.size)}


class _Replay:
    """TokenSpeed's scheduler fed the trace's work (module docstring)."""

    def __init__(self, trace, pools: tuple[int, int], max_reqs: int):
        ts, spec = _ts, trace.spec
        ps = spec.page_size
        # its device pages are blocks of one page per group, and it reserves a request's
        # prompt + max_new_tokens ahead: three times both pools, so it never runs short
        n_pages = int(FACTOR * (pools[0] + pools[1])) + 64
        cfg = ts.SchedulerConfig()
        cfg.prefix_granularity = ps
        cfg.cache_groups = [
            ts.CacheGroupConfig("full", ps, n_pages, ts.AttnKind.Full),
            ts.CacheGroupConfig("swa", ps, n_pages, ts.AttnKind.SlidingWindow, spec.window)]
        cfg.num_device_pages = n_pages
        cfg.num_host_pages = 1  # no host tier
        cfg.num_snapshot_pages = 1  # never retracts to a host image
        cfg.disable_l2_cache = True
        cfg.disable_prefix_cache = not spec.prefix
        cfg.enable_mixed_prefill_decode = True
        cfg.max_batch_size = max_reqs
        cfg.max_scheduled_tokens = spec.chunk_tokens
        self.config = {"device_pages": n_pages, "page_size": ps,
                       "window": spec.window, "max_batch_size": max_reqs,
                       "max_scheduled_tokens": spec.chunk_tokens,
                       "prefix_cache": bool(spec.prefix), "mixed_prefill_decode": True}
        self.sched = ts.Scheduler(cfg)
        self.trace = trace
        self.tokens, self.prompt = trace.tokens, trace.fill
        # each request's tokens to generate, from the trace (its decodes, plus the token
        # of its prefill's end): TokenSpeed's max_new_tokens, what it plans capacity by
        self.n_out = np.ones(trace.n_requests, dtype=np.int64)
        for step in trace.steps:
            if len(step.decode):
                self.n_out[step.decode] += 1
        self.length: dict[str, int] = {}  # request -> tokens it has (prompt + sampled)
        self.computed: dict[str, int] = {}  # request -> tokens TokenSpeed has computed
        self.decoding: set[str] = set()  # requests TokenSpeed decodes (a token sampled)
        self.finishing: set[str] = set()  # released by the trace, not yet decoding there
        self.scheduled: list[tuple[str, int]] = []  # the last plan's (request, input len)
        self.n_scheduled: list[int] = []

    def _tokens(self, i: int, start: int, stop: int) -> list[int]:
        """Request ``i``'s token ids ``[start, stop)``: the trace's (a prefix workload), or
        made up per request (distinct prompts) where it has none."""
        toks = None if self.tokens is None else self.tokens[i]
        if toks is not None and stop <= len(toks):
            return [int(t) for t in toks[start:stop]]
        return [100 + (i * 7919 + p * 104_729) % 50_000 for p in range(start, stop)]

    def _token(self, rid: str) -> int:
        pos = self.length[rid]
        return self._tokens(int(rid[1:]), pos, pos + 1)[0]

    def iteration(self, st, timed: list | None = None, plan_t: list | None = None) -> None:
        ts = _ts
        event = ts.ExecutionEvent()
        decoding = set(self.decoding)  # before this event: a Finish is valid for these
        for rid, n_in in self.scheduled:
            if rid not in self.length:
                continue
            self.computed[rid] += n_in
            if self.computed[rid] >= self.length[rid]:  # a decode, or the prefill's end
                ev = ts.ForwardEvent.ExtendResult()
                ev.request_id = rid
                ev.tokens = [self._token(rid)]
                event.add_event(ev)
                self.length[rid] += 1
                self.decoding.add(rid)
        for rid in [f"r{i}" for i in st.release.tolist()] + sorted(self.finishing):
            if rid not in self.length:
                continue
            if rid in decoding:  # decoding in TokenSpeed: it can finish
                ev = ts.ForwardEvent.Finish()
                ev.request_id = rid
                event.add_event(ev)
                del self.length[rid], self.computed[rid]
                self.finishing.discard(rid)
                self.decoding.discard(rid)
            else:
                self.finishing.add(rid)
        specs = []
        for i in st.admit.tolist():
            rid = f"r{i}"
            spec = ts.RequestSpec()
            spec.request_id = rid
            n = int(self.prompt[i])
            spec.tokens = self._tokens(i, 0, n)
            spec.max_new_tokens = int(self.n_out[i]) + 1
            specs.append(spec)
            self.length[rid], self.computed[rid] = n, 0
        sched = self.sched
        t0 = time.perf_counter_ns()
        sched.advance(event)
        if specs:
            sched.submit_requests(specs)
        t1 = time.perf_counter_ns()
        plan = sched.next_execution_plan()
        t2 = time.perf_counter_ns()
        if timed is not None:
            timed.append((t2 - t0) / 1e3)
            plan_t.append((t2 - t1) / 1e3)
        out = []
        for op in plan.forward:
            out += zip(op.request_ids, op.input_lengths, strict=True)
        self.scheduled = out
        self.n_scheduled.append(len(out))


def measure(trace, pools: tuple[int, int], max_reqs: int, m0: int, m: int) -> dict:
    """TokenSpeed on ``trace``: steps ``[0, m0)`` untimed, ``[m0, m0 + m)`` timed.
    ``{"skipped": reason}`` when it is not available; ``{"error": ...}`` when it raised."""
    if not AVAILABLE:
        return {"skipped": REASON}
    try:
        rep = _Replay(trace, pools, max_reqs)
        for st in trace.steps[:m0]:
            rep.iteration(st)
        host, plan = [], []
        n0 = len(rep.n_scheduled)
        for st in trace.steps[m0:m0 + m]:
            rep.iteration(st, host, plan)
    except Exception as exc:  # the peer's own refusal: recorded, the run goes on
        return {"error": f"{type(exc).__name__}: {exc}"}
    sched = rep.sched
    return {"version": VERSION, "iteration_us": _stats(host), "plan_us": _stats(plan),
            "scheduled_per_plan": float(np.mean(rep.n_scheduled[n0:])) if m else 0.0,
            "full_pages_free_end": int(sched.cache_group_available_pages("full")),
            "decoding_end": int(sched.decoding_size()),
            "waiting_end": int(sched.waiting_size()),
            "config": rep.config}


def placeholder_argv(argv) -> list[str]:
    """``argv`` with the directory of ``--tokenspeed-path`` replaced by a placeholder (a
    result records where the peer comes from, not this machine's folders)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            out.append("TOKENSPEED_SITE_PACKAGES")
            skip = False
        elif arg == "--tokenspeed-path":
            out.append(arg)
            skip = True
        elif arg.startswith("--tokenspeed-path="):
            out.append("--tokenspeed-path=TOKENSPEED_SITE_PACKAGES")
        else:
            out.append(arg)
    return out


def graphalloc_key(res: dict) -> str:
    """Which host time of graphalloc's to compare: the whole step on a GPU run; on a CPU
    run the step without its device part (the Torch twins run eagerly inside the step
    there, where a GPU would run them asynchronously)."""
    return "host_us" if res.get("device_clock") == "cuda-events" else "host_us_no_device"


def markdown_lines(res: dict) -> list[str]:
    """The benchmark report's section on the TokenSpeed peer (or why it was skipped)."""
    peer = (res.get("peers") or {}).get("tokenspeed") or {}
    lines = ["", "## Real peer: TokenSpeed's scheduler, same trace", ""]
    if not peer.get("available"):
        return lines + [f"Skipped: {peer.get('reason') or 'not run'}. Install "
                        "`tokenspeed-scheduler` (the package index) and pass "
                        "`--tokenspeed-path` (its site-packages) to include it."]
    key = graphalloc_key(res)
    what = ("whole step" if key == "host_us" else
            "whole step less its eager device part (CPU run)")
    lines += [f"TokenSpeed `tokenspeed-scheduler` {peer.get('version')} (its own code, from "
              "the package index) given each configuration's trace (`sched_tokenspeed.py`): "
              "per iteration `advance` (the sampled tokens, the finished requests), "
              "`submit_requests` (the admitted ones) and `next_execution_plan` (its forward "
              "batch with block tables), timed; it schedules by its own policy, so pages are "
              f"not compared. graphalloc + tables: host us, {what}; its host path: the "
              "same step with an executor that launches nothing (`sched_host_path.py`), "
              "where the run has one. Microseconds, p50 / p90.",
              "", "| B | ps | W | interval | graphalloc + tables | TokenSpeed iteration | "
              "TokenSpeed plan alone (p50) | TokenSpeed / graphalloc + tables (p50) | "
              "requests per TokenSpeed plan | graphalloc + tables, host path | TokenSpeed / "
              "host path (p50) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in res["configs"]:
        ts = (c.get("peers") or {}).get("tokenspeed") or {}
        ga = (c.get("impls") or {}).get("graphalloc_tables") or {}
        g = ga.get(key)
        small = " (small pool)" if (c.get("prefix") or {}).get("pool") == "small" else ""
        row = f"| {c['b']} | {c['ps']} | {c['window']} | {c['interval']}{small} | "
        cell = f"{g['p50']:.0f} / {g['p90']:.0f}" if g else "–"
        h = (c.get("host_path") or {}).get("host_us")
        host = f"{h['p50']:.0f} / {h['p90']:.0f}" if h else "–"
        if "iteration_us" not in ts:
            why = ts.get("error") or ts.get("skipped") or "not run"
            lines.append(row + f"{cell} | {why} | – | – | – | {host} | – |")
            continue
        it, pl = ts["iteration_us"], ts["plan_us"]
        ratio = f"{it['p50'] / g['p50']:.1f}x" if g and g["p50"] else "–"
        ratio_host = f"{it['p50'] / h['p50']:.1f}x" if h and h["p50"] else "–"
        lines.append(row + f"{cell} | {it['p50']:.0f} / {it['p90']:.0f} | {pl['p50']:.0f} | "
                     f"{ratio} | {ts['scheduled_per_plan']:.0f} | {host} | {ratio_host} |")
    return lines


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run benchmarks/bench_scheduler.py "
            "instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
