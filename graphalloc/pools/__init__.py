"""Pools: a model is a list of layer kinds, each served by one pool (the registry below).

=====================  =======================================  ==========================
layer kind             pool                                     module (numpy / C twin)
=====================  =======================================  ==========================
``FullAttention``      :class:`~.full.FullPool`                 ``full`` / ``_cplan_core``
``SlidingWindow``      :class:`~.window.WindowPool`, sliding    ``window`` /
                       rule, pooled or ring policy              ``_cplan_window``
``ChunkedLocal``       :class:`~.window.WindowPool`, chunk rule ``chunked`` /
                                                                ``_cplan_chunked``
``RecurrentState``     :class:`~.state.StatePool`               ``state`` /
                                                                ``_cplan_states``
=====================  =======================================  ==========================

:func:`build_pools` turns a config's layers into :class:`Pools`: the FULL pool, the window
pool (:class:`~.window.NoWindow` when the model has no window layers) and the state pool
(:class:`~.state.NoStates` when it has no recurrent layers). The planner asks them at every
step kind; nothing outside this room asks "is there a state pool?" or "is this the ring
policy?". The first window pool is planned with FULL in the step's main rows; every further
one (``Pools.extras``: two windows, or a window and a chunked pool) is an
:class:`~.extra_window.ExtraWindowPool` with a ledger slice, descriptor sections and device
tables of its own. Cost: O(layers) once, at construction.
"""

from __future__ import annotations

from .chunked import ChunkedLocal, chunked_pool
from .extra_window import ExtraWindowPool
from .full import FullPool
from .layers import FullAttention, RecurrentState, SlidingWindow
from .state import NoStates, StatePool
from .window import NoWindow, SlidingRule, WindowPool

__all__ = ["Pools", "build_pools", "role_of", "REGISTRY", "LAYER_KINDS", "FullAttention",
           "SlidingWindow", "ChunkedLocal", "RecurrentState"]


def _window(layer: SlidingWindow, index: int) -> WindowPool:
    return WindowPool(SlidingRule(layer.window), layer.num_pages, layer.ring_pages, index)


# layer kind -> (the pool's role, how to build it): the one place a new kind is registered.
REGISTRY = {
    FullAttention: ("full", lambda layer, index: FullPool(layer.num_pages)),
    SlidingWindow: ("window", _window),
    ChunkedLocal: ("window", chunked_pool),
    RecurrentState: ("state", lambda layer, index: StatePool(layer.num_slots,
                                                             layer.max_spec_tokens)),
}
LAYER_KINDS = tuple(REGISTRY)


def role_of(layer) -> str:
    """``"full"``, ``"window"`` or ``"state"``: the role of ``layer``'s pool."""
    return REGISTRY[type(layer)][0]


class Pools:
    """The pools of one model: ``full``, ``windows`` (in layer order), ``window`` (the
    first, or :class:`NoWindow`), ``extras`` (the further window pools, as
    :class:`~.extra_window.ExtraWindowPool`: their own ledger slices, sections and tables)
    and ``state`` (or :class:`NoStates`)."""

    __slots__ = ("full", "windows", "window", "extras", "state")

    def __init__(self, full, windows, state):
        self.full, self.windows = full, tuple(windows)
        self.window = self.windows[0] if self.windows else NoWindow()
        self.extras = tuple(ExtraWindowPool(w.rule, w.num_pages, w.index)
                            for w in self.windows[1:])
        self.state = state if state is not None else NoStates()

    def __iter__(self):
        yield self.full
        yield from self.windows
        if self.state.has_states:
            yield self.state


def build_pools(layers) -> Pools:
    """The pools of ``layers`` (checked by the config: one FULL, at most one state)."""
    full, windows, state = None, [], None
    for layer in layers:
        role, make = REGISTRY[type(layer)]
        if role == "full":
            full = make(layer, 0)
        elif role == "window":
            windows.append(make(layer, len(windows)))
        else:
            state = make(layer, 0)
    return Pools(full, windows, state)
