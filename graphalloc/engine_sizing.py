"""Sizing a config from a serving engine's budgets: :meth:`~graphalloc.AllocatorConfig.for_engine`.

An engine knows its running requests, prefill budget, context length, page size, model
window and KV memory, not the allocator's pool sizes or frozen step shape. :func:`for_engine`
derives them: the window conversion (``sliding_window = W_model - 1``), the memory split
between the FULL and SWA pools (``_engine_pools``), and every ``max_*`` shape from the
budgets, each recorded with its formula and numbers for ``AllocatorConfig.describe()``.
Its docstring states the inputs, the split rule and the derived shapes.

Call it as ``AllocatorConfig.for_engine(...)``: the class holds this function as its
classmethod (``for_engine = classmethod(engine_sizing.for_engine)``); the input readers
it shares with the class are :mod:`graphalloc.config_inputs`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .config_inputs import (
    _ORIGINS,
    _allocator_window,
    _as_int,
    _ceil_div,
    _release_need,
    _window_rule,
)
from .deprecations import warn_renamed
from .errors import ConfigError

if TYPE_CHECKING:
    from .config import AllocatorConfig

__all__ = ["for_engine"]


def for_engine(cls, *, max_running_requests: int, chunked_prefill_size: int,
               max_context_len: int, page_size: int, model_window: int | None = None,
               num_full_pages: int | None = None, num_swa_pages: int | None = None,
               kv_bytes: int | None = None, full_bytes_per_token: int | None = None,
               swa_bytes_per_token: int | None = None, num_lookahead_tokens: int = 0,
               max_releases_per_step: int | None = None, max_reqs: int | None = None,
               max_pages_per_row: int | None = None, swa_ring_pages: int = 0,
               index_dtype: torch.dtype = torch.int64, device: str | torch.device = "cpu",
               backend: str = "torch", validate: bool = False, max_handles: int = 0,
               max_prefix_hits_per_step: int | None = None,
               num_state_slots: int | None = None, state_bytes_per_slot: int | None = None,
               state_bytes: int | None = None,
               model_sliding_window: int | None = None) -> AllocatorConfig:
    """A config derived from what a serving engine knows; every shape from a budget.

    Example (a 4096-token window model, 256 running requests, 8192 prefill tokens
    per step, 40 GB of KV cache)::

        cfg = AllocatorConfig.for_engine(
            max_running_requests=256, chunked_prefill_size=8192, max_context_len=131072,
            page_size=16, model_window=4096, kv_bytes=40 << 30,
            full_bytes_per_token=2 * 8 * 8 * 128 * 2,   # K+V, 8 full layers, 8 heads x 128
            swa_bytes_per_token=2 * 24 * 8 * 128 * 2,   # K+V, 24 SWA layers, bf16
            device="cuda", backend="triton")
        print(cfg.describe())

    Inputs (N = ``max_running_requests``, C = ``chunked_prefill_size``, k =
    ``num_lookahead_tokens``, ps = ``page_size``):

    * ``max_running_requests``: requests decoding or prefilling at once.
    * ``chunked_prefill_size``: prefill tokens per step, all prefill rows together
      (SGLang: ``min(--chunked-prefill-size, --max-prefill-tokens)``; vLLM:
      ``max_num_batched_tokens``, an over-estimate). Without chunking: the longest prompt.
    * ``max_context_len``, ``page_size``: as in the constructor.
    * ``model_window``: the model's W (HF ``config.sliding_window``), the constructor's
      keyword; ``sliding_window = min(max(W - 1, 1), max_context_len)`` (the class
      docstring's convention). ``model_sliding_window=``, its old name, still works for
      one release, with a ``DeprecationWarning``.
    * memory, either ``num_full_pages`` and ``num_swa_pages``, or ``kv_bytes`` (the KV
      memory of all layers, both pools) with ``full_bytes_per_token`` and
      ``swa_bytes_per_token`` (K and V bytes of one token over all full / all SWA
      layers). Split rule, page 0 of each pool (the sink) included: in ring mode the
      SWA pool holds every request row's ring, ``num_swa_pages = max_reqs x R``; in
      pool mode it holds what the windows can use at once when every step evicts,
      ``S = max_reqs x (ceil(W / ps) + 1) + floor(max_step_tokens / ps) + N`` (a
      request holds at most ``ceil(W / ps) + 1`` window pages after a step's evict
      plus ``ceil(n / ps)`` pages for the n tokens it allocates), but never more
      than the FULL pool (a live SWA page is the peer of a live FULL page). The
      FULL pool gets the rest: ``num_full_pages = floor((kv_bytes - (num_swa_pages
      + 1) x ps x swa_bytes_per_token) / (ps x full_bytes_per_token)) - 1``; when
      memory cannot give FULL more than S pages, both pools get
      ``floor(kv_bytes / (ps x (full + swa bytes per token))) - 1`` pages.
    * ``num_lookahead_tokens``: k, the draft tokens of a speculative decode row (vLLM's
      ``num_speculative_tokens``; default 0), as the constructor's keyword.
    * ``max_releases_per_step`` (F, default N): requests released in one step.
      Fewer gives a smaller grid; an engine then splits bursts (``free_group()``
      splits its flush into several steps by itself).
    * ``max_reqs`` (default N): request rows. A row is reusable once its release is
      planned, so an engine that admits before releasing needs N + F rows.
    * ``max_pages_per_row`` (c, default ``ceil(max_context_len / ps)``: a release is
      two rows): fewer pages per row spread a long release over more programs.
    * ``max_handles`` (default 0): shared-prefix handles (a prefix cache's entries;
      pool mode only). ``max_prefix_hits_per_step`` (H, default N when there are
      handles, else 0): requests admitted on a cached prefix in one step; each adds
      one allocation row (the prefix copy) to the step.
    * recurrent-state slots (models with Mamba / linear-attention layers): give
      ``num_state_slots``, or ``state_bytes_per_slot`` (one request's state over every
      recurrent layer) and optionally ``state_bytes`` (the memory for states). Need:
      ``max_reqs + max_handles + 2 x N x (1 + k)`` (k > 0: two speculative steps of 1 + k
      tokens in flight per running request; k = 0: no speculative slots); with
      ``state_bytes`` the pool is ``floor(state_bytes / state_bytes_per_slot) - 1`` slots
      (slot 0 the sink), refused below ``max_reqs``; fewer than the need means a step may be
      refused for slots (a shortage: ``try_step`` returns None), the prefix cache's snapshots
      reclaimed first. ``num_lookahead_tokens = k`` (``max_spec_tokens = 1 + k``).
    * ``swa_ring_pages``, ``index_dtype``, ``device``, ``backend``, ``validate``: as in
      the constructor. A ring must hold the window plus one row's allocation:
      ``R >= ceil((max(W, ps) + max_tokens_per_alloc_row - 1) / ps) + 1``.

    Derived shapes (P = ``min(ceil(max_context_len / ps), num_full_pages)``)::

        max_alloc_rows           = N + H                one row per running request, one
                                                        per prefix hit admitted
        max_tokens_per_alloc_row = min(max_context_len, max(C, 1 + k))
        max_step_tokens          = C + N x (1 + k)      prefill budget + decode rows
        max_release_rows         = F x (1 + ceil((P - 1) / c) [+ ceil(R / c)])
                                   + N x ceil(ceil(max_tokens_per_alloc_row / ps) / c)
        max_step_pages           = min(F x P, num_full_pages) [+ min(F x R, num_swa_pages)]
                                   + min(floor(max_step_tokens / ps) + N, num_swa_pages)

    The release terms are F worst-case releases (the class docstring's per-request
    minimum); a release frees only live FULL pages, hence the cap. The eviction
    terms assume the engine evicts every live request every step: a window
    frontier then moves at most ``ceil(n / ps)`` pages past the n tokens its request
    allocated a step before, one row per request, ``sum ceil(n_i / ps) <=
    floor(max_step_tokens / ps) + N`` lanes, never more than the live SWA pages. An
    engine that evicts less often can need more (the step is refused with
    :class:`~graphalloc.errors.BatchTooLargeError`, nothing changed). With these
    shapes no step within the budgets is refused for its shape. :meth:`describe`
    shows each value with its formula and numbers.
    """

    where = "AllocatorConfig.for_engine: "
    n_run = _as_int(where, "max_running_requests", max_running_requests, 1)
    prefill = _as_int(where, "chunked_prefill_size", chunked_prefill_size, 1)
    ctx = _as_int(where, "max_context_len", max_context_len, 1)
    ps = _as_int(where, "page_size", page_size, 1)
    w_model = _model_window(where, model_window, model_sliding_window)
    k = _as_int(where, "num_lookahead_tokens", num_lookahead_tokens, 0)
    n_handles = _as_int(where, "max_handles", max_handles, 0)
    hits = (n_run if n_handles else 0) if max_prefix_hits_per_step is None else _as_int(
        where, "max_prefix_hits_per_step", max_prefix_hits_per_step, 0)
    ring = _as_int(where, "swa_ring_pages", swa_ring_pages, 0, "0 is pool mode")
    rows = n_run if max_reqs is None else _as_int(where, "max_reqs", max_reqs, n_run,
                                                  "at least max_running_requests")
    n_rel = n_run if max_releases_per_step is None else _as_int(
        where, "max_releases_per_step", max_releases_per_step, 1)
    c = (_ceil_div(ctx, ps) if max_pages_per_row is None
         else _as_int(where, "max_pages_per_row", max_pages_per_row, 1))
    window = _allocator_window(w_model, ctx)
    row_tokens = min(ctx, max(prefill, 1 + k))
    step_tokens = prefill + n_run * (1 + k)
    if ring:
        need = _ceil_div(max(window, ps) + row_tokens - 1, ps) + 1
        if ring < need:
            raise ConfigError(
                f"{where}swa_ring_pages={ring} cannot hold the window ({window} tokens) "
                f"plus one row's {row_tokens} tokens at page_size {ps}: need >= {need} "
                "(ceil((max(W, ps) + max_tokens_per_alloc_row - 1) / ps) + 1). Raise "
                "swa_ring_pages or lower chunked_prefill_size")
    n_full, n_swa, pool_rule = _engine_pools(
        where, rows, n_run, ps, window, ring, step_tokens, num_full_pages, num_swa_pages,
        kv_bytes, full_bytes_per_token, swa_bytes_per_token)
    p_req = min(_ceil_div(ctx, ps), n_full)
    per_release, _ = _release_need(p_req, ring, c)
    per_evict = _ceil_div(_ceil_div(row_tokens, ps), c)
    release_rows = n_rel * per_release + n_run * per_evict
    evict_pages = min(step_tokens // ps + n_run, n_swa)
    step_pages = (min(n_rel * p_req, n_full) + (min(n_rel * ring, n_swa) if ring else 0)
                  + evict_pages)
    n_slots, slot_rule = _engine_states(where, rows, n_run, k, n_handles, num_state_slots,
                                        state_bytes_per_slot, state_bytes)
    from .pools import FullAttention, RecurrentState, SlidingWindow

    layers = [FullAttention(n_full), SlidingWindow(w_model, n_swa, ring)]
    if n_slots:
        layers.append(RecurrentState(n_slots, 1 + k))
    cfg = cls(page_size=ps, max_reqs=rows, max_context_len=ctx, layers=tuple(layers),
              index_dtype=index_dtype, device=device, backend=backend,
              max_release_rows=release_rows, max_pages_per_row=c,
              max_alloc_rows=n_run + hits, max_tokens_per_alloc_row=row_tokens,
              max_step_tokens=step_tokens, max_step_pages=step_pages, validate=validate,
              max_handles=n_handles)
    ring_rows = " + ceil(R / c)" if ring else ""
    ring_pages = " + min(F x R, num_swa_pages)" if ring else ""
    _ORIGINS[id(cfg)].update({
        "num_full_pages": pool_rule[0], "num_swa_pages": pool_rule[1],
        "model_window": "given" if model_sliding_window is None else "model_sliding_window",
        "sliding_window": _window_rule(w_model, ctx),
        "max_reqs": "max_running_requests" if max_reqs is None else "given",
        "max_pages_per_row": ("ceil(max_context_len / page_size)" if max_pages_per_row
                              is None else "given"),
        "max_alloc_rows": (f"max_running_requests + max_prefix_hits_per_step = {n_run} + "
                           f"{hits}"),
        "max_handles": "given" if n_handles else "default",
        "num_state_slots": slot_rule,
        "num_lookahead_tokens": "num_lookahead_tokens" if n_slots else "default",
        "max_spec_tokens": "1 + num_lookahead_tokens",
        "max_state_rows": ("2 x (max_reqs + max_handles) + max_reqs x ceil("
                           "max_spec_tokens / 6)"),
        "max_tokens_per_alloc_row": (f"min(max_context_len, max(chunked_prefill_size, "
                                     f"1 + lookahead)) = min({ctx}, max({prefill}, {1 + k}))"),
        "max_step_tokens": (f"chunked_prefill_size + max_running_requests x (1 + "
                            f"lookahead) = {prefill} + {n_run} x {1 + k}"),
        "max_release_rows": (f"F x (1 + ceil((P - 1) / c){ring_rows}) + N x ceil(ceil("
                             f"max_tokens_per_alloc_row / ps) / c) = {n_rel} x "
                             f"{per_release} + {n_run} x {per_evict}"),
        "max_step_pages": (f"min(F x P, num_full_pages){ring_pages} + min(floor("
                           f"max_step_tokens / ps) + N, num_swa_pages) = "
                           f"{step_pages - evict_pages} + {evict_pages}"),
    })
    return cfg


def _model_window(where: str, model_window, model_sliding_window) -> int:
    """W from ``model_window=`` (or its deprecated old name, with a warning). O(1)."""
    if model_sliding_window is not None:
        if model_window is not None:
            raise ConfigError(f"{where}model_window and model_sliding_window name the same "
                              "window; give model_window only")
        warn_renamed("AllocatorConfig.for_engine(model_sliding_window=...) is deprecated: pass "
                     "model_window=W (the same value: Hugging Face's config.sliding_window), "
                     "the keyword the constructor takes")
        return _as_int(where, "model_sliding_window", model_sliding_window, 1)
    if model_window is None:
        raise ConfigError(f"{where}give the model's window: model_window=W (Hugging Face's "
                          "config.sliding_window)")
    return _as_int(where, "model_window", model_window, 1)


# Called as AllocatorConfig.for_engine: Python's own TypeErrors (a wrong keyword) name it so.
for_engine.__qualname__ = "AllocatorConfig.for_engine"


def _engine_pools(where, n_rows, n_run, ps, window, ring, step_tokens, num_full_pages,
                  num_swa_pages, kv_bytes, full_bytes_per_token, swa_bytes_per_token):
    """(num_full_pages, num_swa_pages, (rule, rule)) by the split rule of for_engine."""

    counts = (num_full_pages, num_swa_pages)
    sizes = (kv_bytes, full_bytes_per_token, swa_bytes_per_token)
    if any(v is not None for v in sizes):
        if any(v is not None for v in counts) or any(v is None for v in sizes):
            raise ConfigError(
                f"{where}give the KV memory one way: num_full_pages and num_swa_pages, or "
                "kv_bytes with full_bytes_per_token and swa_bytes_per_token (all three)")
    elif any(v is None for v in counts):
        raise ConfigError(f"{where}give num_full_pages and num_swa_pages, or kv_bytes with "
                          "full_bytes_per_token and swa_bytes_per_token")
    else:
        return (_as_int(where, "num_full_pages", num_full_pages, 1),
                _as_int(where, "num_swa_pages", num_swa_pages, 1), ("given", "given"))
    total = _as_int(where, "kv_bytes", kv_bytes, 1)
    full_page = ps * _as_int(where, "full_bytes_per_token", full_bytes_per_token, 1)
    swa_page = ps * _as_int(where, "swa_bytes_per_token", swa_bytes_per_token, 1)
    rest = "floor((kv_bytes - (num_swa_pages + 1) x swa page bytes) / full page bytes) - 1"

    def full_after(n_swa: int) -> int:  # FULL pages in what the SWA pool leaves
        return (total - (n_swa + 1) * swa_page) // full_page - 1

    if ring:
        n_swa = n_rows * ring
        n_full, rules = full_after(n_swa), (rest, f"max_reqs x swa_ring_pages = "
                                                  f"{n_rows} x {ring}")
    else:
        need = n_rows * (_ceil_div(window, ps) + 1) + step_tokens // ps + n_run
        equal = total // (full_page + swa_page) - 1
        if equal <= need:
            n_full = n_swa = equal
            rule = f"floor(kv_bytes / (full + swa page bytes)) - 1 (memory < S = {need})"
            rules = (rule, rule)
        else:
            n_swa, n_full = need, full_after(need)
            rules = (rest, "S = max_reqs x (ceil(W / ps) + 1) + floor(max_step_tokens / ps) "
                     f"+ N = {n_rows} x {_ceil_div(window, ps) + 1} + "
                     f"{step_tokens // ps} + {n_run}")
    if n_full < 1 or n_swa < 1:
        raise ConfigError(
            f"{where}kv_bytes={total} is too small: it leaves {n_full} FULL and {n_swa} "
            f"SWA pages (a FULL page is {full_page} bytes, an SWA page {swa_page}, and "
            "page 0 of each pool is a sink). Give more memory or a smaller page_size")
    return n_full, n_swa, rules


def _engine_states(where, n_rows, n_run, k, n_handles, num_state_slots, bytes_per_slot,
                   total_bytes) -> tuple[int, str]:
    """(num_state_slots, rule) by the state rule of for_engine (0: no recurrent layers)."""

    need = n_rows + n_handles + (2 * n_run * (1 + k) if k else 0)
    if num_state_slots is not None:
        if bytes_per_slot is not None or total_bytes is not None:
            raise ConfigError(f"{where}give the state slots one way: num_state_slots, or "
                              "state_bytes_per_slot (with state_bytes)")
        return _as_int(where, "num_state_slots", num_state_slots, 0), "given"
    if bytes_per_slot is None:
        if total_bytes is not None:
            raise ConfigError(f"{where}state_bytes needs state_bytes_per_slot")
        return 0, "default"
    per = _as_int(where, "state_bytes_per_slot", bytes_per_slot, 1)
    rule = (f"max_reqs + max_handles + 2 x N x (1 + lookahead) = {n_rows} + {n_handles} + "
            f"{need - n_rows - n_handles}")
    if total_bytes is None:
        return need, rule
    fit = _as_int(where, "state_bytes", total_bytes, 1) // per - 1
    if fit < n_rows:
        raise ConfigError(f"{where}state_bytes={total_bytes} holds {fit} state slots of "
                          f"{per} bytes (slot 0 the sink); every request row needs one: "
                          f"max_reqs = {n_rows}. Give more memory or fewer rows")
    return fit, f"floor(state_bytes / state_bytes_per_slot) - 1 = {fit} (need {need})"
