"""Graph runtime: capture a padded step once per descriptor buffer, replay it every step.

Lifecycle of the :class:`StepGraph` executor (``HybridAllocator(cfg, executor="graph")``)::

    constructor of the allocator  bind(): warm-up on a side stream (compiles every kernel
                                  variant a step can use; all rows padded, so nothing
                                  changes), then one capture per descriptor buffer of
                                  ``alloc.ring`` (two per buffer with ``fused_step``)
    alloc.step(...)               plan() on the host writes buffer i, run() replays graph i
    ...                           graph i reads buffer i from pinned memory when it runs;
                                  buffer i is rewritten only after the event recorded
                                  behind that replay completed (DescriptorRing)

The host's only launch per step is one ``cudaGraphLaunch``. Without a GPU the
same executor runs the step eagerly (identical results), so callers need no
branch.

Engines that capture their own model graph put the allocator inside it
instead (with the default eager executor): per descriptor buffer ``i`` capture
``alloc.launch(i)`` followed by the model, and each step call
``p = alloc.plan(...)``, replay graph ``p.buffer_index``, then
``alloc.mark_submitted(p)`` (see ``examples/decode_loop.py``).

:func:`describe_graph` walks a captured graph through its raw handle with
cuda-python and returns its nodes by type, to prove its structure (kernel
nodes only: no memcpy, memset or host nodes).
"""

from __future__ import annotations

import collections

import torch

from .errors import ConfigError
from .executor import Executor, warm_up
from .sync_points import sync_allowed

__all__ = ["StepGraph", "describe_graph", "capture_graph"]


def capture_graph(fn, *, pool=None, stream=None) -> torch.cuda.CUDAGraph:
    """Capture ``fn()`` into a CUDA graph, keeping the raw graph for :func:`describe_graph`
    where this torch supports it."""
    try:
        graph = torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:  # torch without keep_graph
        graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        fn()
    if hasattr(graph, "instantiate"):
        try:
            graph.instantiate()
        except RuntimeError:
            pass  # already instantiated at capture end (keep_graph=False)
    return graph


class StepGraph(Executor):
    """Executor that replays each step from a CUDA graph, one per descriptor buffer.

    Built by ``HybridAllocator(cfg, executor="graph")`` (or pass ``StepGraph(warmup=...)``);
    afterwards every step the allocator runs -- ``step()``, ``run()``, every single
    operation -- is one graph replay. The graphs are fixed-shape: ``max_release_rows``
    release programs and ``max_alloc_rows`` allocation programs; padded rows exit at
    once. On a CPU device nothing is captured and steps run eagerly.

    With an allocator built with ``fused_step=True`` each descriptor buffer gets two
    graphs: ``graphs[i]`` (release, then allocation: two kernel nodes) and
    ``fused_graphs[i]`` (one fused kernel node); a step replays the fused one only when
    its plan marked it fusable.

    ``replays`` counts graph launches, ``fused_replays`` those of fused graphs. Capture
    synchronises (once, at construction).
    """

    name = "graph"

    def __init__(self, alloc=None, *, warmup: int = 2):
        if alloc is not None:
            raise ConfigError("StepGraph is an executor chosen when the allocator is built: "
                              "HybridAllocator(cfg, executor='graph') (or "
                              "executor=StepGraph(warmup=...)); it is not attached afterwards")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ConfigError(f"warmup must be an int >= 1, got {warmup!r}")
        super().__init__()
        self.warmup = warmup
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.fused_graphs: list[torch.cuda.CUDAGraph] = []
        self.replays = 0
        self.fused_replays = 0

    def bind(self, alloc) -> None:
        super().bind(alloc)
        if alloc.config.device.type != "cuda":
            return
        fused = alloc.kernels.fused
        ring = alloc.ring
        warm_up(alloc, self.warmup)
        with sync_allowed():
            for i in range(len(ring)):
                rel, al = ring.release_rows(i), ring.alloc_rows(i)
                self.graphs.append(capture_graph(lambda rel=rel, al=al: alloc.kernels(rel, al)))
                if fused:
                    self.fused_graphs.append(capture_graph(
                        lambda rel=rel, al=al: alloc.kernels(rel, al, fusable=True)))
            torch.cuda.synchronize()  # sync ok: one-time construction

    def execute(self, planned) -> None:
        index = planned.buffer_index
        fused = planned.fusable and bool(self.fused_graphs)
        if self.graphs:
            (self.fused_graphs if fused else self.graphs)[index].replay()
            self.replays += 1
            self.fused_replays += fused
            self.count(fused)
        else:
            self.alloc.launch(index, fusable=planned.fusable)
            self.count(planned.fusable and self.alloc.kernels.fused)

    def describe(self, fused: bool = False) -> dict:
        """:func:`describe_graph` of the first captured graph (of the fused ones with
        ``fused=True``); ``{}`` on a CPU device."""
        graphs = self.fused_graphs if fused else self.graphs
        if not graphs:
            return {}
        return describe_graph(graphs[0])


def _cudart():
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:  # older cuda-python
        from cuda import cudart
    return cudart


def _check(result):
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA runtime call failed: {err}")
    return rest[0] if len(rest) == 1 else rest


def describe_graph(graph: torch.cuda.CUDAGraph) -> dict:
    """Nodes of a captured graph by type, e.g. ``{"kernel": 2}``, plus ``"kernel_names"``.

    Needs a graph captured with ``keep_graph=True`` (as :func:`capture_graph` does
    where torch supports it) and cuda-python.
    """
    cudart = _cudart()
    raw = graph.raw_cuda_graph()
    handle = cudart.cudaGraph_t(init_value=int(raw)) if isinstance(raw, int) else raw
    _, n_nodes = _check(cudart.cudaGraphGetNodes(handle, 0))
    nodes, _ = _check(cudart.cudaGraphGetNodes(handle, n_nodes))
    counts: collections.Counter = collections.Counter()
    names: list[str] = []
    for node in nodes[:n_nodes]:
        node_type = _check(cudart.cudaGraphNodeGetType(node))
        name = getattr(node_type, "name", str(node_type))
        short = name.replace("cudaGraphNodeType", "").lower()
        counts[short] += 1
        if short == "kernel":
            names.append(_kernel_name(node))
    out = dict(counts)
    out["kernel_names"] = names
    out["total"] = n_nodes
    return out


def _kernel_name(node) -> str:
    try:
        from cuda.bindings import driver
        params = _check(driver.cuGraphKernelNodeGetParams(driver.CUgraphNode(int(node))))
        name = _check(driver.cuFuncGetName(params.func))
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception as exc:  # names are informative only
        return f"<unnamed: {type(exc).__name__}>"
