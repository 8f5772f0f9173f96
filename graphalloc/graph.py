"""Graph runtime: capture a padded step once per descriptor buffer, replay it every step.

Lifecycle (states of a :class:`StepGraph`)::

    StepGraph(alloc)          warm-up on a side stream (compiles the kernels; all rows
                              padded, so nothing changes), then one capture per
                              descriptor buffer of ``alloc.ring``
    alloc.step(...)           plan() on the host writes buffer i, run() replays graph i
    ...                       graph i reads buffer i from pinned memory when it runs;
                              buffer i is rewritten only after the event recorded
                              behind that replay completed (DescriptorRing)

The host's only launch per step is one ``cudaGraphLaunch``. Without a GPU the
same object runs the step eagerly (identical results), so callers need no
branch.

Engines that capture their own model graph put the allocator inside it
instead: per descriptor buffer ``i`` capture ``alloc.launch(i)`` followed by the
model, and each step call ``p = alloc.plan(...)``, replay graph
``p.buffer_index``, then ``alloc.mark_submitted(p)`` (see ``examples/decode_loop.py``).

:func:`describe_graph` walks a captured graph through its raw handle with
cuda-python and returns its nodes by type, to prove its structure (kernel
nodes only: no memcpy, memset or host nodes).
"""

from __future__ import annotations

import collections

import torch

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


class StepGraph:
    """Replays ``alloc``'s steps from CUDA graphs, one per descriptor buffer.

    After construction every ``alloc.step(...)``, ``alloc.run(plan)`` and every
    single operation (``alloc_decode``, ``release``, ...) is executed as one
    graph replay. The graphs are fixed-shape: ``max_release_rows`` release
    programs and ``max_alloc_rows`` allocation programs; padded rows exit at
    once. On a CPU device nothing is captured and steps run eagerly.

    With an allocator built with ``fused_step=True`` each descriptor buffer gets
    two graphs: ``graphs[i]`` (release, then allocation: two kernel nodes) and
    ``fused_graphs[i]`` (one fused kernel node); a step replays the fused one
    only when its plan marked it fusable (``alloc.ring.fusable[i]``).

    ``replays`` counts graph launches, ``fused_replays`` those of fused graphs.
    """

    def __init__(self, alloc, *, warmup: int = 2):
        self.alloc = alloc
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.fused_graphs: list[torch.cuda.CUDAGraph] = []
        self.replays = 0
        self.fused_replays = 0
        fused = alloc.kernels.fused
        if alloc.config.device.type == "cuda":
            if alloc._pending is not None:
                raise RuntimeError("run() the planned step before building a StepGraph")
            torch.cuda.synchronize()  # sync ok: one-time construction
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for i in range(len(alloc.ring)):
                    alloc.ring.write(i, alloc.ring.np_bufs[i][:0], alloc.ring.np_bufs[i][:0])
                for _ in range(warmup):
                    alloc.launch(0)
                    if fused:
                        alloc.launch(0, fusable=True)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()  # sync ok: one-time construction
            for i in range(len(alloc.ring)):
                self.graphs.append(capture_graph(lambda i=i: alloc.launch(i)))
                if fused:
                    self.fused_graphs.append(
                        capture_graph(lambda i=i: alloc.launch(i, fusable=True)))
            torch.cuda.synchronize()  # sync ok: one-time construction
        alloc.step_runner = self._run

    def _run(self, buffer_index: int) -> None:
        fusable = self.alloc.ring.fusable[buffer_index]
        if self.graphs:
            if fusable and self.fused_graphs:
                self.fused_graphs[buffer_index].replay()
                self.fused_replays += 1
            else:
                self.graphs[buffer_index].replay()
            self.replays += 1
        else:
            self.alloc.launch(buffer_index, fusable=fusable)

    def close(self) -> None:
        """Detach from the allocator (steps run eagerly again)."""
        if self.alloc.step_runner == self._run:
            self.alloc.step_runner = None

    def describe(self, fused: bool = False) -> dict:
        """:func:`describe_graph` of the first captured graph (of the fused ones with
        ``fused=True``)."""
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
