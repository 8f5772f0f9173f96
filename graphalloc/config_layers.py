"""How ``AllocatorConfig`` reads the model's layer kinds, and its deprecated keyword form.

``layers=[FullAttention(n), SlidingWindow(w, n), ChunkedLocal(c, n), RecurrentState(s)]``
is checked here (one full-attention kind, at most one recurrent kind, no ring of pages
beside further window pools); the keyword form (``num_full_pages=``, ``num_swa_pages=``,
``model_window=``, ``swa_ring_pages=``, ``num_state_slots=``) is translated into the same
layers with a ``DeprecationWarning``; and keyword fields given beside ``layers`` (what
``dataclasses.replace(cfg, num_full_pages=...)`` passes back) are applied on top of them.
Cost: O(layers), once per config.
"""

from __future__ import annotations

import dataclasses
import warnings

from .config_inputs import _as_int, _windows
from .errors import ConfigError
from .pools import LAYER_KINDS, role_of
from .pools.layers import FullAttention, RecurrentState, SlidingWindow

__all__ = ["resolve_layers"]

_KEYWORDS = ("num_full_pages", "num_swa_pages", "model_window", "sliding_window",
             "swa_ring_pages", "num_state_slots", "max_spec_tokens")


def _split_layers(layers):
    full = [x for x in layers if role_of(x) == "full"]
    windows = [x for x in layers if role_of(x) == "window"]
    states = [x for x in layers if role_of(x) == "state"]
    return full[0], windows, (states[0] if states else None)


def resolve_layers(cfg, where: str) -> tuple:
    """The model's layer kinds: ``layers`` as given (checked), with any keyword field that
    names one of them (``dataclasses.replace`` passes them back) applied on top; or, from
    the keyword form alone (deprecated), built from it."""
    given = {name: getattr(cfg, name) for name in _KEYWORDS}
    given["max_context_len"] = cfg.max_context_len  # the window's clamp
    if cfg.layers is None:
        if given["num_full_pages"] is None:
            raise ConfigError(f"{where}give the model's layers: layers=[FullAttention("
                              "num_pages), SlidingWindow(window, num_pages), ...] "
                              "(graphalloc.pools.layers)")
        return _layers_from_keywords(where, given)
    layers = tuple(cfg.layers) if isinstance(cfg.layers, (list, tuple)) else None
    if layers is None or not all(isinstance(x, LAYER_KINDS) for x in layers):
        raise ConfigError(f"{where}layers must be a list of layer kinds ("
                          f"{', '.join(k.__name__ for k in LAYER_KINDS)}), got {cfg.layers!r}")
    roles = [role_of(x) for x in layers]
    n_full, n_state, n_window = (roles.count(r) for r in ("full", "state", "window"))
    if n_full != 1:
        raise ConfigError(f"{where}a model has exactly one FullAttention layer kind (it holds "
                          f"the pages every other pool pairs with), got {n_full}")
    if n_state > 1:
        raise ConfigError(f"{where}at most one RecurrentState layer kind, got {n_state}: give "
                          "the slots every recurrent layer needs together (one slot serves "
                          "all of a request's recurrent layers)")
    if n_window > 1:
        rings = [x for x in layers if getattr(x, "ring_pages", 0)]
        if rings:
            raise ConfigError(f"{where}{n_window} window layer kinds with ring_pages="
                              f"{rings[0].ring_pages} on {rings[0]!r}: a model with several "
                              "window pools draws every pool's pages from its shared pool "
                              "(ring_pages=0)")
    return _apply_keywords(where, layers, given)


def _apply_keywords(where: str, layers: tuple, given: dict) -> tuple:
    """``layers`` with the keyword fields that differ from them applied (how
    ``dataclasses.replace(cfg, num_full_pages=...)`` changes a pool)."""
    full, windows, state = _split_layers(layers)
    out = list(layers)

    def swap(old, new):
        out[out.index(old)] = new

    if given["num_full_pages"] is not None and given["num_full_pages"] != full.num_pages:
        swap(full, FullAttention(_as_int(where, "num_full_pages", given["num_full_pages"], 1)))
    window = windows[0] if windows else None
    if isinstance(window, SlidingWindow):
        model_w, _ = _windows(where, given["model_window"] if given["model_window"] is not None
                              else window.window, given["sliding_window"]
                              if given["model_window"] is not None else None,
                              given["max_context_len"])
        pages = window.num_pages if given["num_swa_pages"] is None else given["num_swa_pages"]
        ring = window.ring_pages if given["swa_ring_pages"] is None else given["swa_ring_pages"]
        new = SlidingWindow(model_w, pages, ring)
        if new != window:
            swap(window, new)
    elif window is not None and given["num_swa_pages"] not in (None, window.num_pages):
        swap(window, dataclasses.replace(window, num_pages=given["num_swa_pages"]))
    spec = given["max_spec_tokens"]
    if state is not None and spec and spec != state.max_spec_tokens:  # num_lookahead_tokens
        new = RecurrentState(state.num_slots, spec)
        swap(state, new)
        state = new
    if state is not None and given["num_state_slots"] not in (None, state.num_slots):
        n = _as_int(where, "num_state_slots", given["num_state_slots"], 0)
        if n:
            swap(state, RecurrentState(n, state.max_spec_tokens))
        else:
            out.remove(state)
    elif state is None and given["num_state_slots"]:
        out.append(RecurrentState(given["num_state_slots"], given["max_spec_tokens"] or 0))
    return tuple(out)


def _layers_from_keywords(where: str, given: dict) -> tuple:
    """The keyword form (before ``layers``): FULL and SWA pages, the model window, ring
    pages, state slots. Deprecated, with the equivalent ``layers`` in the warning."""
    warnings.warn(
        "AllocatorConfig's keyword form (num_full_pages=, num_swa_pages=, model_window=, "
        "swa_ring_pages=, num_state_slots=) is deprecated: describe the model's layers, "
        "layers=[FullAttention(num_pages), SlidingWindow(window, num_pages), "
        "RecurrentState(num_slots)] (graphalloc.FullAttention, ...)", DeprecationWarning,
        stacklevel=5)
    full = FullAttention(_as_int(where, "num_full_pages", given["num_full_pages"], 1))
    layers = [full]
    swa_pages = given["num_swa_pages"]
    if swa_pages is None:
        raise ConfigError(f"{where}num_swa_pages is required with num_full_pages (or give "
                          "layers=[FullAttention(...), ...])")
    model_w, _ = _windows(where, given["model_window"], given["sliding_window"],
                          given["max_context_len"])
    ring = _as_int(where, "swa_ring_pages", given["swa_ring_pages"] or 0, 0, "0 is pool mode")
    layers.append(SlidingWindow(model_w, _as_int(where, "num_swa_pages", swa_pages, 1), ring))
    n_slots = _as_int(where, "num_state_slots", given["num_state_slots"] or 0, 0,
                      "0: the model has no recurrent layers")
    if n_slots:
        layers.append(RecurrentState(n_slots, _as_int(where, "max_spec_tokens",
                                                       given["max_spec_tokens"] or 0, 0,
                                                       "0 picks 8")))
    return tuple(layers)
