"""graphalloc's side of the scheduler benchmark: one allocator step per scheduler iteration.

:class:`GraphallocDriver` replays a :class:`sched_workload.TraceStep` through the public
API only, as ONE ``alloc.step(...)`` per iteration (``api="context"`` records the same
step in one ``alloc.scheduler_step()`` block)::

    rows = alloc.free_row(...)                     rows of new requests (host query)
    alloc.step(take=(handles, rows, n),            cache inserts (with the prefix cache),
               release=rows, evict=rows,           frees (window rule for the evictions),
               admit=rows, admit_on=(rows, h, m),  admits (on a cache hit: shared pages),
               decode=rows, extend=(rows, chunks)) allocations: ONE plan, ONE replay

The executor is graphalloc's :class:`~graphalloc.StepGraph` subclassed only to put the
benchmark's clock (CUDA events) around its ``execute`` -- the replay alone, planning
outside -- and to add up the page counts of the iteration's steps (their
:class:`~graphalloc.PlannedStep`). With ``tables=True`` the same step also writes the
attention block tables of its batch (``HybridAllocator(page_tables=PageTableSpec(forms=
("block_table",)))``, FULL and SWA layers, like the vLLM baseline's upload): the planner
writes the batch's lane rows into the step's descriptor and the tables' kernel is a node of
the same graph. Without CUDA both run eagerly. :class:`AllocatorDriver` (the executor,
counts, pool state, checks) is shared with the seams' drivers (``sched_seams.py``).

The allocator is sized from the trace with :meth:`graphalloc.AllocatorConfig.for_engine`
(:func:`engine_config`): the engine's budgets (B running requests, the chunked-prefill
budget, context, page size, the model window), pools of the trace's peak usage plus a
margin (or the pools given: the baselines' with a prefix cache), ``max_reqs`` = B + the
most releases of one step; where the trace needs more release lanes, rows, allocation rows
or tokens in one step than ``for_engine`` gives (eviction every 128 tokens frees more per
step; a cache's takes are allocation rows ``for_engine`` does not count), those shapes
are raised to the trace's need (``AllocatorConfig`` is a dataclass; ``dataclasses.replace``
re-validates) and recorded in the notes.

Prefix workloads (``sched_workload``'s ``prefix``), ``prefix_cache=True``: the allocator
owns graphalloc's prefix cache (``HybridAllocator(prefix_cache=True)``, ``max_handles`` =
the trace's inserts, at most the FULL pool: no handle ever has to be freed for an insert).
Per iteration, in the same ONE step::

    inserts   every released request's whole pages [0, floor_page(L)) and every request
              that extended in the previous step ([0, floor_page(pre))): a ``take`` of the
              lowest free handle, skipped when ``cache.lookup(keys)`` finds that prefix
              (the seams' rule, ``graphalloc.integrations.iteration``); the entries are
              registered (``cache.add_entry``) once the step ran
    admits    ``cache.match(keys=...)`` of the prompt less its last token: a hit is
              admitted on its handle (``admit_on``) and prefills only the rest; a hit
              shorter than the trace's (a pool small enough to evict) recomputes the rest
    eviction  inside the step: when an allocation is short the planner drops the cache's
              unlocked entries (SWA tombstones first, then LRU leaves); a step cannot drop
              an entry it takes, so when it is refused for pages (a small pool, its takes
              holding what it releases) its inserts and frees run first as a step of their
              own, then the rest: two steps in that iteration (``steps_per_iteration``)

Page keys are kept per request and extended as it grows (``page_keys(..., keys)``), as
vLLM keeps block hashes: each page is hashed once. With ``prefix_cache=False`` an
admission allocates its cached prefix as fresh tokens with its first chunk
(``TraceStep.extend_n_nocache``, the trace's sizes are that replay's).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

__all__ = ["engine_config", "AllocatorDriver", "GraphallocDriver", "pool_pages", "SHAPES"]

SHAPES = ("num_full_pages", "num_swa_pages", "max_reqs", "max_release_rows",
          "max_pages_per_row", "max_alloc_rows", "max_tokens_per_alloc_row", "max_step_pages",
          "max_step_tokens", "sliding_window", "max_handles")


class _NoClock:
    def device_begin(self) -> None:
        pass

    def device_end(self) -> None:
        pass


_NO_CLOCK = _NoClock()


def pool_pages(trace) -> tuple[int, int]:
    """FULL and SWA pool sizes for a trace: its peaks plus 2% (at least 16 pages)."""
    return (trace.peak_full + max(16, trace.peak_full // 50),
            trace.peak_swa + max(16, trace.peak_swa // 50))


def engine_config(trace, device, backend: str, *, pools=None, cache: bool = False):
    """``(config, notes)``: the allocator config for ``trace`` (module docstring);
    ``pools`` (FULL, SWA) instead of :func:`pool_pages`; ``cache``: shapes for a prefix
    cache (handles, take rows, the rows and lanes of evictions inside a step)."""
    from graphalloc import AllocatorConfig

    spec = trace.spec
    n_full, n_swa = pools or pool_pages(trace)
    n_handles = min(n_full, trace.n_inserts + 16) if cache else 0
    cfg = AllocatorConfig.for_engine(
        max_running_requests=spec.n_running, chunked_prefill_size=spec.chunk_tokens,
        max_context_len=spec.max_context_len, page_size=spec.page_size,
        model_window=spec.window, num_full_pages=n_full, num_swa_pages=n_swa,
        max_reqs=spec.n_running + max(1, trace.max_releases), max_handles=n_handles,
        device=device, backend=backend)
    notes = {}
    need = {"max_step_pages": trace.max_free_lanes,
            "max_release_rows": trace.max_release_rows,
            "max_tokens_per_alloc_row": trace.max_alloc_row_tokens,  # prefix: hit + chunk
            "max_step_tokens": trace.max_step_tokens}
    if cache:  # takes are allocation rows; an eviction in the step adds rows and lanes:
        # at most what the step allocates (both pools) plus one entry's pages past it
        extra = 2 * (cfg.max_step_tokens // spec.page_size + trace.max_cache_rows
                     + cfg.max_pages_per_row)
        need["max_alloc_rows"] = trace.max_cache_rows
        need["max_step_pages"] = min(n_full + n_swa, trace.max_free_lanes + extra)
        need["max_release_rows"] = 2 * trace.max_release_rows + trace.max_cache_rows
    bump = {k: v for k, v in need.items() if v > getattr(cfg, k)}
    if bump:
        notes["raised_from_for_engine"] = {k: [getattr(cfg, k), v] for k, v in bump.items()}
        cfg = dataclasses.replace(cfg, **bump)
    return cfg, notes


def _timed_graph():
    """The executor class (defined on first use: graphalloc imports Triton kernels, and the
    scripts settle TRITON_INTERPRET before that)."""
    from graphalloc import StepGraph

    class TimedStepGraph(StepGraph):
        """graphalloc's StepGraph; the driver's clock around each replay (the allocator's
        step and, with page tables, the tables' kernel: one graph); the page counts of the
        steps since :meth:`begin` added up (FULL allocated, SWA allocated, FULL freed, SWA
        freed) and the steps counted. ``launch = False``: the planned step is not executed
        (nothing launched, on a CPU nothing run eagerly): the host path alone."""

        def __init__(self):
            super().__init__()
            self.launch = True
            self.clock, self.last = _NO_CLOCK, None
            self.t_exec = 0
            self.counts, self.n_steps = [0, 0, 0, 0], 0

        def begin(self) -> None:
            self.counts, self.n_steps = [0, 0, 0, 0], 0

        def execute(self, planned) -> None:
            self.t_exec = time.perf_counter_ns()
            self.last = planned
            self.clock.device_begin()
            if self.launch:
                super().execute(planned)
            self.clock.device_end()
            a, f, c = planned.pages_allocated, planned.pages_freed, self.counts
            c[0] += a["full"]
            c[1] += a["swa"]
            c[2] += f["full"]
            c[3] += f["swa"]
            self.n_steps += 1

    return TimedStepGraph


class AllocatorDriver:
    """A :class:`~graphalloc.HybridAllocator` with the timed executor, and what every
    graphalloc driver reports: ``last_counts`` (the last iteration's steps, added up),
    ``steps_per_iteration`` (the most steps one iteration ran), with a prefix cache
    ``state()`` / ``pool_sizes`` / ``hit_tokens`` / ``recomputed_tokens`` /
    ``evicted_pages``, and the checks (``verify``)."""

    name = "graphalloc"

    def __init__(self, cfg, *, n_requests: int, tables: bool = False,
                 prefix_cache: bool = False):
        from graphalloc import HybridAllocator
        from graphalloc.attention.spec import PageTableSpec

        self.config = cfg
        self.prefix_cache = prefix_cache
        self.executor = _timed_graph()()
        spec = (PageTableSpec(max_batch=cfg.max_alloc_rows, forms=("block_table",),
                              layers=("full", "swa")) if tables else None)
        self.alloc = HybridAllocator(cfg, executor=self.executor, page_tables=spec,
                                     prefix_cache=prefix_cache)
        self.cache = self.alloc.prefix_cache
        self.tables = self.alloc.tables
        self.pool_sizes = (cfg.num_full_pages, cfg.num_swa_pages)
        self.hit_tokens = np.full(n_requests, -1, dtype=np.int64)
        self.recomputed_tokens = 0
        self.steps_per_iteration = 0
        self.last_counts = (0, 0, 0, 0)

    def _begin(self, clock) -> None:
        self.executor.clock = clock
        self.executor.begin()

    def _end(self) -> None:
        ex = self.executor
        ex.clock = _NO_CLOCK
        self.last_counts = tuple(ex.counts)
        self.steps_per_iteration = max(self.steps_per_iteration, ex.n_steps)

    @property
    def stalls(self) -> int:
        return self.alloc.ring.stalls

    @property
    def evicted_pages(self) -> tuple[int, int]:
        """FULL and SWA pages the cache's evictions (tombstones included) freed, all steps."""
        c = self.cache
        return (0, 0) if c is None else (c.dropped_pages, c.tombstoned_pages)

    def state(self) -> tuple:
        """(free, used, cached) of the FULL pool, then of the SWA pool, from the host
        mirror: free = the free ring's count, used = pages a live request holds, cached =
        the other held pages (held = a reference count > 0: only the cache's handles hold
        them). free + held == pool is what ``sched_agreement.record`` checks. O(live
        requests x their pages) numpy."""
        led = self.alloc.ledger
        refs, ps = led.refs, self.config.page_size
        n_full, n_swa = self.pool_sizes
        held_full = int(np.count_nonzero(refs.full_ref[1:]))
        held_swa = int(np.count_nonzero(refs.swa_ref[1:]))
        used_full = used_swa = 0
        rows = np.flatnonzero(led.live)
        if len(rows):
            end = -(-led.seq_len[rows] // ps)
            width = int(end.max())
            if width:
                pages = refs.page_of[rows, :width]
                cols = np.arange(width)
                mask = cols < end[:, None]
                mark = np.zeros(n_full + 1, dtype=bool)
                mark[pages[mask]] = True
                used_full = int(np.count_nonzero(mark))
                mask &= cols >= (led.frontier[rows] // ps)[:, None]
                mark = np.zeros(n_swa + 1, dtype=bool)
                mark[refs.swa_of[pages[mask]]] = True
                used_swa = int(np.count_nonzero(mark))
        return (led.full.n_free, used_full, held_full - used_full,
                led.swa.n_free, used_swa, held_swa - used_swa)

    def verify(self, live_ids, audit: bool = True) -> dict:
        """``check()`` (the device error word), the cache's own check and, when ``audit``,
        ``audit()`` (every device table against the host mirror). Reads the device."""
        self.alloc.check(sync=True)
        if self.cache is not None:
            self.cache.check()
        out = {"device_faults": 0}
        if audit:
            findings = self.alloc.audit()
            out["audit_findings"] = len(findings)
            out["audit_first"] = [str(f) for f in findings[:3]]
        else:
            out["audit_findings"] = None
        out["live_rows"] = int(self.alloc.n_live)
        out["live_expected"] = len(live_ids)
        out["steps_per_iteration"] = self.steps_per_iteration
        if self.cache is not None:
            out["cache"] = self.cache.stats()
        out["ok"] = (out["audit_findings"] in (0, None)) and out["live_rows"] == len(live_ids)
        return out

    def shapes(self) -> dict:
        return {k: getattr(self.config, k) for k in SHAPES}

    def close(self) -> None:
        ex = self.executor
        for name in ("graphs", "fused_graphs"):
            graphs = getattr(ex, name, None)
            if graphs is not None:
                graphs.clear()


class GraphallocDriver(AllocatorDriver):
    """One allocator replaying the trace directly (module docstring). ``plan_ns``: the last
    step's host work before the executor call (normalise + plan + descriptor write).
    ``launch=False``: the executor runs nothing (``sched_host_path.py``: the host path
    alone; its device state is never written, so ``verify`` does not apply)."""

    def __init__(self, cfg, *, n_requests: int, tables: bool = False, api: str = "step",
                 prefix_cache: bool = False, tokens=None, prompt_lens=None,
                 launch: bool = True):
        if api not in ("step", "context"):
            raise ValueError(f"api must be 'step' or 'context', got {api!r}")
        if prefix_cache and (tokens is None or prompt_lens is None):
            raise ValueError("the prefix cache needs the requests' tokens and prompt_lens "
                             "(Trace.tokens, Trace.fill): a trace with a prefix workload")
        super().__init__(cfg, n_requests=n_requests, tables=tables, prefix_cache=prefix_cache)
        self.api = api
        self.name = ("graphalloc_tables" if tables else "graphalloc") + (
            "" if launch else " (host path: nothing launched)")
        self.executor.launch = launch  # False: the device state is never written
        self.row_of = np.full(n_requests, -1, dtype=np.int64)
        self.table_mode = (None if not tables else
                           "allocator + tables in one CUDA graph per bucket and descriptor "
                           "buffer" if cfg.device.type == "cuda" else "eager launches (no CUDA)")
        self.plan_ns = 0
        self.tokens, self.prompt_lens = tokens, prompt_lens
        self.keys: dict = {}  # rid -> page keys so far (prefix cache)
        self.prev_extend = np.zeros(0, dtype=np.int64)  # rids that extended last step
        self._new_entries: list = []  # (handle, keys) the step takes
        self._t_block = 0

    def step(self, st, clock) -> None:
        """The iteration as ONE step: cache inserts, releases, evictions, admits (rows
        reserved here, on a cache hit where there is one), decodes and the prefill chunks;
        with page tables, the batch's tables too."""
        alloc, row_of, ex = self.alloc, self.row_of, self.executor
        self._begin(clock)
        new = st.admit.tolist()
        reserved = []
        for rid in new:
            reserved.append(alloc.free_row(reserved))
            row_of[rid] = reserved[-1]
        decode = row_of[st.decode] if len(st.decode) else None
        extend = row_of[st.extend_ids] if len(st.extend_ids) else None
        release = row_of[st.release] if len(st.release) else None
        evict = row_of[st.evict] if len(st.evict) else None
        chunks = st.extend_n_nocache
        takes = admit_on = None
        on = [-1] * len(reserved)  # per admission: the hit's handle (-1: a plain admit)
        hits = on
        if self.prefix_cache:
            takes = self._inserts(st)
            on, hits, chunks = self._matches(st)
        plain = [r for r, h in zip(reserved, on, strict=True) if h < 0]
        if len(plain) < len(reserved):
            admit_on = tuple(np.array(x, dtype=np.int64) for x in zip(*(
                (r, h, n) for r, h, n in zip(reserved, on, hits, strict=True) if h >= 0),
                strict=True))
        frees = dict(take=takes, release=release, evict=evict)
        rest = dict(admit=np.array(plain, dtype=np.int64) if plain else None,
                    admit_on=admit_on, decode=decode,
                    extend=None if extend is None else (extend, chunks))
        t_body = time.perf_counter_ns()
        if self.api == "step":
            done = alloc.try_step(**frees, **rest) is not None
        else:
            done = self._block(takes, release, evict, reserved, on, hits, decode, extend,
                               chunks)
            t_body = self._t_block
        if not done:  # short, in a small pool: the takes hold what this step releases
            if takes is None:
                raise RuntimeError(f"graphalloc driver: step {st.index} refused for room, "
                                   "with no cache insert to run first")
            alloc.step(**frees)  # the inserts and frees first: their entries evictable
            self._register()
            alloc.step(**rest)
        self.plan_ns = ex.t_exec - t_body
        self._end()
        if self.prefix_cache:
            self._register()
            self.prev_extend = st.extend_ids
            for rid in st.release.tolist():
                self.keys.pop(rid, None)
        if len(st.release):
            row_of[st.release] = -1

    def _block(self, takes, release, evict, reserved, on, hits, decode, extend, chunks):
        """The step as one ``scheduler_step()`` block; False when it was refused for room
        (nothing ran). ``_t_block``: when the block's recording ended."""
        from graphalloc.errors import BatchTooLargeError, CapacityError

        try:
            with self.alloc.scheduler_step() as it:
                got = [it.take_handle(int(row), int(n))  # the lowest free handle each
                       for row, n in zip(*(takes or ((), (), ()))[1:], strict=True)]
                if release is not None:
                    it.release(release)
                if evict is not None:
                    it.evict(evict)
                got += [it.admit() if h < 0 else it.admit(handle=h, n_tokens=n)
                        for h, n in zip(on, hits, strict=True)]  # rows in reserved order
                if got != [int(h) for h in (takes or ((),))[0]] + reserved:
                    raise RuntimeError(f"graphalloc driver: the block took {got}, the "
                                       "driver reserved other handles and rows")
                if decode is not None:
                    it.decode(decode)
                if extend is not None:
                    it.extend(extend, chunks)
                self._t_block = time.perf_counter_ns()
        except (CapacityError, BatchTooLargeError):
            return False
        return True

    # ---- the prefix cache ----------------------------------------------------------------
    def _register(self) -> None:
        """The step that took them ran: its new entries join the cache."""
        for h, keys in self._new_entries:
            self.cache.add_entry(h, keys)
        self._new_entries = []

    def _keys(self, rid: int, n_tokens: int) -> list:
        """``rid``'s page keys, extended to the whole pages of its first ``n_tokens``."""
        from graphalloc.sharing.prefix_cache import page_keys

        keys = self.keys.get(rid)
        if keys is None:
            keys = self.keys[rid] = []
        return page_keys(self.tokens[rid][:n_tokens], self.config.page_size, keys)

    def _inserts(self, st):
        """The step's takes (module docstring): ``(handles, rows, n_tokens)`` or None; the
        entries to register after the step in ``_new_entries``."""
        led, cache, ps = self.alloc.ledger, self.cache, self.config.page_size
        released = set(st.release.tolist())
        cand = st.release.tolist() + [r for r in self.prev_extend.tolist()
                                      if r not in released]
        self._new_entries = []
        rows, ns = [], []
        for rid in cand:
            row = int(self.row_of[rid])
            n = int(led.seq_len[row]) // ps * ps
            if not n:
                continue
            keys = self._keys(rid, n)[:n // ps]
            if cache.lookup(keys) >= 0:
                continue
            self._new_entries.append((None, keys))
            rows.append(row)
            ns.append(n)
        if not rows:
            return None
        handles = np.flatnonzero(~led.h_live)[:len(rows)]
        if len(handles) < len(rows):
            raise RuntimeError(f"graphalloc driver: {len(rows)} inserts, {len(handles)} free "
                               "handles: max_handles is sized from the trace's inserts")
        self._new_entries = [(int(h), keys) for h, (_, keys) in
                             zip(handles, self._new_entries, strict=True)]
        return handles, np.array(rows, dtype=np.int64), np.array(ns, dtype=np.int64)

    def _matches(self, st):
        """Each admission's cache hit: ``(handles, hit tokens, chunks)``, a handle per
        admission (-1: a miss); a hit shorter than the trace's recomputes the rest (its
        tokens join the chunk)."""
        ps, cache = self.config.page_size, self.cache
        handles, hits = [], []
        chunks = st.extend_n
        first = len(st.extend_ids) - len(st.admit)
        for i, (rid, expect) in enumerate(zip(st.admit.tolist(), st.hit.tolist(),
                                              strict=True)):
            fill = int(self.prompt_lens[rid])
            keys = self._keys(rid, fill)
            m = cache.match(keys=keys[:(fill - 1) // ps])
            hit = m.cached_tokens
            if hit > expect:
                raise RuntimeError(f"graphalloc driver: request {rid} hits {hit} tokens, the "
                                   f"trace {expect}: the trace's cache model misses an entry")
            self.hit_tokens[rid] = hit
            if hit < expect:
                if chunks is st.extend_n:
                    chunks = chunks.copy()
                chunks[first + i] += expect - hit
                self.recomputed_tokens += expect - hit
            handles.append(m.handle if hit else -1)
            hits.append(hit)
        return handles, hits, chunks


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run benchmarks/bench_scheduler.py "
            "instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
