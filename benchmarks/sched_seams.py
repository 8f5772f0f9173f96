"""graphalloc through the engines' seams in the scheduler benchmark, driven as an engine would.

Two drivers replay a :class:`sched_workload.TraceStep` per iteration through
:mod:`graphalloc.integrations`, on the same allocator, executor and checks as the direct
driver (``sched_graphalloc.AllocatorDriver``):

``graphalloc_sglang`` -- :class:`~graphalloc.integrations.sglang.SGLangAllocator`, SGLang's
scheduler calls on plain ``Req`` / ``ScheduleBatch``-shaped objects (``req_pool_idx``,
``origin_input_ids``, ``output_ids``; ``reqs``, ``prefix_lens``, ``extend_lens``,
``seq_lens_cpu``)::

    process_batch_result   free_group_begin(); cache_finished_req(req) per finished request
                           (release_kv_cache without a cache); free_group_end(); with a
                           cache, cache_unfinished_req(req) per request that extended
    get_new_batch_prefill  match_prefix(req) per new request (with a cache)
    the batch              prepare_for_extend(batch) when the iteration prefills -- SGLang's
                           mixed chunked prefill: the decoding requests ride along as 1-token
                           extends -- else prepare_for_decode(batch), else flush()

``graphalloc_vllm`` -- :class:`~graphalloc.integrations.vllm.GraphallocKVCacheManager`,
vLLM v1's calls per request::

    update_from_output     free(request_id, token_ids) per finished request; with a
                           cache, cache_blocks(request_id, token_ids) per request that
                           extended (its computed tokens)
    schedule()             allocate_slots(rid, 1) per decode, allocate_slots(rid, chunk) per
                           continuing prefill, then per new request get_computed_blocks(rid,
                           token_ids) (with a cache) and allocate_slots(rid, chunk,
                           num_new_computed_tokens=hit, new_computed_blocks=blocks)
    after schedule()       run_step(): ONE step

The frees and inserts the seam recorded run in that iteration's step (``defer_frees``).
In a small pool a step can be short of pages its own inserts hold (a finished request is
inserted as it is released, and a step cannot evict what it takes): then the driver runs
the records first (SGLang: ``flush()``, the new requests matched again; vLLM:
``run_step()``, the request asked again), two steps in that iteration
(``steps_per_iteration``), as the direct driver does.
The engine's own bookkeeping -- the request objects, token-id lists, the batch's host
arrays -- is built by :meth:`prepare`, which the benchmark calls before it starts the
step's clock: it is the engine's work, not the allocator's; what the seam reads from them
(``batch_field``, the token ids it hashes) is timed.

Window eviction is the seam's own rule, not the trace's: SGLang's at every extend and,
at a decode, once ``pre_len - W >= frontier + interval`` (``swa_eviction_interval`` = the
trace's interval); vLLM's at every ``allocate_slots`` of a running request. Both free the
same pages as the trace's rule at interval 1 after the bootstrap (whose settled requests
the seams evict at their first decode instead); otherwise at other steps. So their SWA
frees are reported, not compared (``own_window_rule``), their SWA pools are as large as
the FULL ones (a later eviction holds more SWA pages), and an iteration may run more than
one step when an eviction frees more than the frozen release shape
(``steps_per_iteration``). Hits, FULL and SWA allocations and FULL frees compare as for
the direct driver.
"""

from __future__ import annotations

import numpy as np
from sched_graphalloc import AllocatorDriver

__all__ = ["SGLangSeamDriver", "VLLMSeamDriver"]

_EMPTY = np.zeros(0, dtype=np.int64)


class _Req:
    """The attributes of SGLang's ``Req`` the seam reads (``extra_key``: its cache
    namespace, none in this workload) and the one it writes (``graphalloc_page_keys``: the
    request's page keys, kept on it as SGLang's ``Req`` keeps any attribute)."""

    __slots__ = ("rid", "req_pool_idx", "origin_input_ids", "output_ids", "last_node",
                 "extra_key", "graphalloc_page_keys")

    def __init__(self, rid: int, ids):
        self.rid, self.req_pool_idx, self.last_node = rid, None, None
        self.origin_input_ids, self.output_ids = ids, []
        self.extra_key = self.graphalloc_page_keys = None


class _Batch:
    """The host fields of SGLang's ``ScheduleBatch`` the seam reads."""

    __slots__ = ("reqs", "prefix_lens", "extend_lens", "seq_lens_cpu")

    def __init__(self, reqs, prefix_lens=None, extend_lens=None, seq_lens_cpu=None):
        self.reqs, self.prefix_lens, self.extend_lens = reqs, prefix_lens, extend_lens
        self.seq_lens_cpu = seq_lens_cpu


class _SeamDriver(AllocatorDriver):
    own_window_rule = True

    def __init__(self, cfg, *, n_requests: int, prefix_cache: bool = False, tokens=None,
                 prompt_lens=None):
        if prefix_cache and (tokens is None or prompt_lens is None):
            raise ValueError("the prefix cache needs the requests' tokens and prompt_lens "
                             "(Trace.tokens, Trace.fill): a trace with a prefix workload")
        super().__init__(cfg, n_requests=n_requests, prefix_cache=prefix_cache)
        self.tokens, self.prompt_lens = tokens, prompt_lens
        self.prev_extend = _EMPTY  # rids that extended in the last iteration

    def verify(self, live_ids, audit: bool = True) -> dict:
        out = super().verify(live_ids, audit)
        out["cache_steps"] = self._cache_steps()  # steps the cache ran outside an iteration's
        return out

    def _seq_len(self, row) -> np.ndarray:
        return self.alloc.ledger.seq_len[row]

    def _check_hit(self, rid: int, hit: int, expect: int) -> int:
        """Record ``rid``'s hit; returns the tokens it recomputes."""
        if hit > expect:
            raise RuntimeError(f"{self.name}: request {rid} hits {hit} tokens, the trace "
                               f"{expect}: the trace's cache model misses an entry")
        self.hit_tokens[rid] = hit
        self.recomputed_tokens += expect - hit
        return expect - hit


class SGLangSeamDriver(_SeamDriver):
    """graphalloc through the SGLang seam (module docstring)."""

    name = "graphalloc_sglang"

    def __init__(self, cfg, *, interval: int, **kw):
        from graphalloc.integrations.sglang import SGLangAllocator

        super().__init__(cfg, **kw)
        self.seam = SGLangAllocator(self.alloc, swa_eviction_interval=interval)
        self.reqs: dict = {}  # rid -> _Req, while it holds KV
        self.batch = self.kind = None

    def _cache_steps(self) -> int:
        return self.seam.cache_steps

    def prepare(self, st) -> None:
        """The engine's side of the iteration: new ``Req`` objects, the finished requests'
        output ids, the batch's host arrays (new requests at the trace's hit)."""
        reqs, cache = self.reqs, self.prefix_cache
        for rid in st.admit.tolist():
            ids = self.tokens[rid][:int(self.prompt_lens[rid])].tolist() if cache else None
            reqs[rid] = _Req(rid, ids)
        if cache:
            for rid in st.release.tolist():
                req = reqs[rid]
                length = int(self._seq_len(req.req_pool_idx))
                req.output_ids = self.tokens[rid][len(req.origin_input_ids):length].tolist()
        n_new, n_dec = len(st.admit), len(st.decode)
        if len(st.extend_ids):
            ids = np.concatenate([st.decode, st.extend_ids])
            batch = [reqs[r] for r in ids.tolist()]
            running = np.array([r.req_pool_idx for r in batch[:len(ids) - n_new]],
                               dtype=np.int64)
            hits = st.hit if cache else np.zeros(n_new, dtype=np.int64)
            chunks = st.extend_n if cache else st.extend_n_nocache
            self.batch = _Batch(batch, np.concatenate([self._seq_len(running), hits]),
                                np.concatenate([np.ones(n_dec, dtype=np.int64), chunks]))
            self.kind = "extend"
        elif n_dec:
            batch = [reqs[r] for r in st.decode.tolist()]
            rows = np.array([r.req_pool_idx for r in batch], dtype=np.int64)
            self.batch, self.kind = _Batch(batch, seq_lens_cpu=self._seq_len(rows)), "decode"
        else:
            self.batch = self.kind = None

    def step(self, st, clock) -> None:
        seam, reqs, cache = self.seam, self.reqs, self.prefix_cache
        self._begin(clock)
        if len(st.release):
            seam.free_group_begin()
            for rid in st.release.tolist():
                req = reqs.pop(rid)
                if cache:
                    seam.cache_finished_req(req)
                else:
                    seam.release_kv_cache(req)
            seam.free_group_end()
        if cache:
            for rid in self.prev_extend.tolist():
                req = reqs.get(rid)
                if req is not None and req.req_pool_idx is not None:
                    seam.cache_unfinished_req(req)
            first = len(st.decode) + len(st.extend_ids) - len(st.admit)
            batch = self.batch
            for i, (rid, expect) in enumerate(zip(st.admit.tolist(), st.hit.tolist(),
                                                  strict=True)):
                hit = seam.match_prefix(reqs[rid])
                more = self._check_hit(rid, hit, expect)
                if more:
                    batch.prefix_lens[first + i] = hit
                    batch.extend_lens[first + i] += more
        out = self._batch()
        if out is None and cache:  # short, in a small pool: the inserts hold what this
            seam.flush()  # iteration releases; they run first, then the batch again (its
            for rid in st.admit.tolist():  # hits matched again: flush() unlocked them)
                if seam.match_prefix(reqs[rid]) != self.hit_tokens[rid]:
                    raise RuntimeError(f"{self.name}: request {rid}'s hit changed")
            out = self._batch()
        if out is None:
            raise RuntimeError(f"{self.name}: the seam refused the iteration (pages or rows "
                               "short): the pools are sized from the trace")
        self._end()
        self.prev_extend = st.extend_ids

    def _batch(self):
        if self.kind == "extend":
            return self.seam.prepare_for_extend(self.batch)
        if self.kind == "decode":
            return self.seam.prepare_for_decode(self.batch)
        return self.seam.flush()


class VLLMSeamDriver(_SeamDriver):
    """graphalloc through the vLLM facade (module docstring)."""

    name = "graphalloc_vllm"

    def __init__(self, cfg, **kw):
        from graphalloc.integrations.vllm import GraphallocKVCacheManager

        super().__init__(cfg, **kw)
        self.mgr = GraphallocKVCacheManager(self.alloc, enable_caching=self.prefix_cache)
        self.released_ids = self.inserted = self.admit_ids = ()

    def _cache_steps(self) -> int:
        return self.mgr.cache_steps

    def prepare(self, st) -> None:
        """The engine's side: each request's token ids where the facade reads them (its
        computed tokens at a free or a cache insert, the prompt at admission)."""
        if not self.prefix_cache:
            return
        mgr, toks = self.mgr, self.tokens

        def computed(rid):
            return toks[rid][:int(self._seq_len(mgr.row_of(rid)))].tolist()

        released = set(st.release.tolist())
        self.released_ids = [computed(r) for r in st.release.tolist()]
        self.inserted = [(r, computed(r)) for r in self.prev_extend.tolist()
                         if r not in released]
        self.admit_ids = [toks[r][:int(self.prompt_lens[r])].tolist()
                          for r in st.admit.tolist()]

    def step(self, st, clock) -> None:
        mgr, cache = self.mgr, self.prefix_cache
        self._begin(clock)
        for i, rid in enumerate(st.release.tolist()):
            mgr.free(rid, self.released_ids[i] if cache else None)
        if cache:
            for rid, ids in self.inserted:
                mgr.cache_blocks(rid, ids)
        for rid in st.decode.tolist():
            if mgr.allocate_slots(rid, 1) is None:
                self._short(rid, 1)
        chunks = st.extend_n if cache else st.extend_n_nocache
        n_cont = len(st.extend_ids) - len(st.admit)
        for rid, n in zip(st.extend_ids[:n_cont].tolist(), chunks[:n_cont].tolist(),
                          strict=True):
            if mgr.allocate_slots(rid, n) is None:
                self._short(rid, n)
        for i, (rid, n) in enumerate(zip(st.admit.tolist(), chunks[n_cont:].tolist(),
                                         strict=True)):
            blocks, hit = None, 0
            if cache:
                blocks, hit = mgr.get_computed_blocks(rid, self.admit_ids[i])
                n += self._check_hit(rid, hit, int(st.hit[i]))
            if mgr.allocate_slots(rid, n, num_new_computed_tokens=hit,
                                  new_computed_blocks=blocks) is None:
                self._short(rid, n, self.admit_ids[i] if cache else None, hit)
        mgr.run_step()
        self._end()
        self.prev_extend = st.extend_ids

    def _short(self, rid, n: int, ids=None, hit: int = 0) -> None:
        """allocate_slots returned None (in a small pool the inserts hold what this
        iteration releases): run what is recorded as a step of its own (the inserts then
        evictable), then ask again (a new request's hit looked up again)."""
        mgr = self.mgr
        if self.prefix_cache:
            mgr.run_step()
            blocks = None
            if ids is not None:
                blocks, again = mgr.get_computed_blocks(rid, ids)
                if again != hit:
                    raise RuntimeError(f"{self.name}: request {rid}'s hit changed")
            if mgr.allocate_slots(rid, n, num_new_computed_tokens=hit,
                                  new_computed_blocks=blocks) is not None:
                return
        raise RuntimeError(f"{self.name}: allocate_slots({rid}) returned None (pages or rows "
                           "short): the pools are sized from the trace")


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run benchmarks/bench_scheduler.py "
            "instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
