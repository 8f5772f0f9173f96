"""The executor of a replicated rank's allocator: how a step reaches the other ranks.

:class:`ReplicaExecutor` is built by :class:`~graphalloc.replicas.allocator.ReplicatedAllocator`
for its allocator (an executor is chosen at construction and never replaced): in replicated
mode it runs the step through the eager or graph executor and records the step's digest; a
broadcast planner's broadcasts the step's payload and replays it; a broadcast follower's
plans nothing (``plans_locally = False``: the allocator refuses ``plan()`` before anything
changes). It holds its layer weakly (the layer holds the allocator, which holds this
executor). Cost: the wrapped executor's, plus the layer's per-step work.
"""

from __future__ import annotations

import weakref

from ..device.executor import Executor
from ..errors import ContractError
from ..parts import DeviceParts

__all__ = ["ReplicaExecutor", "capture_warm"]


class ReplicaExecutor(Executor):
    """The executor of a replicated rank's allocator (built by :class:`ReplicatedAllocator`).

    ``role``: ``"replicated"`` (run the step through ``inner``, the eager or graph
    executor, then record the step's digest), ``"planner"`` (broadcast the step's payload
    and replay it from the payload) or ``"follower"`` (plans nothing: ``plan()`` is refused
    before anything changes; steps arrive through :meth:`ReplicatedAllocator.follow`).
    """

    name = "replica"

    def __init__(self, layer, role: str, inner: Executor | None = None):
        super().__init__()
        # The layer holds its allocator, which holds this executor: the layer is held
        # weakly, so nothing cyclic keeps the wrapper (and its process group) alive.
        self.layer, self.role, self.inner = weakref.proxy(layer), role, inner
        self.plans_locally = role != "follower"
        # the planner runs its steps from the broadcast payload, which carries no stamp
        self.stamps_steps = role == "replicated"

    def bind(self, parts: DeviceParts) -> None:
        super().bind(parts)
        if self.inner is not None:
            self.inner.bind(parts)

    def execute(self, planned) -> None:
        if self.role == "replicated":
            self.inner.execute(planned)
            self.count(planned.fusable and self.parts.kernels.fused)
        elif self.role == "planner":
            self.layer.broadcast_planned(planned)  # the payload runs as two launches
            self.count(False)
        else:  # unreachable: the allocator refuses plan() first
            raise ContractError("a broadcast follower never plans its own steps")
        self.layer.after_step()


def capture_warm(fns) -> list:
    """Run each of ``fns`` twice on a side stream (compiles its kernels; the callers' zero
    payloads are all padding, so nothing changes), then capture each into a CUDA graph.
    Synchronises: construction only."""
    import torch

    from ..device.graph import capture_graph

    torch.cuda.synchronize()  # sync ok: one-time construction
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()  # sync ok: one-time construction
    graphs = [capture_graph(fn) for fn in fns]
    torch.cuda.synchronize()  # sync ok: one-time construction
    return graphs
