"""The scheduler benchmark's workload: a seeded continuous-batching trace that every side replays.

:func:`generate` runs a small scheduler on the host -- no allocator, only lengths -- and
records each iteration's decisions as a :class:`TraceStep`. The graphalloc driver and the
two baselines (``sched_graphalloc.py``, ``sched_baselines.py``) replay the same steps, so
who finishes, who is admitted, every chunk size and every eviction are identical; each
implementation keeps its own lengths and frontiers and frees and allocates from its own
bookkeeping. ``TraceStep.expect`` holds the page counts this generator's own model
predicts (FULL allocated, SWA allocated, FULL freed, SWA freed), the reference the three
are checked against step by step.

The scheduler (one iteration = one step, in this order)::

    release    requests that decoded their last token in the previous step
    evict      window rule, new frontier = max(f, floor_page(max(0, L - Wa))), L the
               length when the step begins, Wa = W - 1 the allocator's window for a model
               window W: every decoding request whose decode count is a multiple of
               ``eviction_interval`` (SGLang's interval; 1 = every step), and every
               request continuing a chunked prefill (SGLang evicts at every chunk)
    prefill    a chunked-prefill token budget C: requests already prefilling continue
               first (oldest first), then waiting requests are admitted (first come, first
               served) while fewer than B run; a chunk is min(what is left, budget left)
    decode     every running request whose prefill is complete: one token

Requests arrive as a Poisson process (rate 1.25 B / mean output length per step) on top
of a backlog of max(2, B / 4) waiting requests, so the queue rarely drains and B requests
run, with log-normal prompt and output lengths. The run starts from B requests already
part-way through their output (an age drawn uniformly from [0, output)): a *bootstrap*
phase prefills their prompt plus age under the same budget with no decodes and no
arrivals (a request whose fill completes is evicted by the window rule in the next step,
so the first decode step does not free every request's last chunk at once), after which
every phase (``warmup``, ``measure``, ``profile``) is the steady-state scheduler. The
trace is a prefix-stable function of the spec and the seed: a longer trace starts with
the same steps.

Pages (ps = page size): a request at length L holds FULL pages ``[0, ceil(L/ps))`` and
SWA pages ``[f/ps, ceil(L/ps))``; a release frees both ranges; an eviction frees SWA
``[f/ps, f'/ps)``; n new tokens take ``ceil((L+n)/ps) - ceil(L/ps)`` pages of each pool.
Frees run before allocations within a step (the pages freed serve the step's
allocations), so the pools need ``peak_full`` / ``peak_swa`` pages.

Prefix caching (``WorkloadSpec.prefix``: ``"system-prompt"`` or ``"multi-turn"``, see
``sched_prefix.py``): requests get token ids (``Trace.tokens``) and an admission starts
from its hit h (``TraceStep.hit``): length and computed tokens h, the chunk from h. Two
replays of the same decisions::

    with a cache     allocates the pages of [h, h + n) (``expect_cache`` = FULL and SWA
                     pages allocated, FULL pages freed: the partial last page of each
                     release, every whole page going to the cache)
    without a cache  allocates [0, h + n) at admission (``extend_n_nocache`` = the chunk
                     plus the hit), frees as above; ``expect`` and every size of the
                     Trace (peaks, lanes, rows, tokens) are this replay's

With ``prefix`` None the trace is the one this module always produced (same draws, same
steps); the hits are 0 and ``extend_n_nocache`` is ``extend_n``.
"""

from __future__ import annotations

import collections

import numpy as np
from sched_prefix import PrefixModel
from sched_trace import _EMPTY, STEP_CLASSES, Trace, TraceStep, WorkloadSpec

__all__ = ["WorkloadSpec", "TraceStep", "Trace", "generate", "STEP_CLASSES"]


class _State:
    """Per-request host state of the generator, indexed by request id (grows)."""

    FIELDS = ("fill", "out", "pre", "dec", "length", "front")

    def __init__(self, capacity: int):
        for name in self.FIELDS:
            setattr(self, name, np.zeros(capacity, dtype=np.int64))
        self.n = 0

    def new(self, fill: int, out: int, dec: int) -> int:
        if self.n == len(self.fill):
            for name in self.FIELDS:
                old = getattr(self, name)
                setattr(self, name, np.concatenate([old, np.zeros_like(old)]))
        i = self.n
        self.fill[i], self.out[i], self.dec[i] = fill, out, dec
        self.n += 1
        return i


def _ceil_div(a, b):
    return -(-a // b)


def generate(spec: WorkloadSpec, n_warmup: int, n_measure: int, n_profile: int = 0) -> Trace:
    """The trace: bootstrap, then ``n_warmup``, ``n_measure`` and ``n_profile`` steps.

    Cost: O(B) numpy per step plus O(chunks) Python (a few per step; the bootstrap admits
    up to C / prompt requests a step); with a prefix workload O(pages) hashing per request
    and O(waiting) admission checks per step."""
    rng = np.random.default_rng(spec.seed)
    ps, wa, interval = spec.page_size, spec.alloc_window, spec.eviction_interval
    B, C = spec.n_running, spec.chunk_tokens
    px = PrefixModel(spec) if spec.prefix else None
    arrival_rate = 1.25 * B / spec.mean_output()
    if spec.prefix == "multi-turn":  # new conversations; their later turns come on top
        arrival_rate /= spec.turns_mean
    st = _State(4 * B + 64)

    def draw_lengths(n: int) -> tuple[np.ndarray, np.ndarray]:
        prompt = np.exp(rng.normal(np.log(spec.prompt_median), spec.sigma, n)).round()
        out = np.exp(rng.normal(np.log(spec.output_median), spec.sigma, n)).round()
        return (np.clip(prompt, 1, spec.max_prompt).astype(np.int64),
                np.clip(out, 1, spec.max_output).astype(np.int64))

    def new_request(prompt: int, out: int, age: int = 0, parent: int = -1) -> int:
        if px is not None and parent < 0:
            prompt = px.prompt_len(prompt)
        rid = st.new(prompt + age, out, age)
        if px is not None:
            px.add(rid, prompt, out, parent)
        return rid

    waiting: collections.deque = collections.deque()
    prompt0, out0 = draw_lengths(B)
    age0 = (rng.random(B) * out0).astype(np.int64)  # in [0, out)
    for p, o, a in zip(prompt0, out0, age0, strict=True):
        waiting.append(new_request(int(p), int(o), int(a)))
    n_backlog = max(2, B // 4)  # fresh requests already waiting: B keep running
    for p, o in zip(*draw_lengths(n_backlog), strict=True):
        waiting.append(new_request(int(p), int(o)))

    running: dict[int, None] = {}  # admission order
    to_release: list[int] = []
    next_turns: list[tuple] = []  # (previous turn, prompt, output) arriving after the step
    settle = _EMPTY
    steps: list[TraceStep] = []
    used_full = used_swa = 0
    peak_full = peak_swa = max_rel = max_lanes = max_rows = 0
    max_row_tok = max_step_tok = cache_pages = 0
    phases = [("bootstrap", None), ("warmup", n_warmup), ("measure", n_measure),
              ("profile", n_profile)]
    phase_start: dict[str, int] = {}

    for phase, n_phase in phases:
        phase_start[phase] = len(steps)
        count = 0
        while (n_phase is None and (len(running) < B or any(
                st.pre[r] < st.fill[r] for r in running))) or (
                n_phase is not None and count < n_phase):
            count += 1
            bootstrap = phase == "bootstrap"
            full_freed = swa_freed = 0
            # 1. releases
            release = np.array(to_release, dtype=np.int64)
            to_release = []
            rel_rows = tails = 0
            if len(release):
                n_pages = _ceil_div(st.length[release], ps)
                full_freed += int(n_pages.sum())
                swa_freed += int((n_pages - st.front[release] // ps).sum())
                rel_rows += int(len(release) + np.count_nonzero(st.front[release]))
                tails = int(np.count_nonzero(st.length[release] % ps))
                for r in release.tolist():
                    del running[r]
                    if px is not None:
                        turn = px.follow_up(r)
                        px.released(r, int(st.fill[r]), int(st.length[r]), turn is not None)
                        if turn is not None:
                            next_turns.append((r, *turn))
            run = np.fromiter(running, dtype=np.int64, count=len(running))
            prefilling = run[st.pre[run] < st.fill[run]]
            decoding = _EMPTY if bootstrap else run[st.pre[run] == st.fill[run]]
            # 2. prefill chunks under the budget: continuing requests first, then admits
            # (with a prefix cache from their hit; one whose prefix is still being
            # computed by another request waits, the next ones may go first)
            budget = C
            ext_ids, ext_n, admit, hits = [], [], [], []
            for r in prefilling.tolist():
                if budget == 0:
                    break
                n = min(int(st.fill[r] - st.pre[r]), budget)
                ext_ids.append(r)
                ext_n.append(n)
                budget -= n
            n_cont = len(ext_ids)
            skipped = []
            while budget > 0 and waiting and len(running) < B:
                r = waiting.popleft()
                hit = 0
                if px is not None:
                    hit = px.admit(r, int(st.fill[r]))
                    if hit < 0:
                        skipped.append(r)
                        continue
                    st.length[r] = st.pre[r] = hit
                running[r] = None
                n = min(int(st.fill[r]) - hit, budget)
                ext_ids.append(r)
                ext_n.append(n)
                admit.append(r)
                hits.append(hit)
                budget -= n
            waiting.extendleft(reversed(skipped))
            ext_ids = np.array(ext_ids, dtype=np.int64)
            ext_n = np.array(ext_n, dtype=np.int64)
            hits = np.array(hits, dtype=np.int64)
            # 3. evictions: decoding requests due by the interval, continuing chunks, and
            # (bootstrap) the requests whose fill completed in the previous step
            due = decoding[st.dec[decoding] % interval == 0]
            if len(settle):
                due = np.unique(np.concatenate([due, settle]))
                settle = _EMPTY
            cont = ext_ids[:n_cont] if n_cont else _EMPTY
            evict = np.concatenate([due, cont]) if len(cont) else due
            n_seg = n_evict_pages = 0
            if len(evict):
                old = st.front[evict]
                new = np.maximum(old, np.maximum(st.length[evict] - wa, 0) // ps * ps)
                moved = (new - old) // ps
                n_evict_pages = int(moved.sum())
                n_seg = int(np.count_nonzero(moved))
                st.front[evict] = new
                swa_freed += n_evict_pages
            # 4. allocations: decode one token each, then the chunks (a replay without a
            # cache also allocates the hits' pages)
            new_pages = 0
            if len(decoding):
                new_pages += int(np.count_nonzero(st.length[decoding] % ps == 0))
                st.length[decoding] += 1
                st.dec[decoding] += 1
                done = decoding[st.dec[decoding] >= st.out[decoding]]
                to_release.extend(done.tolist())
            ext_nc = ext_n
            if len(ext_ids):
                length = st.length[ext_ids]
                new_pages += int((_ceil_div(length + ext_n, ps) - _ceil_div(length, ps)).sum())
                pre_old = st.pre[ext_ids]
                st.length[ext_ids] += ext_n
                st.pre[ext_ids] += ext_n
                if px is not None:
                    for r, a, b in zip(ext_ids.tolist(), pre_old.tolist(),
                                       st.pre[ext_ids].tolist(), strict=True):
                        px.computed(r, a, b)
                if hits.any():
                    ext_nc = ext_n.copy()
                    ext_nc[n_cont:] += hits
                max_row_tok = max(max_row_tok, int(ext_nc.max()))
                if bootstrap:  # evicted next step: the bootstrap spreads the first frees
                    settle = ext_ids[st.pre[ext_ids] == st.fill[ext_ids]]
            new_nc = new_pages + int(hits.sum()) // ps
            cache_pages += new_pages
            max_step_tok = max(max_step_tok, int(ext_nc.sum()) + len(decoding))
            used_full += new_nc - full_freed
            used_swa += new_nc - swa_freed
            peak_full = max(peak_full, used_full)
            peak_swa = max(peak_swa, used_swa)
            max_rel = max(max_rel, len(release))
            max_lanes = max(max_lanes, full_freed + n_evict_pages)
            max_rows = max(max_rows, rel_rows + n_seg)
            steps.append(TraceStep(
                index=len(steps), phase=phase, release=release, evict=evict,
                admit=np.array(admit, dtype=np.int64), extend_ids=ext_ids, extend_n=ext_n,
                decode=decoding, expect=(new_nc, new_nc, full_freed, swa_freed),
                n_evict_segments=n_seg, n_evict_pages=n_evict_pages,
                n_release_rows=rel_rows + n_seg, hit=hits, extend_n_nocache=ext_nc,
                expect_cache=None if px is None else (new_pages, new_pages, tails)))
            # 5. arrivals (steady state only): new requests; the later turns of finished
            # conversations go first in the queue (sched_prefix.py: SGLang's LPM order)
            if not bootstrap:
                turns = [new_request(prompt, out, parent=parent)
                         for parent, prompt, out in next_turns]
                waiting.extendleft(reversed(turns))
                next_turns = []
                n_new = int(rng.poisson(arrival_rate))
                if n_new:
                    prompt, out = draw_lengths(n_new)
                    for p, o in zip(prompt, out, strict=True):
                        waiting.append(new_request(int(p), int(o)))
    return Trace(spec=spec, steps=steps, phase_start=phase_start, n_requests=st.n,
                 peak_full=peak_full, peak_swa=peak_swa, max_releases=max_rel,
                 max_free_lanes=max_lanes, max_release_rows=max_rows,
                 max_alloc_row_tokens=max_row_tok, max_step_tokens=max_step_tok,
                 cache_pages=cache_pages, tokens=None if px is None else px.tokens,
                 fill=st.fill[:st.n].copy(), prefix=None if px is None else px.summary())


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run benchmarks/bench_scheduler.py "
            "instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
