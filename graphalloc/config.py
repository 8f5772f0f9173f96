"""The allocator's geometry and frozen step shape, in one dataclass.

Build it field by field when you know the shapes (tests, benchmarks), or with
:meth:`AllocatorConfig.for_engine` from what a serving engine knows (running
requests, prefill budget, context length, KV memory), which derives every shape.
Either way ``__post_init__`` checks every value before an allocator exists.
The engine sizing (its memory split and shape formulas) lives in
:mod:`graphalloc.engine_sizing`; the class holds it as its classmethod.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np
import torch

from .config_inputs import (
    _ORIGINS,
    _as_device,
    _as_int,
    _ceil_div,
    _lookahead,
    _release_need,
    _remember_origins,
    _window_rule,
)
from .config_layers import resolve_layers
from .engine_sizing import for_engine as _for_engine
from .errors import ConfigError
from .pools import Pools, build_pools, role_of

__all__ = ["AllocatorConfig"]

# The step descriptor's frozen shape; 0 in the constructor picks the default.
_SHAPE_FIELDS = ("max_release_rows", "max_pages_per_row", "max_alloc_rows",
                 "max_tokens_per_alloc_row", "max_step_pages", "max_step_tokens")


@dataclasses.dataclass(frozen=True)
class AllocatorConfig:
    """Geometry of the two pools and the frozen shape of a step.

    Pools: the FULL pool has pages ``1..num_full_pages`` and the SWA pool pages
    ``1..num_swa_pages``; page 0 of each is a sink that is never handed out.
    A slot is ``page * page_size + offset``.

    **Window convention.** Give the *model's* window: ``model_window=W`` as Hugging Face
    defines it (``config.sliding_window``); the allocator derives its own window
    ``sliding_window = max(W - 1, 1)`` and :meth:`describe` shows both. (Passing
    ``sliding_window`` itself, the allocator's window, still works for one release with a
    ``DeprecationWarning``.) ``sliding_window`` is the *allocator's* window: an
    SWA layer at sequence length L reads positions ``>= L - sliding_window``,
    and a step frees the SWA pages below ``floor_page(L - sliding_window)``,
    L being the length when the step begins. A *model's* window W_model
    (Hugging Face ``config.sliding_window``, transformers' mask) lets a query
    at position t attend to keys ``t - W_model + 1 .. t``: W_model keys,
    itself included. The newest query of a step is at position L, so the
    oldest key it reads is ``L - W_model + 1``, and the allocator's window is
    ``sliding_window = W_model - 1``, the smallest that never frees a key the
    model still reads (SGLang applies the same ``- 1``). Worked example:
    W_model = 4096 gives ``sliding_window = 4095``; at L = 10000 the query at
    10000 reads keys 5905..10000, and the step frees only below
    ``floor_page(10000 - 4095) = floor_page(5905)``. ``sliding_window = 4096``
    would also be safe, but keeps one token more than needed; 4094 would (at
    page_size 1) free key 5905 while it is read (``tests/examples/test_examples.py`` checks that it
    changes the model's output). :meth:`for_engine` and the constructor take W_model.

    **A window past the context** (``model_window > max_context_len``) is accepted and
    clamped: ``sliding_window = min(W - 1, max_context_len)``, ``model_window`` kept as given
    (``describe()`` names the rule). No request ever grows past its window, so nothing is
    ever evicted and SWA layers keep every position (they read like full attention), as
    with the unclamped window; the clamp makes the sizes that follow from the window (the
    SWA pages one request needs, a ring's pages, :meth:`for_engine`'s SWA pool) those of
    the context. Engines derive the window from the model and the context from the
    deployment, so this is a real configuration (a 4096-token window served at 2048
    tokens), not a mistake; it costs SWA pages for every position.

    **Pools that can serve one request.** In pool mode an SWA pool smaller than one
    request's window, ``num_swa_pages < min(ceil(sliding_window / page_size) + 1, P)``, is
    refused: a request reaching its window would need more SWA pages than exist, and no
    eviction could free them (the window still reads them). ``P`` (below) caps the need
    when requests are shorter than the window. ``backend="triton"`` on a CPU device is
    refused unless the kernels run in the Triton interpreter (``TRITON_INTERPRET=1`` set
    before graphalloc is imported).

    **Frozen shape.** The ``max_*`` fields freeze the step descriptor, so a
    captured graph never sees a new shape: a step that needs more rows, pages
    or tokens is refused with :class:`~graphalloc.errors.BatchTooLargeError`.
    A step can be split; one request's release cannot (it frees everything the
    request owns in one step), so no config may be too small to release a
    request that allocation let grow. With ``ps = page_size``,
    ``c = max_pages_per_row``, ``R = swa_ring_pages`` and
    ``P = min(ceil(max_context_len / ps), num_full_pages)`` (the most FULL
    pages one request can own), a release (``planner.StepBuilder.release``)
    with protected prefix p and frontier f writes::

        [p, f)               FULL only       b = (f - p) / ps pages  ceil(b / c) rows
        [f, ceil_page(L))    FULL and SWA    a pages, a + b <= P     ceil(a / c) rows
        ring mode            ring return     R pages                 ceil(R / c) rows

    Page lanes: ``a + b + R <= P + R``, reached at L = max_context_len, p = 0:
    ``min_step_pages = P + R``. Rows: for b >= 1, ``ceil(b / c) = 1 +
    floor((b - 1) / c)`` and ``floor(x) + ceil(y) <= ceil(x + y)``, so
    ``ceil(b / c) + ceil((P - b) / c) <= 1 + ceil((P - 1) / c)`` (b = 0 gives
    ``ceil(P / c)``, no more), reached with the frontier one page in:
    ``min_release_rows = 1 + ceil((P - 1) / c) + [ring] ceil(R / c)``. A config
    below either is refused with :class:`~graphalloc.errors.ConfigError`. Any
    single request's window eviction (at most P pages, ``ceil(P / c)`` rows)
    then fits too.

    **Defaults** (a 0 shape field): ``max_pages_per_row = ceil(max_context_len /
    ps)``; ``max_release_rows = max(3 * max_reqs, min_release_rows)``;
    ``max_alloc_rows = max_reqs``; ``max_tokens_per_alloc_row = min(max_context_len,
    max_step_tokens)`` (``max_context_len`` when ``max_step_tokens`` is 0 too);
    ``max_step_pages = num_full_pages + num_swa_pages`` (every page a step can
    free: a lane frees a live FULL page or evicts a live SWA page);
    ``max_step_tokens = max_alloc_rows + max_tokens_per_alloc_row``. They come
    from the pools and ``max_reqs``, not from a workload; :meth:`for_engine`
    derives them from an engine's budgets instead. A ``max_tokens_per_alloc_row`` above
    ``max_step_tokens`` is refused (such a row could never fit a step).
    :meth:`describe` prints the shapes and where each came from.

    Args:
        page_size: tokens per page (any positive integer).
        num_full_pages: usable FULL pages (page 0 excluded).
        num_swa_pages: usable SWA pages (page 0 excluded).
        max_reqs: rows of ``req_to_token``.
        max_context_len: columns of ``req_to_token`` (positions per request).
        sliding_window: deprecated input: the allocator's window (W - 1), in tokens; derived
            from ``model_window`` (convention above) and always set after construction.
        index_dtype: ``torch.int32`` or ``torch.int64`` for slots and page ids on the device.
        device: where the device tables live: ``"cpu"`` (runs everything eagerly) or an
            available CUDA device.
        backend: ``"torch"`` (reference) or ``"triton"``.
        swa_ring_pages: 0 for pool mode; R > 0 gives each request a fixed ring of R SWA
            pages (needs ``ceil(sliding_window / page_size) + 1 <= R <= num_swa_pages``).
        max_release_rows: release/evict segment rows per step.
        max_pages_per_row: pages in one release row (longer segments are split).
        max_alloc_rows: allocation rows (requests allocating) per step.
        max_tokens_per_alloc_row: tokens one request may allocate in one step.
        max_step_pages: page lanes freed in one step, all release rows together.
        max_step_tokens: tokens allocated in one step, all allocation rows together.
        validate: device-side validation inside the kernels (debug; off by default).
        max_handles: prefix-sharing handles (pool mode); 0 turns sharing off.
        num_state_slots: recurrent-state slots (Mamba, linear attention): a slot per request,
            one per prefix-cache snapshot, ``1 + k`` per speculative step in flight; 0: none.
        max_spec_tokens: deprecated input (1 + k); always set after construction to
            ``1 + num_lookahead_tokens``: the tokens of one speculative step (the verified
            one and k drafts), each of which gets a state slot.
        model_window: the model's sliding window W in tokens, as Hugging Face's
            ``config.sliding_window`` (a keyword; the convention above).
        num_lookahead_tokens: k, the most draft tokens one speculative decode row carries
            (``step(decode=, lookahead=k)``; vLLM's ``num_speculative_tokens``); it sizes the
            state slots of a speculative step (``1 + k``). ``None``: the state layer's
            (``RecurrentState.max_spec_tokens - 1``), else 7; always set after construction.

    Every field is checked when the config is built: counts must be ints (numpy
    integers are accepted and stored as ``int``; bools are refused), ``validate`` a
    bool, and every rule above holds, or :class:`~graphalloc.errors.ConfigError`
    names the rule, the value and the fix.
    """

    page_size: int
    num_full_pages: int | None = None  # deprecated input (layers=); always set after init
    num_swa_pages: int | None = None  # deprecated input (layers=); always set after init
    max_reqs: int | None = None
    max_context_len: int | None = None
    sliding_window: int | None = None  # deprecated input (W - 1); always set after init
    index_dtype: torch.dtype = torch.int64
    device: str | torch.device = "cpu"
    backend: str = "torch"
    swa_ring_pages: int | None = None  # deprecated input (layers=); 0: pool mode
    max_release_rows: int = 0  # 0: max(3 * max_reqs, min_release_rows)
    max_pages_per_row: int = 0  # 0: pages of max_context_len
    max_alloc_rows: int = 0  # 0: max_reqs
    max_tokens_per_alloc_row: int = 0  # 0: min(max_context_len, max_step_tokens or inf)
    max_step_pages: int = 0  # 0: num_full_pages + num_swa_pages
    max_step_tokens: int = 0  # 0: max_alloc_rows + max_tokens_per_alloc_row
    validate: bool = False
    max_handles: int = 0  # prefix-sharing handles (pool mode); 0: sharing off
    num_state_slots: int | None = None  # deprecated input (layers=); 0: no state slots
    max_spec_tokens: int | None = None  # deprecated input (1 + k); always 1 + num_lookahead_tokens
    model_window: int | None = None  # the model's window W (Hugging Face); sets sliding_window
    layers: tuple | None = None  # the model's layer kinds (graphalloc.pools.layers)
    num_lookahead_tokens: int | None = None  # k draft tokens per speculative step (1 + k slots)

    def __post_init__(self) -> None:
        def fix(name: str, value) -> None:
            object.__setattr__(self, name, value)

        where = "AllocatorConfig: "
        for name in ("page_size", "max_reqs", "max_context_len"):
            if getattr(self, name) is None:
                raise ConfigError(f"{where}{name} must be an int >= 1, got None (it is "
                                  "required)")
            fix(name, _as_int(where, name, getattr(self, name), 1))
        fix("max_handles", _as_int(where, "max_handles", self.max_handles, 0,
                                   "0 turns prefix sharing off"))
        fix("max_spec_tokens", _lookahead(where, self.num_lookahead_tokens, self.max_spec_tokens))
        layers = resolve_layers(self, where)
        fix("layers", layers)
        pools = build_pools(layers)
        _remember_pools(self, pools)
        window, state = pools.window, pools.state
        fix("num_full_pages", pools.full.num_pages)
        fix("num_swa_pages", window.num_pages)
        fix("swa_ring_pages", window.ring_pages)
        fix("model_window", window.rule.model_window if window.has_window else None)
        tokens = window.rule.tokens if window.has_window else None
        if tokens is not None and window.rule.kind == "window":  # a window past the context:
            tokens = min(tokens, self.max_context_len)  # clamped (the class docstring)
        fix("sliding_window", tokens)
        fix("num_state_slots", state.num_slots)
        fix("max_spec_tokens", state.max_spec_tokens if state.has_states else
            (_as_int(where, "max_spec_tokens", self.max_spec_tokens or 0, 0, "0 picks 8") or 8))
        fix("num_lookahead_tokens", self.max_spec_tokens - 1)
        if self.max_handles and self.swa_ring_pages:
            raise ConfigError(f"{where}max_handles={self.max_handles} with swa_ring_pages="
                              f"{self.swa_ring_pages}: prefix sharing needs pool mode (a ring "
                              "keeps each request's window to itself); use one or the other")
        for name in _SHAPE_FIELDS:
            fix(name, _as_int(where, name, getattr(self, name), 0, "0 picks the default"))
        if not isinstance(self.validate, (bool, np.bool_)):
            raise ConfigError(f"{where}validate must be a bool, got {self.validate!r}; pass "
                              "validate=True (device-side checks, debug) or False")
        fix("validate", bool(self.validate))
        if not isinstance(self.index_dtype, torch.dtype) or self.index_dtype not in (
                torch.int32, torch.int64):
            raise ConfigError(f"{where}index_dtype must be torch.int32 or torch.int64, got "
                              f"{self.index_dtype!r}; pass the torch dtype itself")
        if not isinstance(self.backend, str) or self.backend not in ("torch", "triton"):
            raise ConfigError(f"{where}backend must be 'torch' (the reference) or 'triton', "
                              f"got {self.backend!r}; a GPU without Triton takes 'torch'")
        fix("device", _as_device(self.device))
        max_slot = (max(self.num_full_pages, self.num_swa_pages,
                        *(x.num_pages for x in self.pools.extras)) + 1) * self.page_size
        if self.index_dtype == torch.int32 and max_slot >= 2**31:
            raise ConfigError(f"{where}{max_slot} slots do not fit int32 indices; use "
                              "index_dtype=torch.int64")
        ps, ring = self.page_size, self.swa_ring_pages
        window = self.pools.window
        if not window.has_window:
            pass
        elif ring:
            reach = min(window.rule.reach, self.max_context_len)  # a window past the context
            need = _ceil_div(reach, ps) + 1
            if ring < need:
                raise ConfigError(
                    f"{where}swa_ring_pages={ring} cannot hold a window of "
                    f"{reach} tokens at page_size {ps}: need >= {need} "
                    "(ceil(sliding_window / page_size) + 1); raise swa_ring_pages or use pool "
                    "mode (0)")
            if ring > self.num_swa_pages:
                raise ConfigError(
                    f"{where}swa_ring_pages={ring} exceeds num_swa_pages="
                    f"{self.num_swa_pages}: no request could ever be admitted (each takes a "
                    f"ring of {ring} SWA pages); use num_swa_pages >= {ring}")
        else:
            window_pages = _ceil_div(window.rule.reach, ps) + 1
            need = window.min_pages(ps, self.request_pages)
            if self.num_swa_pages < need:
                raise ConfigError(
                    f"{where}num_swa_pages={self.num_swa_pages} cannot hold one request's "
                    f"window: a request at its window of {window.rule.reach} tokens holds "
                    f"up to {window_pages} SWA pages of {ps} (ceil(sliding_window / "
                    f"page_size) + 1), and {need} when capped by the pages one request can own "
                    f"({self.request_pages}); no eviction frees them while the window reads "
                    f"them. Use num_swa_pages >= {need}, a smaller sliding_window or a larger "
                    "page_size")
        for extra in self.pools.extras:  # a further window pool, as the first one
            need = extra.min_pages(ps, self.request_pages)
            if extra.num_pages < need:
                raise ConfigError(
                    f"{where}{self.layers[_layer_of(self, extra.index)]!r}: {extra.num_pages} "
                    f"pages cannot hold one request's window of {extra.rule.reach} tokens: it "
                    f"holds up to {need} pages of {ps} (ceil(window / page_size) + 1, capped "
                    f"by the {self.request_pages} pages one request can own). Use num_pages "
                    f">= {need}")
        if self.backend == "triton" and self.device.type == "cpu":
            from .kernels import interpreted

            if not interpreted():
                raise ConfigError(
                    f"{where}backend='triton' on device='cpu' needs the Triton interpreter, "
                    "and the kernels were defined for a GPU. Set TRITON_INTERPRET=1 in the "
                    "environment before importing graphalloc (the interpreter is chosen when "
                    "the kernels are defined), or use backend='torch' (the reference twins "
                    "run anywhere)")
        self._resolve_shapes()

    def _resolve_shapes(self) -> None:
        """Fill the 0 (default) shape fields, then refuse shapes a step can never meet."""
        where, origin = "AllocatorConfig: ", {}

        def default(name: str, value: int, rule: str) -> None:
            if getattr(self, name):
                origin[name] = "given"
            else:
                object.__setattr__(self, name, value)
                origin[name] = f"default: {rule}"

        if self.model_window is not None and self.sliding_window != self.model_window:
            origin["sliding_window"] = _window_rule(self.model_window, self.max_context_len)
        given_tokens = self.max_step_tokens
        default("max_pages_per_row", self.pages_per_request, "ceil(max_context_len / page_size)")
        need_rows, need_pages = self.min_release_rows, self.min_step_pages
        default("max_release_rows", max(3 * self.max_reqs, need_rows),
                "max(3 x max_reqs, min_release_rows)")
        default("max_alloc_rows", self.max_reqs, "max_reqs")
        default("max_tokens_per_alloc_row",
                min(self.max_context_len, given_tokens) if given_tokens else self.max_context_len,
                "min(max_context_len, max_step_tokens)")
        default("max_step_pages", self.num_full_pages + self.num_swa_pages,
                "num_full_pages + num_swa_pages")
        default("max_step_tokens", self.max_alloc_rows + self.max_tokens_per_alloc_row,
                "max_alloc_rows + max_tokens_per_alloc_row")
        _remember_origins(self, origin)
        if self.max_tokens_per_alloc_row > self.max_step_tokens:
            raise ConfigError(
                f"{where}max_tokens_per_alloc_row={self.max_tokens_per_alloc_row} exceeds "
                f"max_step_tokens={self.max_step_tokens}: a row that long could never fit a "
                "step. Lower max_tokens_per_alloc_row to at most max_step_tokens (or leave it "
                "0 to get min(max_context_len, max_step_tokens))")
        why = (f"one request can own {self.request_pages} FULL pages "
               f"(min(ceil(max_context_len {self.max_context_len} / page_size "
               f"{self.page_size}), num_full_pages {self.num_full_pages}))")
        ring_note = f" plus its {self.swa_ring_pages} ring pages" if self.ring_mode else ""
        if self.max_release_rows < need_rows:
            raise ConfigError(
                f"{where}max_release_rows={self.max_release_rows} is below the {need_rows} "
                f"rows that releasing one request can need: {why}, split at the frontier "
                f"into a FULL-only and a FULL+SWA segment{ring_note}, in rows of at most "
                f"max_pages_per_row={self.max_pages_per_row} pages (1 + ceil((P - 1) / c)"
                f"{' + ceil(R / c)' if self.ring_mode else ''}). Such a request could never "
                f"be released. Use max_release_rows >= {need_rows}, a larger "
                "max_pages_per_row, or a smaller max_context_len")
        if self.max_step_pages < need_pages:
            raise ConfigError(
                f"{where}max_step_pages={self.max_step_pages} is below the {need_pages} page "
                f"lanes that releasing one request can need: {why}{ring_note}, all freed in "
                f"its one release step. Such a request could never be released. Use "
                f"max_step_pages >= {need_pages}, or a smaller max_context_len")

    # ---- derived quantities ------------------------------------------------------------
    @property
    def pools(self) -> Pools:
        """The model's pools (:mod:`graphalloc.pools`), built once from :attr:`layers`."""
        return _POOLS[id(self)]

    @property
    def ring_mode(self) -> bool:
        return self.swa_ring_pages > 0

    @property
    def pages_per_request(self) -> int:
        """Most pages one request's positions span: ``ceil(max_context_len / page_size)``."""
        return -(-self.max_context_len // self.page_size)

    @property
    def request_pages(self) -> int:
        """Most FULL pages one request can own (P): ``min(pages_per_request,
        num_full_pages)``."""
        return min(self.pages_per_request, self.num_full_pages)

    @property
    def min_release_rows(self) -> int:
        """Release rows one request's release can need:
        ``1 + ceil((P - 1) / max_pages_per_row)`` (+ ``ceil(R / max_pages_per_row)`` in ring
        mode). ``max_release_rows`` is at least this."""
        return _release_need(self.request_pages, self.swa_ring_pages,
                             self.max_pages_per_row or self.pages_per_request)[0]

    @property
    def min_step_pages(self) -> int:
        """Page lanes one request's release can need: ``P + swa_ring_pages``.
        ``max_step_pages`` is at least this."""
        return self.request_pages + self.swa_ring_pages

    @property
    def num_full_slots(self) -> int:
        """Length of ``full_to_swa``: ``(num_full_pages + 1) * page_size``."""
        return (self.num_full_pages + 1) * self.page_size

    @property
    def has_states(self) -> bool:
        """Whether requests hold recurrent-state slots (``num_state_slots > 0``)."""
        return self.num_state_slots > 0

    @property
    def max_state_rows(self) -> int:
        """State rows of one step's descriptor: a slot write per request row and handle, a
        copy per handle taken and per request admitted on one, the newest speculative step's
        slots of each request row (a decode's, or what a trim leaves), six per row (0
        without state slots)."""
        if not self.num_state_slots:
            return 0
        per_step = -(-self.max_spec_tokens // 6)  # six slots per speculative row
        return 2 * (self.max_reqs + self.max_handles) + self.max_reqs * per_step

    def frozen_shapes(self) -> dict[str, int]:
        """Every shape a captured step graph freezes: ``req_to_token``'s ``max_reqs`` x
        ``max_context_len`` and the six descriptor shapes (``max_release_rows`` ...
        ``max_step_tokens``), as plain ints."""
        return {"max_reqs": self.max_reqs, "max_context_len": self.max_context_len,
                **{name: getattr(self, name) for name in _SHAPE_FIELDS}}

    def describe(self) -> str:
        """A short markdown table of the pools, the window and the frozen shapes, each with
        the rule it came from (``given``, a constructor default, or a :meth:`for_engine`
        formula with its numbers). No side effects."""
        origin = _ORIGINS.get(id(self), {})
        mode = (f"ring mode, {self.swa_ring_pages} SWA pages per request" if self.ring_mode
                else "pool mode")
        rows = [("num_full_pages", self.num_full_pages), ("num_swa_pages", self.num_swa_pages),
                ("model_window", self.model_window), ("sliding_window", self.sliding_window),
                *self.frozen_shapes().items()]
        if self.max_handles:
            rows.append(("max_handles", self.max_handles))
        if self.num_state_slots:
            rows += [("num_state_slots", self.num_state_slots),
                     ("num_lookahead_tokens", self.num_lookahead_tokens),
                     ("max_spec_tokens", self.max_spec_tokens),
                     ("max_state_rows", self.max_state_rows)]
        window = self.pools.window
        lines = [f"AllocatorConfig: page_size {self.page_size}, {mode}, backend {self.backend} "
                 f"on {self.device}, {str(self.index_dtype).replace('torch.', '')} indices",
                 f"layers: {', '.join(map(repr, self.layers))}"
                 + (f" ({window.rule.describe()})" if window.has_window else
                    " (no window layers)"),
                 "", "| shape | value | rule |", "|---|---:|---|"]
        lines += [f"| {name} | {value} | {origin.get(name, 'given')} |" for name, value in rows]
        lines += ["", f"Releasing one request needs at most {self.min_release_rows} release "
                      f"rows and {self.min_step_pages} page lanes (P = {self.request_pages})."]
        if self.pools.extras:
            lines += ["", "Further window pools (their own frontiers, free rings, release and "
                      "allocation sections of the shapes above; planned by the numpy planner, "
                      "the compiled one plans one window pool):"]
            lines += [f"- {extra.describe()}" for extra in self.pools.extras]
        return "\n".join(lines)

    # ---- the engine's constructor ------------------------------------------------------
    for_engine = classmethod(_for_engine)


# The pools of each live config, keyed by id() and dropped with it (kept out of the instance
# so its __dict__ stays its fields, as _ORIGINS).
_POOLS: dict[int, Pools] = {}


def _remember_pools(cfg: AllocatorConfig, pools: Pools) -> None:
    if id(cfg) not in _POOLS:
        weakref.finalize(cfg, _POOLS.pop, id(cfg), None)
    _POOLS[id(cfg)] = pools


def _layer_of(cfg: AllocatorConfig, index: int) -> int:
    """Position in ``cfg.layers`` of window pool ``index`` (window layers in order)."""
    return [i for i, x in enumerate(cfg.layers) if role_of(x) == "window"][index]
