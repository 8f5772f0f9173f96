"""Graph runtime: capture a padded step once per descriptor buffer, replay it every step.

Lifecycle of the :class:`StepGraph` executor (``HybridAllocator(cfg, executor="graph")``)::

    constructor of the allocator  bind(): warm-up on a side stream (compiles every kernel
                                  variant a step can use; all rows padded, so nothing
                                  changes), then, per descriptor buffer of ``alloc.ring``,
                                  one capture per row bucket (``GridPolicy.shapes()``;
                                  twice with ``fused_step``: both launch forms)
    alloc.step(...)               plan() on the host writes buffer i, run() replays the
                                  graph of buffer i for the smallest bucket that covers
                                  the step's rows (none for a step with no rows)
    ...                           the graph's first kernel copies the step's rows of buffer
                                  i from pinned memory into its device mirror and the
                                  step's kernels read the mirror (kernels.stage); buffer i
                                  is rewritten only after the event recorded behind that
                                  replay completed (DescriptorRing)

The host's only launch per step is one ``cudaGraphLaunch``. A replay launches programs
for the step's row bucket, not for the frozen maximum: rows are packed at the front of
each table and the rows past the step's are padding, so every bucket that covers the
step leaves the same state (:mod:`graphalloc.device.buckets`). Without a GPU the same executor
runs the step eagerly over exactly its rows (identical results), so callers need no
branch.

Engines that capture their own model graph put the allocator inside it
instead (with the default eager executor): per descriptor buffer ``i`` capture
``alloc.launch(i)`` followed by the model, and each step call
``p = alloc.plan(...)``, replay graph ``p.buffer_index``, then
``alloc.mark_submitted(p)`` (see ``examples/model_loops/decode_loop.py``). An engine that
captures one graph per batch size sizes the allocator's part to it with
``alloc.launch(i, n_rows=(R, A))`` and replays it only for steps with
``p.fits_rows(R, A)``.

:func:`describe_graph` walks a captured graph through its raw handle with
cuda-python and returns its nodes by type, to prove its structure (kernel
nodes only: no memcpy, memset or host nodes).
"""

from __future__ import annotations

import collections
import gc
import inspect
import types
import warnings

import torch

from ..diagnostics.sync_points import sync_allowed
from ..errors import CaptureError, ConfigError, ContractError
from ..parts import DeviceParts
from .buckets import LONG_EXTRA_TOKENS, GridPolicy, StepGrid
from .executor import Executor, lanes_of, launch_exact, states_of, warm_up

__all__ = ["StepGraph", "describe_graph", "capture_graph"]


def _graph_options() -> dict:
    """``torch.cuda.graph`` options this torch supports: thread-local capture errors (another
    thread's CUDA calls cannot invalidate our capture)."""
    try:
        params = inspect.signature(torch.cuda.graph.__init__).parameters
    except (TypeError, ValueError):
        return {}
    return {"capture_error_mode": "thread_local"} if "capture_error_mode" in params else {}


_GRAPH_OPTIONS = _graph_options()  # decided once, for this torch


def capture_graph(fn, *, pool=None, stream=None, keep_graph: bool = True,
                  collect: bool = True) -> torch.cuda.CUDAGraph:
    """Capture ``fn()`` into a CUDA graph, keeping the raw graph for :func:`describe_graph`
    (``keep_graph``) where this torch supports it.

    The capture is kept apart from the rest of the process: garbage is collected first
    (``collect=False``: the caller did, once before a series of captures) and the collector
    is paused while the stream captures (a dropped allocator's finaliser --
    pinned buffers, events -- then never runs mid-capture, so no free or event query lands
    inside it), capture errors are thread-local where torch supports it, and the capture
    runs on torch's side stream unless ``stream`` is given. A capture that fails raises
    :class:`~graphalloc.errors.CaptureError` (the cause chained) with the stream out of
    capture mode and nothing kept; the process stays usable."""
    try:
        graph = None
        if keep_graph:
            try:
                graph = torch.cuda.CUDAGraph(keep_graph=True)
            except TypeError:  # torch without keep_graph
                pass
        if graph is None:
            graph = torch.cuda.CUDAGraph()
    except Exception as exc:
        raise CaptureError(f"could not create a CUDA graph: {type(exc).__name__}: {exc}"
                           ) from exc
    if collect:
        gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream, **_GRAPH_OPTIONS):
            fn()
    except Exception as exc:
        raise CaptureError(
            f"CUDA graph capture failed: {type(exc).__name__}: {exc}. Nothing was kept and "
            "the stream left capture mode. Common causes: a host/device synchronisation or "
            "a CPU tensor read inside the captured function, another thread using CUDA in "
            "global capture mode, or an earlier CUDA error") from exc
    finally:
        if collecting:
            gc.enable()
    if hasattr(graph, "instantiate"):
        try:
            graph.instantiate()
        except RuntimeError:
            pass  # already instantiated at capture end (keep_graph=False)
    return graph


class StepGraph(Executor):
    """Executor that replays each step from a CUDA graph, one per descriptor buffer and
    row bucket.

    Built by ``HybridAllocator(cfg, executor="graph")`` (or pass ``StepGraph(...)``);
    afterwards every step the allocator runs -- ``step()``, ``run()``, every single
    operation -- is one graph replay. Each graph is fixed-shape: the release and
    allocation programs of one :class:`~graphalloc.device.buckets.StepGrid` of the allocator's
    :class:`~graphalloc.device.buckets.GridPolicy` (row buckets ``0, 1, g, g^2, ..., max`` per
    table, ``g = growth``; a step with a long allocation row gets the bucket's chunked
    form). A step replays the smallest bucket that covers its rows; padded rows in it
    exit at once; a step with no rows replays nothing (``empty_steps``), or, with state
    slots, the buffer's state kernels alone when it has state rows. Every graph of an
    allocator with state slots runs the state kernels (fixed programs looping to the
    section's counts: an empty section costs a header load). With
    ``buckets=False`` there is one graph per buffer, the frozen maximum, replayed for
    every step (the full grid). On a CPU device nothing is captured and steps run eagerly
    over exactly their rows.

    With an allocator built with ``fused_step=True`` each bucket has two graphs: release,
    then allocation (two kernel nodes, or one where a table has no rows) and the fused
    kernel (one node); a step replays the fused one only when its plan marked it fusable.
    ``graphs[i]`` / ``fused_graphs[i]`` are buffer i's full-grid graphs of each form.

    Args:
        warmup: warm-up launches before capture (an int >= 1).
        buckets: capture row buckets (default) or the full grid only.
        growth: ratio between row buckets (an int >= 2).
        staged: each graph first copies the step's rows into the buffer's device mirror and
            its kernels read the mirror (default; :mod:`graphalloc.kernels.stage`); False:
            every kernel reads the pinned buffer (the earlier form, kept for comparison).
        long_programs: programs a long allocation row (a prefill) is spread over
            (:class:`~graphalloc.device.buckets.GridPolicy`).

    ``replays`` counts graph launches, ``fused_replays`` those of fused graphs,
    ``empty_steps`` the steps that had nothing to replay. Capture synchronises (once,
    at construction); it costs about one capture per bucket, form and buffer
    (``n_graphs``). Captures go through :func:`capture_graph` (garbage collected once
    before them, the collector paused during each, thread-local capture errors); a capture
    that fails raises :class:`~graphalloc.errors.CaptureError` and no allocator is built.
    On a CPU device a ``UserWarning`` (once per process) names the eager fallback.

    Cost per step (host): the bucket choice (list lookups) and one graph launch.
    """

    name = "graph"

    def __init__(self, *attached, warmup: int = 2, buckets: bool = True, growth: int = 4,
                 staged: bool = True, long_programs: int = 64):
        if attached:  # the old form StepGraph(alloc): refused, the executor is chosen at build
            raise ConfigError("StepGraph is an executor chosen when the allocator is built: "
                              "HybridAllocator(cfg, executor='graph') (or "
                              "executor=StepGraph(warmup=...)); it is not attached afterwards")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ConfigError(f"warmup must be an int >= 1, got {warmup!r}")
        if not isinstance(buckets, bool):
            raise ConfigError(f"buckets must be a bool, got {buckets!r}")
        if isinstance(growth, bool) or not isinstance(growth, int) or growth < 2:
            raise ConfigError(f"growth must be an int >= 2, got {growth!r}")
        if not isinstance(staged, bool):
            raise ConfigError(f"staged must be a bool, got {staged!r}")
        super().__init__()
        self.staged = staged
        self.long_programs = long_programs
        self.warmup = warmup
        self.buckets = buckets
        self.growth = growth
        self.policy: GridPolicy | None = None
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.fused_graphs: list[torch.cuda.CUDAGraph] = []
        # The hot path's lookup (see _index); None on a CPU device.
        self._table: list | None = None
        self._release_slot: list[int] = []
        self._alloc_slot: list[int] = []
        self._all: list[torch.cuda.CUDAGraph] = []  # every captured graph (kept alive)
        self._states_only: list = []  # per buffer: its state kernels alone (state slots)
        self._choose = None
        self._fused = False
        self.replays = 0
        self.fused_replays = 0
        self.empty_steps = 0

    @property
    def n_graphs(self) -> int:
        """Captured graphs, all buckets, forms and buffers (0 on a CPU device)."""
        return len(self._all)

    def bind(self, parts: DeviceParts) -> None:
        super().bind(parts)
        cfg = parts.config
        self.policy = GridPolicy(cfg, growth=self.growth if self.buckets else None,
                                 long_programs=self.long_programs)
        self._fused = parts.kernels.fused
        if self.buckets:
            self._choose = self.policy.bucket
        else:
            full = self.policy.full()
            self._choose = lambda n_rel, n_al, n_tokens: full
        if cfg.device.type != "cuda":
            _warn_cpu_fallback()
            return
        ring, kernels = parts.ring, parts.kernels
        shapes = self.policy.shapes() if self.buckets else [self.policy.full()]
        full = self.policy.full()
        warm_up(parts, self.warmup)
        gc.collect()  # once: dropped allocators are finalised now, never mid-capture
        pool = None
        replays: list[tuple[dict, dict]] = []
        with sync_allowed():
            for i in range(len(ring)):
                rel, al, lanes = ring.release_rows(i), ring.alloc_rows(i), lanes_of(parts, i)
                states = states_of(parts, i)
                forms: tuple[dict, dict] = ({}, {})
                for fused in ((False, True) if self._fused else (False,)):
                    for grid in shapes:
                        graph = capture_graph(
                            lambda rel=rel, al=al, grid=grid, fused=fused, lanes=lanes,
                            states=states: kernels(rel, al, fusable=fused, grid=grid,
                                                   lane_rows=lanes, state_rows=states,
                                                   staged=self.staged),
                            pool=pool, keep_graph=grid == full, collect=False)
                        pool = graph.pool() if pool is None else pool
                        self._all.append(graph)
                        forms[fused][grid] = _bare_replay(graph)
                        if grid == full:
                            (self.fused_graphs if fused else self.graphs).append(graph)
                replays.append(forms if self._fused else (forms[0], forms[0]))
                if states is not None:  # a step of state rows only (a take, a commit)
                    graph = capture_graph(lambda states=states: kernels.launch_states(
                        states, None), pool=pool, keep_graph=False, collect=False)
                    self._all.append(graph)
                    self._states_only.append(_bare_replay(graph))
            torch.cuda.synchronize()  # sync ok: one-time construction
        self._index(replays)

    def _index(self, replays: list[tuple[dict, dict]]) -> None:
        """Build the hot path's lookup from ``replays[buffer][fused]`` = ``{StepGrid:
        replay}``: ``_table[buffer][fused][release slot][alloc slot][long]`` (slots: the
        bucket's index in each ladder, from ``_release_slot[n]`` / ``_alloc_slot[n]``), so
        a step costs list indexing, not a StepGrid; None where a step has no rows."""
        pol = self.policy
        if not self.buckets:  # one slot per table: the full grid, whatever the step
            full = pol.full()
            self._release_slot = [0] * (pol.max_release_rows + 1)
            self._alloc_slot = [0] * (pol.max_alloc_rows + 1)
            self._table = [[[[[f[full]] * 2]] for f in forms] for forms in replays]
            return
        rel_sizes, al_sizes = pol.release_sizes, pol.alloc_sizes
        self._release_slot = [rel_sizes.index(pol.bucket(n, 0).n_release_rows)
                              for n in range(pol.max_release_rows + 1)]
        self._alloc_slot = [al_sizes.index(pol.bucket(0, n).n_alloc_rows)
                            for n in range(pol.max_alloc_rows + 1)]

        def entry(found: dict, n_rel: int, n_al: int, long: bool):
            if not (n_rel or n_al):
                return None
            chunks = pol.long_chunks(n_al) if long else 1
            return found[StepGrid(n_rel, 1, n_al, chunks)]
        self._table = [[[[[entry(f, r, a, long) for long in (False, True)] for a in al_sizes]
                         for r in rel_sizes] for f in forms] for forms in replays]

    def _lookup(self, buffer_index: int, fused: bool, n_release_rows: int, n_alloc_rows: int,
                n_tokens: int):
        """The replay for a step of these counts (None: the step has no rows)."""
        return self._table[buffer_index][fused][self._release_slot[n_release_rows]][
            self._alloc_slot[n_alloc_rows]][n_tokens >= n_alloc_rows + LONG_EXTRA_TOKENS]

    def grid_for(self, planned) -> StepGrid:
        """The grid a replay of ``planned`` launches (its bucket; the full grid with
        ``buckets=False``). O(1)."""
        return self._choose(planned.n_release_rows, planned.n_alloc_rows, planned.n_tokens)

    def execute(self, planned) -> None:
        fused = planned.fusable and self._fused
        if self._table is None:  # a CPU device: eager, over exactly the step's rows
            self.count(launch_exact(self.parts, planned))
            return
        replay = self._lookup(planned.buffer_index, fused, planned.n_release_rows,
                              planned.n_alloc_rows, planned.n_tokens)
        if replay is None:
            if planned.state_counts is None:
                self.empty_steps += 1
            else:  # state rows only: the buffer's state kernels
                self._states_only[planned.buffer_index]()
                self.replays += 1
        else:
            replay()
            self.replays += 1
            self.fused_replays += fused
        if fused:
            self.n_fused += 1
        else:
            self.n_two_launch += 1

    def describe(self, fused: bool = False) -> dict:
        """:func:`describe_graph` of the first full-grid graph (of the fused ones with
        ``fused=True``); ``{}`` on a CPU device."""
        graphs = self.fused_graphs if fused else self.graphs
        if not graphs:
            return {}
        return describe_graph(graphs[0])


_warned_cpu = False  # the CPU fallback is announced once per process


def _warn_cpu_fallback() -> None:
    global _warned_cpu
    if _warned_cpu:
        return
    _warned_cpu = True
    warnings.warn("executor='graph' on a CPU device captures nothing: every step runs "
                  "eagerly over exactly its rows (the eager fallback, same results). Use "
                  "executor='eager' on a CPU to say so, or a CUDA device to replay graphs "
                  "(announced once per process)", UserWarning, stacklevel=4)


def _bare_replay(graph: torch.cuda.CUDAGraph):
    """``graph.replay`` without the Python wrapper's frame (it only checks an input-liveness
    tracker, which capture_graph never enables): the C++ replay bound to the graph."""
    base = getattr(torch._C, "_CUDAGraph", None)  # noqa: SLF001 (torch)
    replay = getattr(base, "replay", None)
    if replay is not None and isinstance(graph, base) and getattr(graph, "_tracker",
                                                                   None) is None:
        return types.MethodType(replay, graph)
    return graph.replay


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
    where torch supports it) and cuda-python: anything else raises ``ContractError``
    (not a graph, no raw graph kept) or ``ConfigError`` (no cuda-python).
    """
    if not isinstance(graph, torch.cuda.CUDAGraph):
        raise ContractError(f"describe_graph takes a torch.cuda.CUDAGraph (capture_graph "
                            f"returns one), got {type(graph).__name__}")
    try:
        cudart = _cudart()
    except ImportError:
        raise ConfigError("describe_graph needs cuda-python (pip install cuda-python) to walk "
                          "the graph's nodes") from None
    try:
        raw = graph.raw_cuda_graph()
    except (RuntimeError, AttributeError) as exc:
        raise ContractError(f"describe_graph: this graph kept no raw CUDA graph ({exc}); "
                            "capture it with capture_graph(fn, keep_graph=True)") from None
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
