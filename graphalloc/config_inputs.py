"""How :class:`~graphalloc.config.AllocatorConfig` and its engine sizing read their inputs.

Counts are plain ints (numpy integers pass; bools and floats are refused), a device is the
CPU or an available CUDA device, the window is the model's (``model_window``, Hugging
Face's ``config.sliding_window``) with the allocator's ``W - 1`` derived. Every refusal is
a :class:`~graphalloc.errors.ConfigError` naming the field. ``_ORIGINS`` remembers where
each shape of a live config came from (``describe()`` shows it). Cost: O(1) each.
"""

from __future__ import annotations

import numbers
import weakref

import numpy as np
import torch

from .deprecations import warn_renamed
from .errors import ConfigError

# Where each shape of a live config came from (describe() shows it), keyed by id() and
# dropped with the config: kept out of the instance so its __dict__ stays its fields.
_ORIGINS: dict[int, dict[str, str]] = {}


def _remember_origins(cfg, origins: dict[str, str]) -> None:
    if id(cfg) not in _ORIGINS:
        weakref.finalize(cfg, _ORIGINS.pop, id(cfg), None)
    _ORIGINS[id(cfg)] = origins


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _windows(where: str, model_window, sliding_window,
             context_len: int | None = None) -> tuple[int, int]:
    """``(model_window, sliding_window)`` from what was given: the model's window W
    (``model_window``, Hugging Face's ``config.sliding_window``) sets the allocator's
    ``sliding_window = min(max(W - 1, 1), context_len)``; ``sliding_window`` alone (the old
    input, W - 1) still works for one release, with a ``DeprecationWarning``. Both: they must
    agree (a ``dataclasses.replace`` that changes the window passes both, or
    ``sliding_window=None``).

    The clamp (a window past the context; ``context_len`` None: none): at any length
    ``L <= context_len`` the window rule's bound ``L - sliding_window`` is then at most 0, so
    nothing is ever evicted, exactly as with the unclamped window, while every size that
    follows from the window (the SWA pages one request needs, a ring's pages,
    ``for_engine``'s SWA pool) is that of the context. ``model_window`` keeps the value
    given; ``describe()`` shows the rule."""
    if model_window is None:
        if sliding_window is None:
            raise ConfigError(f"{where}give the model's window: model_window=W (Hugging Face's "
                              "config.sliding_window; the allocator's sliding_window = W - 1 "
                              "is derived)")
        allocator_w = _as_int(where, "sliding_window", sliding_window, 1)
        warn_renamed("AllocatorConfig(sliding_window=...) is the model's window minus one and "
                     "is deprecated: pass model_window=W (Hugging Face's "
                     f"config.sliding_window), here model_window={allocator_w + 1}")
        return allocator_w + 1, (allocator_w if context_len is None
                                 else min(allocator_w, context_len))
    model_w = _as_int(where, "model_window", model_window, 1)
    derived = _allocator_window(model_w, context_len)
    if sliding_window is not None and sliding_window not in (derived, max(model_w - 1, 1)):
        raise ConfigError(f"{where}model_window={model_w} gives sliding_window={derived}, but "
                          f"sliding_window={sliding_window} was given too: give the window "
                          "once (dataclasses.replace: model_window=W, sliding_window=None)")
    return model_w, derived


def _allocator_window(model_window: int, context_len: int | None) -> int:
    """The allocator's window for the model's W: ``min(max(W - 1, 1), context_len)`` (the
    ``- 1``: the class docstring's convention; the clamp: :func:`_windows`). O(1)."""
    w = max(model_window - 1, 1)
    return w if context_len is None else min(w, context_len)


def _window_rule(model_window: int, context_len: int) -> str:
    """How ``sliding_window`` came from W, with its numbers, for ``describe()``."""
    if max(model_window - 1, 1) > context_len:
        return (f"min(max(W - 1, 1), max_context_len) = min({model_window - 1}, {context_len}): "
                "the window is past the context, nothing is ever evicted")
    return f"max(model window - 1, 1) = max({model_window} - 1, 1)"


def _lookahead(where: str, num_lookahead_tokens, max_spec_tokens) -> int | None:
    """``max_spec_tokens`` (1 + k) from what was given: k, the draft tokens of a speculative
    decode row (``num_lookahead_tokens``: vLLM's ``num_speculative_tokens``, ``for_engine``'s
    ``num_lookahead_tokens``), gives ``1 + k``; ``max_spec_tokens`` alone (the old input,
    1 + k) still works for one release, with a ``DeprecationWarning``; neither: None (the
    state layer's, or the default). Both: they must agree."""
    if num_lookahead_tokens is None:
        if not max_spec_tokens:
            return None
        spec = _as_int(where, "max_spec_tokens", max_spec_tokens, 1)
        warn_renamed("AllocatorConfig(max_spec_tokens=...) counts 1 + k and is deprecated: pass "
                     "num_lookahead_tokens=k (the draft tokens of a speculative step, as "
                     f"vLLM's num_speculative_tokens), here num_lookahead_tokens={spec - 1}")
        return spec
    k = _as_int(where, "num_lookahead_tokens", num_lookahead_tokens, 0,
                "draft tokens per speculative step")
    if max_spec_tokens and max_spec_tokens != 1 + k:
        raise ConfigError(f"{where}num_lookahead_tokens={k} gives max_spec_tokens={1 + k}, but "
                          f"max_spec_tokens={max_spec_tokens} was given too: give it once "
                          "(dataclasses.replace: num_lookahead_tokens=k, max_spec_tokens=None)")
    return 1 + k


def _as_int(where: str, name: str, value, minimum: int, meaning: str = "") -> int:
    """``value`` as a plain int >= ``minimum``. numpy integers pass; bools and floats do not."""
    note = f" ({meaning})" if meaning else ""
    if isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{where}{name} must be an int >= {minimum}{note}, got {value!r}: "
                          "a bool is not a count here; pass the number")
    if not isinstance(value, (numbers.Integral, np.integer)):
        raise ConfigError(f"{where}{name} must be an int >= {minimum}{note}, got {value!r} "
                          f"({type(value).__name__}); pass a whole number")
    if value < minimum:
        raise ConfigError(f"{where}{name} must be an int >= {minimum}{note}, got {value}")
    return int(value)


def _as_device(value) -> torch.device:
    """A CPU or an available CUDA device; anything else raises :class:`ConfigError`."""
    if not isinstance(value, (str, torch.device)):
        raise ConfigError(f"AllocatorConfig: device must be a str or torch.device ('cpu', "
                          f"'cuda', 'cuda:1'), got {value!r}")
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError):
        raise ConfigError(f"AllocatorConfig: device {value!r} is not a torch device; "
                          "use 'cpu', 'cuda' or 'cuda:<index>'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"AllocatorConfig: device={value!r} needs a CUDA device, and this torch "
                f"({torch.__version__}, CUDA build {torch.version.cuda}) sees none "
                "(torch.cuda.is_available() is False). Use device='cpu' (backend='torch', or "
                "'triton' under TRITON_INTERPRET=1), or install a CUDA build of torch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"AllocatorConfig: device={value!r}, but only "
                              f"{torch.cuda.device_count()} CUDA device(s) are visible")
    elif dev.type != "cpu":
        raise ConfigError(f"AllocatorConfig: device type {dev.type!r} is not supported; "
                          "use 'cpu' or 'cuda'")
    return dev


def _release_need(request_pages: int, ring_pages: int, row_pages: int) -> tuple[int, int]:
    """(release rows, page lanes) that releasing one request of ``request_pages`` FULL
    pages can need, rows split at ``row_pages`` pages (derivation: AllocatorConfig)."""
    rows = 1 + _ceil_div(request_pages - 1, row_pages)
    if ring_pages:
        rows += _ceil_div(ring_pages, row_pages)
    return rows, request_pages + ring_pages
