"""The one measurement module of benchmarks/ and examples/: quantiles, sample loops, per-step
GPU intervals, the empty-graph floor, launch and graph-node counts, and the machine a run
was taken on. Every benchmark and every example that measures imports it (examples put
``benchmarks/`` on ``sys.path``); none keeps a copy of any of this.

Two clocks, one sample loop each (:class:`Sampler`)::

    host_stages_us     per sample: before() untimed; drain the device; then
                       perf_counter_ns around each stage (plan, run, ...):
                       host enqueue time, never a completion wait
    device_us          per sample: before() untimed (restore state, plan); a
                       256 MiB write that evicts L2; event; fn(); event.
                       The flush is queued first, so the device is still busy
                       with it while the host enqueues the interval: no idle
                       gap falls inside the interval.

Every loop runs ``n_warmup`` untimed samples first, then ``n_samples``; results
are summarised by :func:`summarize` as p20 / p50 / p80 (median = p50). Without
CUDA the device loop falls back to wall-clock time of eager execution
(``clock == "cpu-wall"``), so every code path still runs; those numbers are not
GPU intervals.

Loops whose every iteration is a different step (the examples, the decode-loop
benchmark) cannot use a sample loop; :class:`StepEvents` records one CUDA event
pair around the part of each iteration it names (the replay), nothing else.

The floor (:func:`measure_floor`) is an empty Triton kernel captured in a CUDA
graph, timed by the same sampler as what it is the floor of.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import gc
import inspect
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import add_stamp_option, stamp_or_exit  # noqa: E402

__all__ = ["Sampler", "StepEvents", "summarize", "format_quantiles", "replayable",
           "empty_graph", "measure_floor", "count_launches", "graph_nodes",
           "copy_bandwidth_gbs", "pick_device", "pick_backend", "cpu_threads",
           "graphalloc_version", "machine_info", "progress", "say"]

QUANTILES = (20, 50, 80)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---- quantiles ---------------------------------------------------------------------------
def summarize(samples_us) -> dict | None:
    """p20 / p50 / p80 / mean / min / max / n of samples in microseconds (None for no
    samples). The only quantile summary in benchmarks/ and examples/ (median = p50)."""
    arr = np.asarray(list(samples_us), dtype=np.float64)
    if arr.size == 0:
        return None
    p20, p50, p80 = np.percentile(arr, QUANTILES)
    return {"p20": float(p20), "p50": float(p50), "p80": float(p80), "mean": float(arr.mean()),
            "min": float(arr.min()), "max": float(arr.max()), "n": int(arr.size)}


def format_quantiles(stats: dict | None, digits: int = 2) -> str:
    """``"p50 (p20-p80)"`` of a :func:`summarize` result; ``"-"`` for None."""
    if not stats:
        return "-"
    return f"{stats['p50']:.{digits}f} ({stats['p20']:.{digits}f}-{stats['p80']:.{digits}f})"


# ---- sample loops ------------------------------------------------------------------------
class Sampler:
    """Sample loops for one device. ``flush_mib`` MiB are written before every device sample
    (0: no flush, so an idle device's interval includes the enqueue of ``fn``).

    ``clock`` says what ``device_us`` measures: ``"cuda-events"`` (a GPU interval)
    or ``"cpu-wall"`` (no CUDA: wall time of eager execution, meaningless as GPU time).
    """

    def __init__(self, device: torch.device, *, n_samples: int = 100, n_warmup: int = 10,
                 flush_mib: int = 256):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.n_samples = n_samples
        self.n_warmup = n_warmup
        self.flush_mib = flush_mib
        self.clock = "cuda-events" if self.is_cuda else "cpu-wall"
        self._flush_buf = None
        if self.is_cuda and flush_mib > 0:
            n_words = flush_mib * 2**20 // 4
            self._flush_buf = torch.empty(n_words, dtype=torch.int32, device=self.device)

    def sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def flush(self) -> None:
        """Evict L2: one ``flush_mib`` MiB write (a single kernel), queued before the timed
        interval."""
        if self._flush_buf is not None:
            self._flush_buf.zero_()

    def release_memory(self) -> None:
        """Between measurements: collect garbage and hand cached device memory back."""
        gc.collect()
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def host_stages_us(self, stages, before=None) -> list[list[float]]:
        """Host time of each stage per sample; stage k gets stage k-1's return value
        (stage 0 gets ``before()``'s). Returns one list of samples per stage."""
        per_stage: list[list[float]] = [[] for _ in stages]
        for i in range(self.n_warmup + self.n_samples):
            value = before() if before is not None else None
            self.sync()  # start every sample with an empty queue (outside the interval)
            stamps = [time.perf_counter_ns()]
            for stage in stages:
                value = stage(value)
                stamps.append(time.perf_counter_ns())
            if i >= self.n_warmup:
                for k in range(len(stages)):
                    per_stage[k].append((stamps[k + 1] - stamps[k]) / 1e3)
        self.sync()
        return per_stage

    def host_us(self, fn) -> list[float]:
        """Host enqueue time of ``fn()`` per sample (no completion wait)."""
        return self.host_stages_us([lambda _: fn()])[0]

    def device_us(self, fn, before=None) -> list[float]:
        """Device interval of ``fn(before())`` (``fn()`` without ``before``) per sample."""
        return self.alternating({"fn": fn}, before)["fn"]

    def alternating(self, calls: dict, before=None) -> dict[str, list[float]]:
        """Device intervals of every ``calls[name](before())`` (``calls[name]()`` without
        ``before``), the names alternating within each sample round, the order reversed
        every other round, so drift and state affect them alike. Microseconds per name."""
        names = list(calls)
        samples: dict[str, list] = {name: [] for name in names}
        for i in range(self.n_warmup + self.n_samples):
            for name in (names if i % 2 == 0 else names[::-1]):
                fn = calls[name]
                value = before() if before is not None else None
                if self.is_cuda:
                    self.flush()  # queued first: the device is busy while we enqueue
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn(value) if before is not None else fn()
                    end.record()
                    if i >= self.n_warmup:
                        samples[name].append((start, end))
                else:
                    t0 = time.perf_counter_ns()
                    fn(value) if before is not None else fn()
                    t1 = time.perf_counter_ns()
                    if i >= self.n_warmup:
                        samples[name].append((t1 - t0) / 1e3)
        self.sync()
        if self.is_cuda:
            return {n: [s.elapsed_time(e) * 1e3 for s, e in v] for n, v in samples.items()}
        return samples


class StepEvents:
    """GPU intervals of one part of every iteration of a loop that cannot be sampled (each
    iteration is a different step).

    ``with events.interval(): alloc.run(p)`` records a CUDA event pair around that block
    only: keep host work (``plan()``, bookkeeping) outside it. ``us()`` reads every
    interval after the loop (one sync). Without CUDA it records nothing and ``us()`` is
    ``[]``. On an idle device an interval starts when the host reaches the block, so it
    includes the block's own enqueue (one graph launch), never host work before it.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._pairs: list = []

    @contextlib.contextmanager
    def interval(self):
        if not self.enabled:
            yield
            return
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._pairs.append((start, end))

    def us(self) -> list[float]:
        """Every interval in microseconds, in loop order (synchronises once)."""
        if not self._pairs:
            return []
        torch.cuda.synchronize()  # sync ok: after the loop
        return [start.elapsed_time(end) * 1e3 for start, end in self._pairs]


# ---- CUDA graphs and the floor -----------------------------------------------------------
def replayable(fn, is_cuda: bool):
    """``(call, graph)``: ``fn`` captured into a CUDA graph and its replay, or ``(fn, None)``
    without CUDA. ``fn`` runs once on a side stream first (compiles, warms allocators)."""
    if not is_cuda:
        return fn, None
    from graphalloc import capture_graph

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = capture_graph(fn)
    torch.cuda.synchronize()
    return graph.replay, graph


_EMPTY_KERNEL = []  # the floor's Triton kernel, defined on first use (see _empty_kernel)


def _empty_kernel():
    """An empty Triton kernel. Defined on first use, not at import: ``@triton.jit`` reads
    ``TRITON_INTERPRET`` when it runs, and scripts settle that in ``main()``."""
    if not _EMPTY_KERNEL:
        import triton

        @triton.jit
        def empty_kernel(x_ptr):
            pass

        _EMPTY_KERNEL.append(empty_kernel)
    return _EMPTY_KERNEL[0]


def empty_graph(device) -> tuple:
    """``(call, what, graph)``: the floor every benchmark reports. On CUDA an empty Triton
    kernel on one program (a one-element fill where Triton cannot launch), captured in a
    CUDA graph; ``call()`` replays it. Without CUDA the fill runs eagerly (``graph`` None)."""
    device = torch.device(device)
    is_cuda = device.type == "cuda"
    buf = torch.zeros(1, dtype=torch.int32, device=device)
    fn, what = buf.zero_, "one-element torch fill"
    if is_cuda:
        try:
            kernel = _empty_kernel()
            kernel[(1,)](buf)
            torch.cuda.synchronize(device)
            fn, what = (lambda: kernel[(1,)](buf)), "empty Triton kernel, grid (1,)"
        except Exception as exc:
            what += f" (the empty Triton kernel failed: {type(exc).__name__})"
    call, graph = replayable(fn, is_cuda)
    return call, what + (", in a CUDA graph" if graph is not None else ", eager (no CUDA)"), graph


def measure_floor(sampler: Sampler) -> dict:
    """The floor, timed by ``sampler``: device interval and host enqueue time of one replay
    of :func:`empty_graph`, and the graph's nodes."""
    call, what, graph = empty_graph(sampler.device)
    return {"kernel": what, "gpu_us": summarize(sampler.device_us(call)),
            "cpu_us": summarize(sampler.host_us(call)), "graph": graph_nodes(graph)}


# ---- launches, graph nodes, bandwidth ----------------------------------------------------
# Top-level aten ops that only make views (never a kernel launch).
_VIEW_OPS = {
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::expand",
    "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select", "aten::alias",
    "aten::detach", "aten::detach_", "aten::lift_fresh", "aten::t", "aten::permute",
    "aten::unflatten", "aten::flatten", "aten::empty", "aten::empty_strided", "aten::to",
    "aten::_to_copy", "aten::resolve_conj", "aten::resolve_neg", "aten::result_type",
}
_LAUNCH_APIS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                "cudaLaunchCooperativeKernel")
_GRAPH_LAUNCH_APIS = ("cudaGraphLaunch", "cuGraphLaunch")
_COPY_APIS = ("cudaMemcpyAsync", "cudaMemsetAsync", "cuMemcpyAsync", "cuMemsetD8Async",
              "cuMemsetD32Async")


def _is_device_event(event) -> bool:
    return str(getattr(event, "device_type", "")).upper().endswith("CUDA")


def count_launches(fn, is_cuda: bool) -> dict:
    """Launches of one ``fn()``, from ``torch.profiler``.

    ``kernels``: kernels the GPU executed (graph nodes included); ``launch_calls``:
    kernel-launch API calls on the host; ``graph_launches``: graph-launch calls;
    ``copies``: memcpy/memset API calls; ``aten_ops``: top-level aten ops that are not
    views (the only count available without CUDA).
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if is_cuda else [])
    if is_cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        fn()
        if is_cuda:
            torch.cuda.synchronize()
    counts = collections.Counter()
    for event in prof.events():
        name = event.name
        if _is_device_event(event):
            low = name.lower()
            counts["copies_device" if low.startswith(("memcpy", "memset")) else "kernels"] += 1
        elif name in _LAUNCH_APIS:
            counts["launch_calls"] += 1
        elif name in _GRAPH_LAUNCH_APIS:
            counts["graph_launches"] += 1
        elif name in _COPY_APIS:
            counts["copies"] += 1
        elif (name.startswith("aten::") and getattr(event, "cpu_parent", None) is None
              and name not in _VIEW_OPS):
            counts["aten_ops"] += 1
    out = {key: int(counts.get(key, 0)) for key in
           ("kernels", "launch_calls", "graph_launches", "copies", "aten_ops")}
    if not is_cuda:
        for key in ("kernels", "launch_calls", "graph_launches", "copies"):
            out[key] = None  # not observable without CUDA
    return out


def graph_nodes(graph) -> dict:
    """Node counts of a captured graph: ``graphalloc.describe_graph`` (cuda-python), else
    the driver API through ctypes. ``{"error": ...}`` when neither works."""
    if graph is None:
        return {"error": "no CUDA graph (CPU run)"}
    try:
        from graphalloc import describe_graph

        info = describe_graph(graph)
        info.pop("kernel_names", None)
        info["via"] = "describe_graph"
        return info
    except Exception as exc:  # cuda-python missing, or a torch without raw_cuda_graph
        first_error = f"describe_graph: {type(exc).__name__}: {exc}"
    try:
        return _graph_nodes_ctypes(graph)
    except Exception as exc:
        return {"error": f"{first_error}; driver API: {type(exc).__name__}: {exc}"}


# CUgraphNodeType values of the CUDA driver API.
_NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty",
               6: "waitevent", 7: "eventrecord", 8: "extsemassignal", 9: "extsemaswait",
               10: "memalloc", 11: "memfree", 12: "batchmemop", 13: "conditional"}


def _graph_nodes_ctypes(graph) -> dict:
    raw = graph.raw_cuda_graph()
    handle = ctypes.c_void_p(int(raw))
    lib = ctypes.CDLL("libcuda.so.1")
    n = ctypes.c_size_t(0)
    if lib.cuGraphGetNodes(handle, None, ctypes.byref(n)) != 0:
        raise RuntimeError("cuGraphGetNodes failed")
    nodes = (ctypes.c_void_p * n.value)()
    if lib.cuGraphGetNodes(handle, nodes, ctypes.byref(n)) != 0:
        raise RuntimeError("cuGraphGetNodes failed")
    counts = collections.Counter()
    for node in nodes[: n.value]:
        kind = ctypes.c_int(-1)
        if lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)) != 0:
            raise RuntimeError("cuGraphNodeGetType failed")
        counts[_NODE_TYPES.get(kind.value, f"type{kind.value}")] += 1
    out = dict(counts)
    out["total"] = int(n.value)
    out["via"] = "driver API (ctypes)"
    return out


def copy_bandwidth_gbs(sampler: Sampler, n_bytes: int) -> dict:
    """Device copy bandwidth: ``dst.copy_(src)`` of ``n_bytes``, counted as bytes read +
    bytes written over the interval. Returns the interval quantiles and GB/s at p50."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device=sampler.device)
    dst = torch.empty_like(src)
    src.fill_(1)
    stats = summarize(sampler.device_us(lambda: dst.copy_(src)))
    return {"bytes_moved": 2 * n_bytes, "interval_us": stats,
            "gb_per_s": 2 * n_bytes / (stats["p50"] * 1e3)}


# ---- the run's environment ---------------------------------------------------------------
def pick_device(requested: str = "auto") -> torch.device:
    """``"auto"``: the current CUDA device when there is one, else the CPU."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pick_backend(requested: str, device) -> tuple[str, str | None]:
    """``(backend, note)``; ``"auto"``: Triton on CUDA when its step kernels import, else
    the Torch reference twins (always on the CPU). ``note`` says why (None when asked).

    Triton on a CPU runs in its interpreter, which ``@triton.jit`` picks when it runs:
    for ``"triton"`` on a CPU this sets ``TRITON_INTERPRET=1`` (unless set), so call it
    before graphalloc's kernels are imported."""
    if requested == "triton" and torch.device(device).type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if requested != "auto":
        return requested, None
    if torch.device(device).type != "cuda":
        return "torch", "graphalloc backend: torch (CPU run; the Torch reference twins)"
    try:
        from graphalloc.kernels.allocate import allocate_tokens  # noqa: F401
        from graphalloc.kernels.release import release_pages  # noqa: F401
    except Exception as exc:
        return "torch", (f"graphalloc backend: torch, because the Triton step kernels did not "
                         f"import ({type(exc).__name__}: {exc})")
    return "triton", "graphalloc backend: triton"


@contextlib.contextmanager
def cpu_threads(device, n_threads: int = 1):
    """On a CPU device, run the block with ``n_threads`` intra-op threads (tiny tensors:
    more threads only contend and add noise), restored after; elsewhere a no-op."""
    if torch.device(device).type != "cpu":
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def bench_parser(doc: str, default_out: str, backend_help: str) -> argparse.ArgumentParser:
    """The options every benchmark shares: ``--quick``, ``--out``, ``--device``,
    ``--backend``; the benchmark adds its own."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes and sample counts (CPU CI)")
    p.add_argument("--out", default=default_out, help="output directory")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--backend", default="auto", choices=("auto", "triton", "torch"),
                   help=backend_help)
    add_stamp_option(p)
    return p


def bench_main(argv, parse_args, run) -> int:
    """A benchmark's entry point: parse, pick the device and backend (the backend first: it
    may set ``TRITON_INTERPRET``), then ``run(args, argv, device, backend, note)`` with one
    intra-op thread on a CPU. The output folder gets its ``stamp.json`` first
    (:mod:`provenance`: refused from uncommitted source into ``results/``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    device = pick_device(args.device)
    backend, note = pick_backend(args.backend, device)
    stamp_or_exit(args.out, inspect.getfile(run), argv,
                  allow_dirty=getattr(args, "allow_dirty", False), machine=machine_info(device))
    with cpu_threads(device):
        return run(args, argv, device, backend, note)


def progress(total: int, desc: str, enabled: bool = True, unit: str = "case"):
    """A tqdm bar on stderr over ``total`` units of a benchmark's work (host only: safe
    under sync debug), or None when disabled (``--no-progress``) or tqdm (the [bench]
    extra) is not installed."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)


def say(bar, message: str) -> None:
    """A progress line on stderr that does not break the bar (``bar`` may be None)."""
    if bar is None:
        print(message, file=sys.stderr, flush=True)
    else:
        bar.write(message, file=sys.stderr)


def graphalloc_version() -> str:
    """The installed package's version (``importlib.metadata``), ``"unknown"`` when
    graphalloc is not installed (a bare source tree on ``sys.path``)."""
    from importlib import metadata

    try:
        return metadata.version("graphalloc")
    except metadata.PackageNotFoundError:
        return "unknown"


def machine_info(device) -> dict:
    """What a result was measured on: Python, torch, numpy, Triton, CPU, GPU and driver,
    graphalloc's version and commit, and a one-line ``summary``."""
    device = torch.device(device)
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "numpy": np.__version__, "platform": platform.platform(), "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(), "cuda_runtime": getattr(torch.version, "cuda", None)}
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception as exc:
        info["triton"] = f"unavailable ({type(exc).__name__})"
    info["gpu"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=torch.cuda.get_device_name(device),
                    gpu_capability=f"{props.major}.{props.minor}",
                    gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    gpu_sms=props.multi_processor_count, driver=_driver_version())
    info["graphalloc"] = graphalloc_version()
    info["graphalloc_commit"] = _git_commit()
    info["summary"] = (f"{info['gpu'] or 'CPU ' + info['cpu']}, torch {info['torch']}, "
                       f"Triton {info['triton']}, graphalloc {info['graphalloc']} (commit "
                       f"{info['graphalloc_commit'] or 'unknown'})")
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _run_quiet(cmd, cwd=None):
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None
    except Exception:
        return None


def _driver_version():
    out = _run_quiet(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0] if out else None


def _git_commit():
    stamp = Path(REPO) / "COMMIT"  # an exported tree (git archive) names its commit here
    if stamp.is_file() and not (Path(REPO) / ".git").exists():
        return stamp.read_text().strip() + " (exported tree)"
    commit = _run_quiet(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO)
    if commit and _run_quiet(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO):
        commit += "-dirty"
    return commit


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run any benchmarks/bench_*.py "
            "instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
