"""Timing primitives: quantiles, host (CPU) time, device intervals, launch counts.

Two clocks, one sample loop each::

    host_stages_us     per sample: before() untimed; drain the device; then
                       perf_counter_ns around each stage (plan, run, ...):
                       host enqueue time, never a completion wait
    device_us          per sample: before() untimed (restore state, plan); a
                       256 MiB write that evicts L2; event; fn(); event.
                       The flush is queued first, so the device is still busy
                       with it while the host enqueues the interval: no idle
                       gap falls inside the interval.

Every loop runs ``n_warmup`` untimed samples first, then ``n_samples``; results
are summarised as p20 / p50 / p80 (median = p50). Without CUDA the device loop
falls back to wall-clock time of eager execution (``clock == "cpu-wall"``), so
every code path still runs; those numbers are not GPU intervals.
"""

from __future__ import annotations

import collections
import ctypes
import time

import numpy as np
import torch

__all__ = ["Sampler", "summarize", "replayable", "count_launches", "graph_nodes",
           "copy_bandwidth_gbs"]

QUANTILES = (20, 50, 80)

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


def summarize(samples_us) -> dict:
    """p20 / p50 / p80 / mean / min of samples in microseconds (None for no samples)."""
    arr = np.asarray(list(samples_us), dtype=np.float64)
    if arr.size == 0:
        return None
    p20, p50, p80 = np.percentile(arr, QUANTILES)
    return {"p20": float(p20), "p50": float(p50), "p80": float(p80), "mean": float(arr.mean()),
            "min": float(arr.min()), "n": int(arr.size)}


class Sampler:
    """Sample loops for one device. ``flush_mib`` MiB are written before every device sample.

    ``clock`` says what ``device_us`` measures: ``"cuda-events"`` (a GPU interval)
    or ``"cpu-wall"`` (no CUDA: wall time of eager execution, meaningless as GPU time).
    """

    def __init__(self, device: torch.device, *, n_samples: int = 100, n_warmup: int = 10,
                 flush_mib: int = 256):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.n_samples = n_samples
        self.n_warmup = n_warmup
        self.flush_mib = flush_mib
        self.clock = "cuda-events" if self.is_cuda else "cpu-wall"
        self._flush_buf = None
        if self.is_cuda:
            n_words = flush_mib * 2**20 // 4
            self._flush_buf = torch.empty(n_words, dtype=torch.int32, device=device)

    def sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def flush(self) -> None:
        """Evict L2: one 256 MiB write (a single kernel), queued before the timed interval."""
        if self._flush_buf is not None:
            self._flush_buf.zero_()

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
        pairs = []
        wall = []
        for i in range(self.n_warmup + self.n_samples):
            value = before() if before is not None else None
            if self.is_cuda:
                self.flush()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn(value) if before is not None else fn()
                end.record()
                if i >= self.n_warmup:
                    pairs.append((start, end))
            else:
                t0 = time.perf_counter_ns()
                fn(value) if before is not None else fn()
                t1 = time.perf_counter_ns()
                if i >= self.n_warmup:
                    wall.append((t1 - t0) / 1e3)
        self.sync()
        return [s.elapsed_time(e) * 1e3 for s, e in pairs] if self.is_cuda else wall


def replayable(fn, is_cuda: bool):
    """``(call, graph)``: ``fn`` captured into a CUDA graph and its replay, or ``(fn, None)``
    without CUDA. ``fn`` runs once on a side stream first (compiles, warms allocators)."""
    if not is_cuda:
        return fn, None
    from graphalloc.graph import capture_graph
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = capture_graph(fn)
    torch.cuda.synchronize()
    return graph.replay, graph


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
        from graphalloc.graph import describe_graph
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
