"""Host cost of one scheduler iteration through the seams, against alloc.step of the same work.

    python benchmarks/bench_seams.py --out results/bench/seams-cpu     # CPU, ~15 min
    python benchmarks/bench_seams.py --quick --out /tmp/bench_seams     # smoke run
    python benchmarks/bench_seams.py --batches 256 --executors host --out /tmp/seams256
                                                                        # the ratios, ~2 min

Entry points for whoever changes a seam: the command line above picks the cases
(``--batches``, ``--executors host,eager``, ``--caches off,on``, ``--seams sglang,vllm``) and
exits 1 unless both allocators' ledgers agree; from Python, ``measure(kind, batch, cache,
executor, n_warmup, n_samples, seed)`` returns one case's record (``ratio`` = seam p50 /
direct p50, the target ``TARGET`` = 1.5, ``identical``), e.g. ``measure("sglang", 256, False,
"host", 20, 200, seed=256)`` with ``benchmarks/`` on ``sys.path``.

A continuous-batching workload at B in {16, 64, 256, 1024} running requests, page size 16,
a model window of 4096 (``sliding_window = 4095``), pool mode; lengths start uniform in
[W/2, 2W]. Every iteration the longest request finishes and one new request is prefilled
(one 256-token chunk; with the prefix cache its prompt is a cached 512-token system prompt
plus those 256 tokens, admitted on the cache's pages), the other B - 1 decode one token.

* SGLang: the finished request's ``release_kv_cache`` in a free group (the scheduler's
  ``process_batch_result`` finds it in its own loop over the batch, untimed) +
  ``prepare_for_extend(new)`` + ``prepare_for_decode(B - 1)`` (two steps: the extend, the
  decode), SWA eviction interval 1, ``seq_lens_cpu`` and ``req_pool_indices_cpu`` CPU
  tensors as SGLang's ScheduleBatch keeps them;
* vLLM: ``free(done)`` + B ``allocate_slots`` + ``run_step()`` (one step).

The same work written directly (``direct``): the Steps the seam ran -- copied, so both
allocators go through the same states -- handed to ``alloc.step`` on a second allocator,
with what an engine would do around them: ``alloc.free_row()`` for the new request and,
with the cache, the insert's own work (``page_keys`` of the finished request's tokens,
``cache.lookup``, ``cache.add_entry`` after the step, ``cache.unlock`` of the hit). The
lookups (``match_prefix`` / ``get_computed_blocks``) are untimed on both sides. Both sides
run on one core, GC off, interleaved (seam, direct) per iteration; p50 with p20 / p80.

Two executors: ``host`` (the step planned and submitted, no kernel: the host path of a GPU
step, whose graph replay is a few microseconds more) and ``eager`` (the CPU torch kernels:
what ``alloc.step`` costs on this CPU). The warm start runs without kernels in both, so in
``eager`` the device tables are stale: the kernels' times are right, their results unused.
At the end the two allocators' ledgers must be identical (``identical``). Writes
``bench_seams.json``, ``bench_seams.md`` and ``bench_seams.png`` into ``--out``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from figures import finish, machine_name, pyplot, set_b_axis, set_log_y  # noqa: E402
from timing import bench_main, bench_parser, machine_info, summarize  # noqa: E402

import graphalloc as ga  # noqa: E402
from graphalloc.device.executor import Executor, launch_exact  # noqa: E402
from graphalloc.integrations.sglang import SGLangAllocator  # noqa: E402
from graphalloc.integrations.vllm import GraphallocKVCacheManager  # noqa: E402
from graphalloc.plan.step import KINDS, Step  # noqa: E402
from graphalloc.sharing.prefix_cache import page_keys  # noqa: E402

PAGE_SIZE = 16
MODEL_WINDOW = 4096
CHUNK = 256
SYSTEM = 512  # tokens of the cached system prompt (prefix cache on)
BATCHES = (16, 64, 256, 1024)
TARGET = 1.5  # the seam's iteration at most this many times the direct one


class Switch(Executor):
    """The benchmark's executor: nothing (``kernels`` False: the host path, plan + submit)
    or the eager step kernels over exactly the step's rows."""

    name = "switch"

    def __init__(self):
        super().__init__()
        self.kernels = False

    def execute(self, planned) -> None:
        if self.kernels:
            self.count(launch_exact(self.parts, planned))


def make_config(batch: int, cache: bool, n_iters: int) -> ga.AllocatorConfig:
    w = MODEL_WINDOW - 1
    max_ctx = 2 * MODEL_WINDOW + 2048
    per_req_full = -(-max_ctx // PAGE_SIZE)
    per_req_swa = -(-w // PAGE_SIZE) + 2
    n_entries = n_iters + 8 if cache else 0  # every finished request stays cached
    return ga.AllocatorConfig(
        page_size=PAGE_SIZE, num_full_pages=(batch + 2 + n_entries) * per_req_full + 64,
        num_swa_pages=(batch + 2 + n_entries) * (per_req_swa + CHUNK // PAGE_SIZE + 1),
        max_reqs=batch + 8, max_context_len=max_ctx, model_window=w + 1,
        index_dtype=torch.int32, device="cpu", backend="torch",
        max_tokens_per_alloc_row=MODEL_WINDOW, max_step_tokens=MODEL_WINDOW + 4 * batch + 8,
        max_alloc_rows=batch + 8, max_handles=n_entries)


def copy_step(step: Step) -> Step:
    """A Step with its own arrays (the seam's point into buffers it reuses)."""
    kw = {}
    for k in KINDS:
        v = getattr(step, k)
        if v is None or v is False:
            continue
        kw[k] = tuple(np.array(x) for x in v) if isinstance(v, tuple) else (
            v if isinstance(v, bool) else np.array(v))
    return Step(**kw)


def ledgers_equal(a, b) -> bool:
    la, lb = a.ledger.arrays(), b.ledger.arrays()
    same = all(np.array_equal(la[k], lb[k]) for k in la)
    if a.prefix_cache is not None:
        same &= len(a.prefix_cache) == len(b.prefix_cache)
    return same


class Req:
    """The SGLang request fields the seam reads (token ids as a range: no big lists)."""

    __slots__ = ("rid", "req_pool_idx", "kv_len", "origin_input_ids", "output_ids",
                 "last_node", "done")

    def __init__(self, rid: int, prompt):
        self.rid, self.req_pool_idx, self.kv_len = rid, None, 0
        self.origin_input_ids, self.output_ids = prompt, []
        self.last_node, self.done = None, False

    def finished(self) -> bool:
        return self.done

    def tokens(self) -> list:
        return list(self.origin_input_ids) + self.output_ids


class Batch:
    __slots__ = ("reqs", "prefix_lens", "extend_lens", "seq_lens_cpu", "req_pool_indices_cpu")

    def __init__(self, reqs, prefix_lens=None, extend_lens=None, seq_lens_cpu=None,
                 req_pool_indices_cpu=None):
        self.reqs, self.prefix_lens, self.extend_lens = reqs, prefix_lens, extend_lens
        self.seq_lens_cpu, self.req_pool_indices_cpu = seq_lens_cpu, req_pool_indices_cpu


class Driver:
    """One case: the seam on allocator ``a``, the same Steps direct on ``d``."""

    def __init__(self, kind: str, batch: int, cache: bool, n_iters: int, seed: int):
        cfg = make_config(batch, cache, n_iters)
        self.a = ga.HybridAllocator(cfg, executor=Switch(), prefix_cache=cache)
        self.d = ga.HybridAllocator(cfg, executor=Switch(), prefix_cache=cache)
        self.kind, self.batch, self.cache = kind, batch, cache
        self.rng = np.random.default_rng(seed)
        self.next_id = 0
        self.system = range(1, SYSTEM + 1)
        if kind == "sglang":
            self.seam = SGLangAllocator(self.a)
        else:
            self.seam = GraphallocKVCacheManager(self.a, enable_caching=cache)
        self.computed: dict = {}  # vLLM: request id -> computed tokens
        self.tokens: dict = {}  # vLLM: request id -> token ids (a range + outputs)
        self.running: list = []
        self._warm()

    # ---- helpers --------------------------------------------------------------------------
    def _prompt(self, n: int):
        base = 100_000 + 10_000 * self.next_id
        self.next_id += 1
        return range(base, base + n)

    def _mirror(self) -> None:
        """Run the seam's last Step on the direct allocator too (untimed)."""
        self.d.step(copy_step(self.seam.pending.last_step))

    def _mirror_cache(self, tokens, handle_of_take) -> None:
        keys = page_keys(tokens, PAGE_SIZE)
        n = self.d.ledger.h_len[handle_of_take] // PAGE_SIZE
        self.d.prefix_cache.add_entry(int(handle_of_take), keys[:n])

    # ---- warm start (untimed, no kernels) ------------------------------------------------
    def _warm(self) -> None:
        lengths = self.rng.integers(MODEL_WINDOW // 2, 2 * MODEL_WINDOW, self.batch)
        if self.cache:  # the system prompt's entry, cached while its window is there
            self._add_request(SYSTEM + CHUNK, prompt=range(1, SYSTEM + CHUNK + 1))
            self._cache_system()
        for n in lengths:
            self._add_request(int(n))

    def _add_request(self, n: int, prompt=None) -> None:
        prompt = self._prompt(n) if prompt is None else prompt
        cap = self.a.config.max_tokens_per_alloc_row
        if self.kind == "sglang":
            req = Req(self.next_id, prompt)
            done = 0
            while done < n:
                k = min(cap, n - done)
                out = self.seam.prepare_for_extend(Batch([req], [done], [k]))
                assert out is not None
                self._mirror()
                done += k
                req.kv_len = done
            # one decode evicts the window below the prompt (SGLang's rule at a decode)
            assert self.seam.prepare_for_decode(Batch([req], seq_lens_cpu=[done])) is not None
            self._mirror()
            req.kv_len = done + 1
            req.output_ids.append(7)
            self.running.append(req)
        else:
            rid = f"r{self.next_id}"
            done = 0
            while done < n:
                k = min(cap, n - done)
                assert self.seam.allocate_slots(rid, k, num_computed_tokens=done) is not None
                self.seam.run_step()
                self._mirror()
                done += k
            # one decode token removes the blocks below the window (vLLM's rule)
            assert self.seam.allocate_slots(rid, 1, num_computed_tokens=n) is not None
            self.seam.run_step()
            self._mirror()
            self.computed[rid], self.tokens[rid] = n + 1, prompt
            self.running.append(rid)

    def _cache_system(self) -> None:
        """Insert the system prompt's pages and release that request (one step)."""
        first = self.running.pop()
        if self.kind == "sglang":
            tokens = list(first.origin_input_ids)
            self.seam.release_kv_cache(first)
            self.seam.flush()
        else:
            tokens = list(self.tokens.pop(first))
            self.seam.free(first, tokens[:SYSTEM])
            self.computed.pop(first)
            self.seam.run_step()
        step = self.seam.pending.last_step
        self._mirror()
        self._mirror_cache(tokens[:SYSTEM] if self.kind != "sglang" else tokens,
                           int(step.take[0][0]))

    # ---- one iteration -------------------------------------------------------------------
    def iteration(self, timed: bool) -> tuple[float, float]:
        """Run one iteration through the seam and directly; returns (seam us, direct us)."""
        return self._sglang() if self.kind == "sglang" else self._vllm()

    def _sglang(self) -> tuple[float, float]:
        seam, d, cache = self.seam, self.d, self.cache
        running = self.running
        done = max(running, key=lambda r: r.kv_len)
        done.done = True
        done_tokens, done_row = (done.tokens() if cache else None), done.req_pool_idx
        prompt = (list(self.system) + list(self._prompt(CHUNK))) if cache else self._prompt(
            CHUNK)
        new = Req(self.next_id, prompt)
        p = seam.match_prefix(new) if cache else 0
        hit = None
        if cache:  # the direct side's lookup (untimed, as match_prefix)
            m = d.prefix_cache.match(new.tokens()[:-1])
            hit = m.handle
            d.prefix_cache.lock(hit)
        decode = [r for r in running if r is not done]
        ext = Batch([new], [p], [len(prompt) - p])
        dec = Batch(decode, seq_lens_cpu=torch.tensor([r.kv_len for r in decode]),
                    req_pool_indices_cpu=torch.tensor([r.req_pool_idx for r in decode]))
        finished = [r for r in running if r.finished()]  # the scheduler's own loop
        # the seam: SGLang's calls, timed (process_batch_result's free group, the two
        # prepare_* of the next iteration)
        t0 = time.perf_counter_ns()
        seam.free_group_begin()
        for req in finished:
            seam.release_kv_cache(req)
        seam.free_group_end()
        out_e = seam.prepare_for_extend(ext)
        t1 = time.perf_counter_ns()
        s1 = copy_step(seam.pending.last_step)
        t2 = time.perf_counter_ns()
        out_d = seam.prepare_for_decode(dec)
        t3 = time.perf_counter_ns()
        s2 = copy_step(seam.pending.last_step)
        assert out_e is not None and out_d is not None
        # direct: the same two steps, with an engine's row and cache work around them
        t4 = time.perf_counter_ns()
        d.free_row()
        if cache:
            keys = page_keys(done_tokens, PAGE_SIZE)
            n = min(len(keys), int(d.ledger.committed[done_row]) // PAGE_SIZE)
            d.prefix_cache.lookup(keys[:n])
        d.step(s1)
        if cache:
            if s1.take is not None:
                d.prefix_cache.add_entry(int(s1.take[0][0]), keys[:int(s1.take[2][0]) //
                                                                  PAGE_SIZE])
            d.prefix_cache.unlock(hit)
        d.step(s2)
        t5 = time.perf_counter_ns()
        new.kv_len = len(new.origin_input_ids)
        for r in decode:
            r.kv_len += 1
            r.output_ids.append(7)
        self.running = decode + [new]
        return ((t1 - t0) + (t3 - t2)) / 1e3, (t5 - t4) / 1e3

    def _vllm(self) -> tuple[float, float]:
        seam, d, cache = self.seam, self.d, self.cache
        running, computed = self.running, self.computed
        done = max(running, key=lambda r: computed[r])
        prompt = (list(self.system) + list(self._prompt(CHUNK))) if cache else self._prompt(
            CHUNK)
        rid = f"r{self.next_id}"  # (after the prompt's id: unique)
        done_tokens = (list(self.tokens[done]) + [7] * (computed[done]
                                                        - len(self.tokens[done]))
                       ) if cache else None
        blocks, n_hit, hit = None, 0, None
        if cache:  # untimed lookups, both sides
            blocks, n_hit = seam.get_computed_blocks(rid, prompt)
            m = d.prefix_cache.match(prompt[:-1])
            hit = m.handle
            d.prefix_cache.lock(hit)
        decode = [r for r in running if r != done]
        comp = [computed[r] for r in decode]
        alloc_slots = seam.allocate_slots
        t0 = time.perf_counter_ns()
        seam.free(done, done_tokens)
        for r, c in zip(decode, comp, strict=True):
            alloc_slots(r, 1, num_computed_tokens=c)
        if cache:
            alloc_slots(rid, len(prompt) - n_hit, num_new_computed_tokens=n_hit,
                        new_computed_blocks=blocks)
        else:
            alloc_slots(rid, CHUNK)
        seam.run_step()
        t1 = time.perf_counter_ns()
        s = copy_step(seam.pending.last_step)
        t2 = time.perf_counter_ns()
        d.free_row()
        if cache:
            keys = page_keys(done_tokens, PAGE_SIZE)
            d.prefix_cache.lookup(keys)
        d.step(s)
        if cache:
            if s.take is not None:
                d.prefix_cache.add_entry(int(s.take[0][0]), keys[:int(s.take[2][0]) //
                                                                 PAGE_SIZE])
            d.prefix_cache.unlock(hit)
        t3 = time.perf_counter_ns()
        for r in decode:
            computed[r] += 1
        del computed[done]
        self.tokens.pop(done)
        computed[rid], self.tokens[rid] = len(prompt), prompt
        self.running = decode + [rid]
        return (t1 - t0) / 1e3, (t3 - t2) / 1e3


def measure(kind: str, batch: int, cache: bool, executor: str, n_warmup: int,
            n_samples: int, seed: int) -> dict:
    load0 = os.getloadavg()[0]
    drv = Driver(kind, batch, cache, n_warmup + n_samples, seed)
    for alloc in (drv.a, drv.d):
        alloc.executor.kernels = executor == "eager"
    seam_us, direct_us, ratios = [], [], []
    gc.collect()
    gc.disable()
    try:
        for i in range(n_warmup + n_samples):
            s, t = drv.iteration(timed=i >= n_warmup)
            if i >= n_warmup:
                seam_us.append(s)
                direct_us.append(t)
                ratios.append(s / t)
    finally:
        gc.enable()
    identical = ledgers_equal(drv.a, drv.d)
    out = {"seam": kind, "batch": batch, "cache": cache, "executor": executor,
           "seam_us": summarize(seam_us), "direct_us": summarize(direct_us),
           "paired_ratio": summarize(ratios), "identical": identical,
           "steps_seam": drv.a.steps_run, "steps_direct": drv.d.steps_run,
           "load_average": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    out["ratio"] = out["seam_us"]["p50"] / out["direct_us"]["p50"]
    return out


def _q(stats: dict) -> str:
    return f"{stats['p50']:.1f} ({stats['p20']:.1f} / {stats['p80']:.1f})"


def plot(doc: dict, path: str) -> bool:
    """Top: seam vs direct p50 (p20-p80 bands) per B, one panel per executor x cache.
    Bottom: the ratio seam p50 / direct p50 per executor, with the target."""
    plt = pyplot()
    rows = doc["results"]
    if plt is None or not rows:
        return False
    import matplotlib.ticker as mticker
    panels = [(ex, c) for ex in ("host", "eager") for c in (False, True)
              if any(r["executor"] == ex and r["cache"] == c for r in rows)]
    fig = plt.figure(figsize=(4.4 * len(panels), 7.6))
    grid = fig.add_gridspec(2, len(panels), height_ratios=(1.25, 1.0))
    styles = {("sglang", "seam"): dict(color="tab:blue", marker="o", label="SGLang seam"),
              ("sglang", "direct"): dict(color="tab:blue", marker="o", ls=":", mfc="white",
                                         label="SGLang: alloc.step of the same work"),
              ("vllm", "seam"): dict(color="tab:red", marker="s", label="vLLM seam"),
              ("vllm", "direct"): dict(color="tab:red", marker="s", ls=":", mfc="white",
                                       label="vLLM: alloc.step of the same work")}
    batches = sorted({r["batch"] for r in rows})
    top = []
    for j, (ex, c) in enumerate(panels):
        ax = fig.add_subplot(grid[0, j])
        top.append(ax)
        for (kind, side), style in styles.items():
            sel = sorted((r for r in rows if r["executor"] == ex and r["cache"] == c
                          and r["seam"] == kind), key=lambda r: r["batch"])
            if not sel:
                continue
            b = [r["batch"] for r in sel]
            key = f"{side}_us"
            ax.plot(b, [r[key]["p50"] / 1e3 for r in sel], **style)
            ax.fill_between(b, [r[key]["p20"] / 1e3 for r in sel],
                            [r[key]["p80"] / 1e3 for r in sel], color=style["color"],
                            alpha=0.12)
        set_log_y(ax)
        set_b_axis(ax, batches, "running requests B")
        ax.set_ylabel("ms per iteration (p50)")
        ax.set_title(f"{'host path (no kernel)' if ex == 'host' else 'eager CPU kernels'}, "
                     f"prefix cache {'on' if c else 'off'}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    executors = [ex for ex in ("host", "eager") if any(r["executor"] == ex for r in rows)]
    half = len(panels) // max(len(executors), 1)
    ratio_styles = {("sglang", False): dict(color="tab:blue", marker="o", ls="-"),
                    ("sglang", True): dict(color="tab:blue", marker="o", ls="--", mfc="white"),
                    ("vllm", False): dict(color="tab:red", marker="s", ls="-"),
                    ("vllm", True): dict(color="tab:red", marker="s", ls="--", mfc="white")}
    for i, ex in enumerate(executors):
        ax = fig.add_subplot(grid[1, i * half:(i + 1) * half])
        for (kind, c), style in ratio_styles.items():
            sel = sorted((r for r in rows if r["executor"] == ex and r["cache"] == c
                          and r["seam"] == kind), key=lambda r: r["batch"])
            if sel:
                ax.plot([r["batch"] for r in sel], [r["ratio"] for r in sel],
                        label=f"{'SGLang' if kind == 'sglang' else 'vLLM'}, cache "
                              f"{'on' if c else 'off'}", **style)
        ax.axhline(TARGET, color="black", ls="--", lw=1, label=f"target {TARGET}x")
        ax.axhline(1.0, color="gray", ls=":", lw=1)
        set_b_axis(ax, batches, "running requests B")
        ratios = [r["ratio"] for r in rows if r["executor"] == ex]
        ax.set_yscale("log")
        ax.set_ylim(min(0.7, 0.9 * min(ratios)), max(2.0, 1.25 * max(ratios)))
        ticks = [t for t in (0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 50)
                 if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]]
        ax.yaxis.set_major_locator(mticker.FixedLocator(ticks))
        ax.yaxis.set_major_formatter(mticker.FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.yaxis.set_minor_locator(mticker.NullLocator())
        ax.set_ylabel("seam p50 / direct p50")
        ax.set_title(f"ratio, {'host path (no kernel)' if ex == 'host' else 'eager CPU kernels'}",
                     fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", ncol=2)
    handles, labels = top[0].get_legend_handles_labels()
    caption = (
        "One iteration: the longest request finishes, one is prefilled (256 tokens; with "
        "the cache on a 512-token cached prefix), B - 1 decode. SGLang: release_kv_cache + "
        "prepare_for_extend + prepare_for_decode (two steps); vLLM: free + B allocate_slots "
        "+ run_step (one step). Direct (dotted, open markers): the same Steps through "
        "alloc.step on a second allocator, with the engine's free_row and the cache "
        "insert's own work. Bands: p20-p80. Host path: plan + submit, no kernel (a GPU "
        "step's host cost without its replay); eager: the CPU torch kernels run too, what "
        "alloc.step costs on this CPU.")
    finish(fig, path, title="Seam iteration vs alloc.step of the same work, host time ["
           f"{machine_name(doc.get('machine'))}]", caption=caption,
           legend=(handles, labels), ncol=2)
    return True


def run(args, argv, device, backend, note) -> int:
    del backend, note
    if device.type != "cpu":
        print("bench_seams measures host time on the CPU: pass --device cpu", file=sys.stderr)
        return 1
    batches = (16, 64) if args.quick else tuple(int(b) for b in args.batches.split(","))
    executors = [e for e in args.executors.split(",") if e]
    caches = [{"off": False, "on": True}[c] for c in args.caches.split(",") if c]
    kinds = [k for k in args.seams.split(",") if k]
    cases = []
    for executor in executors:
        for cache in caches:
            for kind in kinds:
                for batch in batches:
                    if executor == "eager":
                        n_warmup, n_samples = (1, 3) if args.quick else (3, 15)
                    else:
                        n_warmup, n_samples = (3, 20) if args.quick else (20, 200)
                    cases.append((kind, batch, cache, executor, n_warmup, n_samples))
    results = []
    for kind, batch, cache, executor, n_warmup, n_samples in cases:
        row = measure(kind, batch, cache, executor, n_warmup, n_samples, seed=batch)
        row["n_samples"], row["n_warmup"] = n_samples, n_warmup
        results.append(row)
        print(f"{executor:5s} cache={int(cache)} {kind:6s} B={batch:5d}  seam {_q(row['seam_us'])}"
              f"  direct {_q(row['direct_us'])}  ratio {row['ratio']:.2f}  identical "
              f"{row['identical']}", flush=True)
    info = machine_info(device)
    doc = {"benchmark": "bench_seams", "command": "python benchmarks/bench_seams.py "
           + " ".join(argv), "page_size": PAGE_SIZE, "model_window": MODEL_WINDOW,
           "chunk": CHUNK, "system_prompt": SYSTEM, "target_ratio": TARGET, "machine": info,
           "results": results}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_seams.json"), "w") as f:
        json.dump(doc, f, indent=1)
    lines = [
        "# Seam iteration vs alloc.step of the same work (host time)", "",
        f"`{doc['command']}` on {info['summary']}.", "",
        f"Page size {PAGE_SIZE}, model window {MODEL_WINDOW}, pool mode, lengths uniform in "
        f"[W/2, 2W]. One iteration: the longest request finishes, one new request is "
        f"prefilled ({CHUNK} tokens; cache on: on a cached {SYSTEM}-token system prompt), "
        "B - 1 decode one token. SGLang: `release_kv_cache` in a free group + "
        "`prepare_for_extend` + `prepare_for_decode` (two steps); vLLM: `free` + B "
        "`allocate_slots` + `run_step` "
        "(one step). `direct`: the same Steps (copied from the seam's) through `alloc.step` "
        "on a second allocator, plus `alloc.free_row()` and, with the cache, the insert's "
        "own work (`page_keys`, `lookup`, `add_entry`, `unlock`). Microseconds, p50 (p20 / "
        "p80); `ratio` = seam p50 / direct p50 (target <= "
        f"{TARGET}), `paired` = p50 of the per-iteration ratios. Executor `host`: plan + "
        "submit, no kernel (the host path of a GPU step); `eager`: the CPU torch kernels "
        "run too (what `alloc.step` costs on this CPU; warm start without kernels, so the "
        "device tables are stale: timing only). `identical`: both allocators' ledgers "
        "equal at the end.", "",
        f"The machine has {os.cpu_count()} cores shared with other jobs: `load` is the "
        "1-minute load average before / after each case; above the core count an iteration "
        "of a few milliseconds is often descheduled, which inflates p50 and p80 (p20 is "
        "the least disturbed).", "",
        "| executor | cache | seam | B | seam us | direct us | ratio | paired | load | "
        "identical |",
        "|:---|:---:|:---|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in results:
        lines.append(f"| {r['executor']} | {'on' if r['cache'] else 'off'} | {r['seam']} | "
                     f"{r['batch']} | {_q(r['seam_us'])} | {_q(r['direct_us'])} | "
                     f"{r['ratio']:.2f} | {r['paired_ratio']['p50']:.2f} | "
                     f"{r['load_average'][0]:.1f} / {r['load_average'][1]:.1f} | "
                     f"{r['identical']} |")
    with open(os.path.join(args.out, "bench_seams.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(doc, os.path.join(args.out, "bench_seams.png"))
    print("\n".join(lines))
    return 0 if all(r["identical"] for r in results) else 1


def main(argv=None) -> int:
    parser = bench_parser(__doc__, os.path.join(REPO, "results", "bench", "seams-cpu"),
                          "kernels of the eager executor (CPU: torch)")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)),
                        help="running requests B, comma-separated")
    parser.add_argument("--executors", default="host,eager", help="host and/or eager")
    parser.add_argument("--caches", default="off,on", help="prefix cache off and/or on")
    parser.add_argument("--seams", default="sglang,vllm", help="sglang and/or vllm")
    return bench_main(argv, parser.parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
