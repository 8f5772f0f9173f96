"""vLLM's real KV-cache manager as a peer in the scheduler benchmark, on the same trace.

vLLM's v1 ``KVCacheManager`` (the ``vllm`` package from the index; its scheduler and
KV-cache manager are plain Python, so a CPU build of torch is enough) is not a
re-implementation: it is the peer's own code, installed. Unlike TokenSpeed's scheduler
it takes explicit calls, so it replays the trace's decisions step by step, called as
vLLM's ``Scheduler.schedule()`` / ``update_from_output()`` call it::

    per iteration k     new_step_starts()
                        free(request) per request the trace releases at k (vLLM frees a
                        finished request while it processes the previous step's output)
                        allocate_slots(request, 1) per decoding request, then
                        allocate_slots(request, n) per request continuing its prefill
                        (the running requests); their new block ids (get_block_ids)
                        get_computed_blocks(request) per request the trace admits (with
                        prefix caching), then allocate_slots(request, n, hit tokens, hit
                        blocks, full_sequence_must_fit=True: vLLM's default admission
                        gate); its block ids (get_blocks(...).get_block_ids())
                        take_new_block_ids() (the scheduler drains it every step)

The window rule is vLLM's own: ``allocate_slots`` drops the blocks that left the sliding
window (``remove_skipped_blocks``) in every call, so its frees are not the trace's
decode-count gate. Timed (host, perf_counter_ns, gc off as for the project's drivers):
those calls, per iteration, over the trace's measured steps after its bootstrap and
warm-up, in turn with graphalloc's host path alone (``sched_host_path.py``: the same step
with tables, nothing launched), the order swapped every iteration, so that load on the
machine and each other's use of the CPU's caches fall on both alike.
Not in that figure, reported beside it as ``arrival_us``: the engine's own
bookkeeping around the manager -- a ``Request`` built per admitted request (with prefix
caching its block hasher hashes the prompt's full blocks there, vLLM's default
``sha256``) and the sampled token appended to every request that decoded or finished its
prefill (``append_output_token_ids``: a new full block is hashed there). graphalloc's
step hashes its page keys inside the step, so leaving vLLM's hashing out favours vLLM.
``num_computed_tokens`` advances as ``_update_after_schedule`` advances it (untimed).

Configuration from the trace: two KV-cache groups, FULL attention and sliding window (the
model window W, vLLM's ``SlidingWindowSpec``), ``block_size`` = the page size, ONE block
pool for both groups as vLLM has it, ``num_blocks`` = :data:`FACTOR` x both baseline pools
+ the blocks of the longest request in both groups + its null block (its admission gate,
``full_sequence_must_fit``, wants a whole prompt's blocks free at once where the trace
allocates chunk by chunk, and it frees by its own window rule: so that it never refuses a
decision of the trace; the pool's size does not enter its per-call cost, and a larger pool
evicts fewer cached blocks, which favours it), ``max_model_len`` = the trace's context,
``max_in_flight_tokens`` = the chunked-prefill budget (synchronous scheduling), prefix
caching on with a prefix workload and off otherwise, no stats logging, no KV events, no
connector. An admission's hit is
vLLM's own (``get_computed_blocks``, at most ``hit + chunk - 1`` tokens so the chunk
never vanishes); where it differs from the trace's, the chunk grows or shrinks by the
difference so lengths stay the trace's (``hits_equal_trace`` / ``recomputed_tokens``).

Nothing is compared page by page (vLLM hands out its own block ids from its own LRU free
queue): what is reported is the iteration's host cost and, as a check that it followed
the trace, whether every live request holds ``ceil(computed / page size)`` FULL blocks at
the end and how many hits equal the trace's. Without ``vllm`` importable, :data:`AVAILABLE`
is False and the benchmark says the peer was skipped and why. ``--vllm-path`` appends a
directory (the site-packages of a separate virtual environment) to ``sys.path``, after the
project's own packages (its torch and numpy stay first).
"""

from __future__ import annotations

import gc
import os
import sys
import time

import numpy as np

__all__ = ["AVAILABLE", "REASON", "VERSION", "Run", "load", "start", "measure",
           "markdown_lines", "placeholder_argv", "PLACEHOLDER"]

AVAILABLE, REASON, VERSION = False, "not loaded", None
PLACEHOLDER = "VLLM_SITE_PACKAGES"
FACTOR = 2  # vLLM's pool: FACTOR x (both baseline pools) + two longest requests + null
_v = None  # the imported names (a namespace), once loaded


class _Names:
    """vLLM's classes and functions this driver calls."""


def load(path: str | None = None) -> bool:
    """Import vLLM's KV-cache manager (``path`` appended to ``sys.path`` first)."""
    global AVAILABLE, REASON, VERSION, _v
    if path and path not in sys.path:
        sys.path.append(path)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch
        from vllm.config import CacheConfig
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )
        from vllm.v1.request import Request, RequestStatus
    except Exception as exc:  # ImportError, or a vLLM that does not import here
        AVAILABLE, REASON = False, f"vllm is not importable ({type(exc).__name__}: {exc})"
        return False
    try:
        from importlib import metadata
        VERSION = metadata.version("vllm")
    except Exception:  # installed without metadata on this path
        VERSION = "unknown"
    v = _Names()
    v.torch, v.SamplingParams, v.KVCacheManager = torch, SamplingParams, KVCacheManager
    v.FullAttentionSpec, v.SlidingWindowSpec = FullAttentionSpec, SlidingWindowSpec
    v.KVCacheConfig, v.KVCacheGroupSpec = KVCacheConfig, KVCacheGroupSpec
    v.Request, v.RUNNING = Request, RequestStatus.RUNNING
    v.get_request_block_hasher, v.init_none_hash = get_request_block_hasher, init_none_hash
    # vLLM's default prefix-caching hash (CacheConfig.prefix_caching_hash_algo)
    algo = CacheConfig.__dataclass_fields__["prefix_caching_hash_algo"].default
    v.hash_algo, v.hash_fn = algo, get_hash_fn_by_name(algo)
    _v, AVAILABLE, REASON = v, True, ""
    return True


def _stats(samples) -> dict | None:
    a = np.asarray(samples, dtype=np.float64)
    if not a.size:
        return None
    p20, p50, p80, p90 = np.percentile(a, (20, 50, 80, 90))
    return {"p50": float(p50), "p90": float(p90), "p20": float(p20), "p80": float(p80),
            "mean": float(a.mean()), "n": int(a.size)}


class _Replay:
    """vLLM's KV-cache manager driven through the trace's decisions (module docstring)."""

    def __init__(self, trace, pools: tuple[int, int]):
        v, spec = _v, trace.spec
        ps = spec.page_size
        self.caching = bool(spec.prefix)
        # one pool for both groups (module docstring: FACTOR x both pools, room for the
        # longest request's blocks in both groups, the null block)
        n_blocks = int(FACTOR * (pools[0] + pools[1])) + 2 * -(-spec.max_context_len // ps) + 1
        dtype = v.torch.float32
        groups = [
            v.KVCacheGroupSpec(["full"], v.FullAttentionSpec(
                block_size=ps, num_kv_heads=1, head_size=1, dtype=dtype)),
            v.KVCacheGroupSpec(["swa"], v.SlidingWindowSpec(
                block_size=ps, num_kv_heads=1, head_size=1, dtype=dtype,
                sliding_window=spec.window))]
        kv = v.KVCacheConfig(num_blocks=n_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        self.mgr = v.KVCacheManager(
            kv, max_model_len=spec.max_context_len, scheduler_block_size=ps,
            hash_block_size=ps, max_in_flight_tokens=spec.chunk_tokens,
            enable_caching=self.caching, log_stats=False)
        self.hasher = None
        if self.caching:  # as vLLM's engine core sets it up when caching is on
            v.init_none_hash(v.hash_fn)
            self.hasher = v.get_request_block_hasher(ps, v.hash_fn)
        self.config = {"num_blocks": n_blocks, "block_size": ps, "sliding_window": spec.window,
                       "max_model_len": spec.max_context_len,
                       "max_in_flight_tokens": spec.chunk_tokens,
                       "prefix_caching": self.caching,
                       "hash": v.hash_algo if self.caching else None,
                       "coordinator": type(self.mgr.coordinator).__name__}
        self.ps, self.trace = ps, trace
        self.tokens, self.prompt = trace.tokens, trace.fill
        self.n_out = np.ones(trace.n_requests, dtype=np.int64)  # sampling max_tokens
        for step in trace.steps:
            if len(step.decode):
                self.n_out[step.decode] += 1
        self.reqs: dict = {}  # trace request id -> vLLM Request
        self.hits_equal = self.hits_total = self.recomputed = 0
        self.hit_tokens = self.trace_hit_tokens = 0

    def _tokens(self, i: int, start: int, stop: int) -> list[int]:
        """Request ``i``'s token ids ``[start, stop)``: the trace's (a prefix workload), or
        made up per request (distinct prompts) where it has none."""
        toks = None if self.tokens is None else self.tokens[i]
        if toks is not None and stop <= len(toks):
            return [int(t) for t in toks[start:stop]]
        return [100 + (i * 7919 + p * 104_729) % 50_000 for p in range(start, stop)]

    def iteration(self, st, timed: list | None = None, arrival: list | None = None) -> None:
        v, mgr, reqs = _v, self.mgr, self.reqs
        # the engine's side before the step: the admitted requests arrive (untimed)
        a0 = time.perf_counter_ns()
        for i in st.admit.tolist():
            n = int(self.prompt[i])
            reqs[i] = v.Request(
                request_id=f"r{i}", prompt_token_ids=self._tokens(i, 0, n),
                sampling_params=v.SamplingParams(max_tokens=int(self.n_out[i]) + 1,
                                                 ignore_eos=True),
                pooling_params=None, block_hasher=self.hasher, arrival_time=0.0)
        a1 = time.perf_counter_ns()
        chunks = st.extend_n if self.caching else st.extend_n_nocache
        n_cont = len(st.extend_ids) - len(st.admit)
        cont = list(zip(st.extend_ids[:n_cont].tolist(), chunks[:n_cont].tolist(),
                        strict=True))
        admits = list(zip(st.admit.tolist(), chunks[n_cont:].tolist(), st.hit.tolist()
                          if self.caching else [0] * len(st.admit), strict=True))
        decode = [reqs[i] for i in st.decode.tolist()]
        released = [reqs.pop(i) for i in st.release.tolist()]
        scheduled = []  # (request, tokens scheduled, vLLM's hit, the trace's hit)
        t0 = time.perf_counter_ns()
        mgr.new_step_starts()
        for req in released:
            mgr.free(req)
        for req in decode:
            blocks = mgr.allocate_slots(req, 1)
            if blocks is None:
                raise RuntimeError(f"vLLM refused a decode of {req.request_id}: pool short")
            blocks.get_block_ids(allow_none=True)
        for i, n in cont:
            req = reqs[i]
            blocks = mgr.allocate_slots(req, n)
            if blocks is None:
                raise RuntimeError(f"vLLM refused a chunk of {req.request_id}: pool short")
            blocks.get_block_ids(allow_none=True)
            scheduled.append((req, n, None, None))
        for i, n, hit in admits:
            req = reqs[i]
            if self.caching:
                computed, n_hit, _ = mgr.get_computed_blocks(req, hit + n - 1)
            else:
                computed, n_hit = mgr.empty_kv_cache_blocks, 0
            n_sched = hit + n - n_hit  # lengths stay the trace's
            blocks = mgr.allocate_slots(req, n_sched, num_new_computed_tokens=n_hit,
                                        new_computed_blocks=computed,
                                        full_sequence_must_fit=True)
            if blocks is None:
                raise RuntimeError(f"vLLM refused the admission of {req.request_id}")
            req.status = v.RUNNING
            mgr.get_blocks(req.request_id).get_block_ids()
            scheduled.append((req, n_sched, n_hit, hit))
        mgr.take_new_block_ids()
        t1 = time.perf_counter_ns()
        # the scheduler's bookkeeping after the step: computed tokens advance (untimed),
        # then the sampled tokens are appended (timed into arrival: vLLM hashes there)
        for req, n, n_hit, hit in scheduled:
            if n_hit is not None:  # admitted: its computed tokens start at vLLM's hit
                req.num_computed_tokens = n_hit
                self.hits_total += 1
                self.hits_equal += n_hit == hit
                self.recomputed += max(0, hit - n_hit)
                self.hit_tokens += n_hit
                self.trace_hit_tokens += hit
            req.num_computed_tokens += n
        for req in decode:
            req.num_computed_tokens += 1
        a2 = time.perf_counter_ns()
        for req in decode + [s[0] for s in scheduled]:
            pos = req.num_tokens
            if req.num_computed_tokens >= pos:  # a decode, or the end of its prefill
                req.append_output_token_ids(self._tokens(int(req.request_id[1:]), pos,
                                                         pos + 1)[0])
        a3 = time.perf_counter_ns()
        if timed is not None:
            timed.append((t1 - t0) / 1e3)
            arrival.append((a1 - a0 + a3 - a2) / 1e3)

    def full_blocks_match(self) -> bool:
        """Every live request holds ceil(computed / page size) FULL blocks (vLLM's own
        per-request block lists), i.e. it followed the trace's lengths."""
        full = self.mgr.coordinator.single_type_managers[0].req_to_blocks
        return all(len(full.get(r.request_id, ())) == -(-r.num_computed_tokens // self.ps)
                   for r in self.reqs.values())


class Run:
    """One configuration's peer run: :meth:`start` replays the trace's steps before the
    measured ones (untimed), then each :meth:`step` is one timed iteration -- called by the
    benchmark in turn with graphalloc's host path alone, so that load on the machine
    falls on both alike -- and :meth:`result` the record. A peer that raises keeps its
    error; its later steps are skipped."""

    def __init__(self, trace, pools: tuple[int, int]):
        self.trace, self.pools = trace, pools
        self.host: list[float] = []
        self.arrival: list[float] = []
        self.error = None
        self.rep = None
        self.setup_s = 0.0
        self.next = 0  # the trace step the manager replays next

    def _guard(self, fn) -> None:
        if self.error is not None:
            return
        try:
            fn()
        except Exception as exc:  # the peer's own refusal: recorded, the run goes on
            self.error = f"{type(exc).__name__}: {exc}"

    def start(self, m0: int) -> Run:
        """Build the manager and replay steps ``[0, m0)`` (untimed)."""
        def go():
            t0 = time.perf_counter()
            self.rep = _Replay(self.trace, self.pools)
            self.setup_s = time.perf_counter() - t0
            for st in self.trace.steps[:m0]:
                self.rep.iteration(st)
            self.next = m0
        self._guard(go)
        return self

    def step(self, st) -> None:
        """One timed iteration, trace step ``st`` (the next one: the caller steps through
        the trace in order; it keeps the collector off, as for its drivers)."""
        def go():
            if st.index != self.next:
                raise RuntimeError(f"vLLM peer: step {st.index} given, {self.next} due")
            self.rep.iteration(st, self.host, self.arrival)
            self.next += 1
        self._guard(go)

    def finish(self, stop: int) -> None:
        """Step alone (collector off) up to trace step ``stop`` (:func:`measure`)."""
        gc.collect()
        gc.disable()
        try:
            while self.error is None and self.next < stop:
                self.step(self.trace.steps[self.next])
        finally:
            gc.enable()

    def result(self) -> dict:
        """The record of the run (``{"error": ...}`` when the peer raised)."""
        if self.error is not None:
            return {"error": self.error}
        rep = self.rep
        return {"version": VERSION, "step_us": _stats(self.host),
                "arrival_us": _stats(self.arrival), "setup_s": self.setup_s,
                "free_blocks_end": int(rep.mgr.block_pool.get_num_free_blocks()),
                "live_requests_end": len(rep.reqs),
                "full_blocks_match": bool(rep.full_blocks_match()),
                "admitted": rep.hits_total, "hits_equal_trace": rep.hits_equal,
                "recomputed_tokens": rep.recomputed, "hit_tokens": rep.hit_tokens,
                "trace_hit_tokens": rep.trace_hit_tokens, "config": rep.config}


def start(trace, pools: tuple[int, int], m0: int) -> Run | None:
    """A :class:`Run` replayed up to step ``m0``; None when vLLM is not available."""
    return Run(trace, pools).start(m0) if AVAILABLE else None


def measure(trace, pools: tuple[int, int], m0: int, m: int) -> dict:
    """vLLM's manager alone on ``trace``: steps ``[0, m0)`` untimed, ``[m0, m0 + m)``
    timed (collector off). ``{"skipped": reason}`` when it is not available;
    ``{"error": ...}`` when it raised.

    Cost: the manager's own per request Python (its calls per step, module docstring)."""
    if not AVAILABLE:
        return {"skipped": REASON}
    run = Run(trace, pools).start(m0)
    run.finish(m0 + m)
    return run.result()


def placeholder_argv(argv) -> list[str]:
    """``argv`` with the directory of ``--vllm-path`` replaced by :data:`PLACEHOLDER` (a
    result records where the peer comes from, not this machine's folders)."""
    out, hide = [], False
    for arg in argv:
        if hide:
            arg, hide = PLACEHOLDER, False
        elif arg == "--vllm-path":
            hide = True
        elif arg.startswith("--vllm-path="):
            arg = f"--vllm-path={PLACEHOLDER}"
        out.append(arg)
    return out


def _cell(st) -> str:
    return f"{st['p50']:.0f} / {st['p90']:.0f}" if st else "–"


def markdown_lines(res: dict, key: str) -> list[str]:
    """The benchmark report's section on the vLLM peer (or why it was skipped); ``key``:
    graphalloc + tables' whole-step figure (``sched_tokenspeed.graphalloc_key``). The 10x
    target is judged on the whole step on a CUDA run, on the host path alone
    (``sched_host_path.py``) on a CPU run."""
    peer = (res.get("peers") or {}).get("vllm") or {}
    lines = ["", "## Real peer: vLLM's KV-cache manager, same trace", ""]
    if not peer.get("available"):
        return lines + [f"Skipped: {peer.get('reason') or 'not run'}. Install `vllm` (the "
                        "package index; engines/vllm/install.sh installs it with a CPU "
                        "torch) and pass `--vllm-path` (its site-packages) to include it."]
    cuda = key == "host_us"
    what = "whole step" if cuda else "whole step less its eager device part (CPU run)"
    judged = ("the whole step" if cuda else "the host path alone (a CPU run: the eager "
              "device part leaves the CPU's caches cold for the host part that follows it)")
    lines += [f"vLLM {peer.get('version')}'s own `KVCacheManager` (its code, from the package "
              "index; `sched_vllm_peer.py`) replaying each configuration's trace, called as "
              "vLLM's scheduler calls it: `free` per finished request, `allocate_slots` per "
              "running request (its `Request` objects), `get_computed_blocks` + "
              "`allocate_slots` per new request, the new block ids read back, timed, in turn "
              "with graphalloc's host path (the order swapped every iteration); its window "
              "rule and block ids are its own, so pages are not compared. Arrival + append: "
              "the engine's `Request` construction and sampled-token appends (vLLM hashes "
              "its blocks there), not in its step, reported beside it. graphalloc + tables, "
              f"whole step: host us, {what}; host path: the same step with an executor that "
              "launches nothing (`sched_host_path.py`; on a GPU one graph-replay call more). "
              "Microseconds, p50 / p90; ratios of the p50s.",
              "", "Target (issue 34): vLLM's manager at least 10x graphalloc's step with "
              f"tables at every B, prefix caching on and off; judged here on {judged}.", "",
              "| B | ps | W | interval | graphalloc + tables, host path | graphalloc + "
              "tables, whole step | vLLM manager step | vLLM / ga host path | vLLM / ga "
              "whole step | 10x target | vLLM arrival + append (p50) | prefix caching | hits "
              "equal the trace's (hit tokens vLLM / trace) | FULL blocks follow the trace |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in res["configs"]:
        vp = (c.get("peers") or {}).get("vllm") or {}
        g = ((c.get("impls") or {}).get("graphalloc_tables") or {}).get(key)
        h = (c.get("host_path") or {}).get("host_us")
        small = " (small pool)" if (c.get("prefix") or {}).get("pool") == "small" else ""
        row = (f"| {c['b']} | {c['ps']} | {c['window']} | {c['interval']}{small} | "
               f"{_cell(h) if h else (c.get('host_path') or {}).get('error', '–')} | "
               f"{_cell(g)} | ")
        if "step_us" not in vp:
            why = vp.get("error") or vp.get("skipped") or "not run"
            lines.append(row + f"{why} | – | – | – | – | – | – | – |")
            continue
        st, arr = vp["step_us"], vp["arrival_us"]
        x_host = st["p50"] / h["p50"] if h and h["p50"] else None
        x_step = st["p50"] / g["p50"] if g and g["p50"] else None
        x = x_step if cuda else x_host
        met = "–" if x is None else ("met" if x >= 10 else "missed")
        hits = (f"{vp['hits_equal_trace']} of {vp['admitted']} ({vp['hit_tokens']} / "
                f"{vp['trace_hit_tokens']})")
        lines.append(row + f"{_cell(st)} | "
                     + " | ".join("–" if r is None else f"{r:.1f}x" for r in (x_host, x_step))
                     + f" | {met} | {arr['p50']:.0f} | "
                     f"{'on' if vp['config']['prefix_caching'] else 'off'}"
                     f" | {hits} | {'yes' if vp['full_blocks_match'] else 'NO'} |")
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
