"""The model's layer kinds, as an engine describes them: what each kind of layer keeps.

A model is a list of layer kinds (``AllocatorConfig(layers=[...])``); each kind is served by
one pool (:mod:`graphalloc.pools`, the registry). Sizes are in the pool's own units: pages
of ``page_size`` tokens for attention, slots for recurrent state. Every kind is a frozen
value checked when it is built (:class:`~graphalloc.errors.ConfigError` naming the field).

==========================  ===================================  ===========================
kind                        a layer of it reads, at length C     its pool
==========================  ===================================  ===========================
``FullAttention(n)``        every position ``[0, C)``            FULL pages, ``req_to_token``
``SlidingWindow(W, n)``     its last W keys: ``[C + 1 - W, C]``  window pages paired with
                            (W as Hugging Face's                 FULL pages; the frontier
                            ``config.sliding_window``)           moves by the window rule
``ChunkedLocal(C_k, n)``    its chunk: ``[floor(C / C_k) C_k,    the same pairing; the
(:mod:`.chunked`)           C]`` (Llama 4's chunked attention)   frontier moves chunk by
                                                                 chunk
``RecurrentState(S)``       one fixed-size state per request     state slots (no pages)
==========================  ===================================  ===========================

Exactly one ``FullAttention``; sliding windows and chunked local layers come with their own
pool each (the window pools: stage one of the pools work serves at most one of them, the
first); at most one ``RecurrentState``. Cost: O(1).
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from ..errors import ConfigError

__all__ = ["FullAttention", "SlidingWindow", "RecurrentState", "check_count", "fix_count"]


def check_count(where: str, name: str, value, minimum: int, meaning: str = "") -> int:
    """``value`` as a plain int >= ``minimum`` (numpy integers pass; bools and floats do
    not), or :class:`ConfigError` naming ``where`` and ``name``."""
    note = f" ({meaning})" if meaning else ""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral,
                                                                      np.integer)):
        raise ConfigError(f"{where}{name} must be an int >= {minimum}{note}, got {value!r} "
                          f"({type(value).__name__}); pass a whole number")
    if value < minimum:
        raise ConfigError(f"{where}{name} must be an int >= {minimum}{note}, got {value}")
    return int(value)


def fix_count(obj, name: str, minimum: int, meaning: str = "") -> None:
    """Check a layer kind's count field in place (its ConfigError names the kind)."""
    where = f"{type(obj).__name__}: "
    object.__setattr__(obj, name, check_count(where, name, getattr(obj, name), minimum,
                                              meaning))


@dataclasses.dataclass(frozen=True)
class FullAttention:
    """Full-attention layers: ``num_pages`` usable FULL pages (page 0, the sink, apart)."""

    num_pages: int

    def __post_init__(self) -> None:
        fix_count(self, "num_pages", 1)


@dataclasses.dataclass(frozen=True)
class SlidingWindow:
    """Sliding-window layers of window ``window`` (the model's W, Hugging Face's
    ``config.sliding_window``: a query reads its last W keys, itself included), served by
    ``num_pages`` usable window pages. ``ring_pages`` > 0: each request owns a fixed ring of
    that many window pages instead of drawing from the shared pool (no prefix sharing)."""

    window: int
    num_pages: int
    ring_pages: int = 0

    def __post_init__(self) -> None:
        fix_count(self, "window", 1)
        fix_count(self, "num_pages", 1)
        fix_count(self, "ring_pages", 0, "0: pages drawn from the shared pool")


@dataclasses.dataclass(frozen=True)
class RecurrentState:
    """Recurrent layers (Mamba, gated delta-net, short convolutions): ``num_slots`` state
    slots (a slot per request, one per prefix-cache snapshot, one per token of each
    speculative step in flight); ``max_spec_tokens`` tokens of one speculative step get a
    slot each (0 picks 8)."""

    num_slots: int
    max_spec_tokens: int = 0

    def __post_init__(self) -> None:
        fix_count(self, "num_slots", 1)
        fix_count(self, "max_spec_tokens", 0, "0 picks 8")
        if not self.max_spec_tokens:
            object.__setattr__(self, "max_spec_tokens", 8)

