"""How a planned step reaches the device: the executor strategy an allocator is built with.

The allocator plans on the host and hands each planned step to its executor; the
executor enqueues the device work that reads the step's descriptor buffer. The
strategy is chosen once, at construction (``HybridAllocator(cfg, executor=...)``), and
never replaced: layers stack (a graph executor holds captured graphs of the allocator's
own launch; a replica layer builds its allocator with its own executor), so the order
of construction is the only order.

================  ===================================================================
executor          what ``execute(planned)`` does
================  ===================================================================
``"eager"``       :class:`EagerExecutor`: launches the step kernels (one fused launch,
                  or release then allocation) over exactly the step's rows
``"graph"``       :class:`graphalloc.device.graph.StepGraph`: replays the graph captured for
                  the step's descriptor buffer and row bucket (eager on a CPU device)
replicas          ``graphalloc.replicas``: broadcast a planner's step, or replay one
================  ===================================================================

The protocol (for writing another strategy; :class:`~graphalloc.parts.ExecutorPart`):
``bind(parts)`` is called once by the allocator's constructor with its
:class:`~graphalloc.parts.DeviceParts` (``config``, ``ring``, ``kernels``, ``state``,
``ledger``, ``tables``: never the allocator), after its device tables and descriptor ring
exist; the executor reads them as ``self.parts``;
``execute(planned)`` must enqueue the step and return without synchronising;
``plans_locally = False`` makes the allocator refuse ``plan()`` before anything changes
(a broadcast follower replays steps planned elsewhere); ``stamps_steps`` says whether
``execute`` runs the step kernels over the allocator's own descriptor buffer (then they
count the step's stamp on the device and ``check()`` expects it: launching through
``parts.kernels`` / ``alloc.launch`` / :func:`launch_exact` does; an executor that runs
the step from other memory sets it False). ``n_fused`` / ``n_two_launch`` count executed
steps of each launch form.
"""

from __future__ import annotations

from ..deprecations import warn_renamed
from ..errors import ConfigError
from ..parts import DeviceParts

__all__ = ["Executor", "EagerExecutor", "make_executor", "warm_up", "launch_exact", "lanes_of",
           "states_of"]


class Executor:
    """Base class of the executor strategies (see the module docstring)."""

    name = "executor"
    plans_locally = True
    stamps_steps = True  # execute() launches over the ring's buffers: stamps are counted

    def __init__(self) -> None:
        self.parts = None  # the DeviceParts served, from bind()
        self.n_fused = 0
        self.n_two_launch = 0

    @property
    def alloc(self):
        """Deprecated name of :attr:`parts` (warns): an executor is bound to the allocator's
        :class:`~graphalloc.parts.DeviceParts`, not to the allocator."""
        warn_renamed("Executor.alloc is deprecated: read Executor.parts (the allocator's "
                     "DeviceParts: config, ring, kernels, state, ledger, tables)")
        return self.parts

    def bind(self, parts: DeviceParts) -> None:
        """Attach to an allocator's :class:`~graphalloc.parts.DeviceParts` (once, from its
        constructor)."""
        if self.parts is not None:
            raise ConfigError(f"this {type(self).__name__} already serves another allocator; "
                              "build one executor per allocator")
        self.parts = parts

    def execute(self, planned) -> None:
        """Enqueue the device work of ``planned`` (never synchronises)."""
        raise NotImplementedError

    def count(self, fused: bool) -> None:
        if fused:
            self.n_fused += 1
        else:
            self.n_two_launch += 1


def warm_up(parts: DeviceParts, n: int = 1) -> None:
    """Compile every kernel variant a step can use, now: launch the step kernels over an
    all-padding descriptor (nothing changes) in both launch forms. On a CUDA device this is
    done at construction, so no Triton compilation ever happens mid-serving (a first
    compile costs a step seconds). Synchronises (once, at construction)."""
    import torch

    from ..diagnostics.sync_points import sync_allowed

    ring, kernels = parts.ring, parts.kernels
    with sync_allowed():
        torch.cuda.synchronize()  # sync ok: one-time construction
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(len(ring)):
                ring.write(i, ring.np_bufs[i][:0], ring.np_bufs[i][:0])
            lanes, states = lanes_of(parts, 0), states_of(parts, 0)
            for _ in range(n):
                for staged in (False, True):  # (a graph's launches are staged)
                    kernels(ring.release_rows(0), ring.alloc_rows(0), lane_rows=lanes,
                            state_rows=states, staged=staged)
                    if kernels.fused:
                        kernels(ring.release_rows(0), ring.alloc_rows(0), fusable=True,
                                lane_rows=lanes, state_rows=states, staged=staged)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()  # sync ok: one-time construction


def launch_exact(parts: DeviceParts, planned) -> bool:
    """Launch ``planned``'s kernels over exactly its rows (``StepKernels.grids.exact``: no
    program for a padded row, a long allocation row shared by several programs); a step
    with no rows launches nothing. Returns whether it was one fused launch."""
    kernels, ring, index = parts.kernels, parts.ring, planned.buffer_index
    fused = planned.fusable and kernels.fused
    grid = kernels.grids.exact(planned.n_release_rows, planned.n_alloc_rows, planned.n_tokens)
    counts = planned.state_counts
    if grid.n_release_rows or grid.n_alloc_rows:
        kernels(ring.release_rows(index), ring.alloc_rows(index), fusable=planned.fusable,
                grid=grid, lane_rows=lanes_of(parts, index),
                state_rows=states_of(parts, index) if counts else None, state_counts=counts)
    elif counts:  # state rows only (a snapshot taken, a commit): the state kernels
        kernels.launch_states(ring.state_rows(index), counts)
    return fused


def lanes_of(parts: DeviceParts, index: int):
    """Buffer ``index``'s lane rows when the allocator writes page tables, else None."""
    return parts.ring.lane_rows(index) if parts.kernels.tables is not None else None


def states_of(parts: DeviceParts, index: int):
    """Buffer ``index``'s recurrent-state section when the allocator has state slots, else
    None."""
    return parts.ring.state_rows(index) if parts.config.num_state_slots else None


class EagerExecutor(Executor):
    """Launch the step kernels directly: one fused launch where the step allows it
    (``PlannedStep.fusable`` and an allocator built with ``fused_step=True``), otherwise
    the release kernel then the allocation kernel, each over exactly the step's rows
    (:func:`launch_exact`). Host cost: one or two kernel launches (none for a step with
    no rows). On a CUDA device every kernel variant is compiled at construction
    (:func:`warm_up`)."""

    name = "eager"

    def bind(self, parts: DeviceParts) -> None:
        super().bind(parts)
        if parts.config.device.type == "cuda":
            warm_up(parts)

    def execute(self, planned) -> None:
        self.count(launch_exact(self.parts, planned))


def make_executor(executor) -> Executor:
    """An executor from its name (``"eager"``, ``"graph"``) or an :class:`Executor`."""
    if isinstance(executor, Executor):
        return executor
    if executor == "eager":
        return EagerExecutor()
    if executor == "graph":
        from .graph import StepGraph
        return StepGraph()
    raise ConfigError(f"executor must be 'eager', 'graph' or an Executor instance, got "
                      f"{executor!r}")
