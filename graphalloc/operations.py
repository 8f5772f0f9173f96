"""What the allocator's public methods do: each operation as a Step, the blocks, the
queries that are dry runs, the sanctioned sync points.

:class:`graphalloc.HybridAllocator` delegates here one line per method; these functions use
only its parts (``config``, ``ledger``, ``pipeline``, ``group``, ``recorder``, ...). Rules
they add to the planner's: a free inside an open ``free_group()`` is recorded, not run; a
direct mutation inside an open ``scheduler_step()`` is refused (``RecorderError``);
``commit`` / ``trim`` / ``plan()`` and frees through ``step()`` inside a free group are
refused (``NestedGroupError``); a single free is never refused for size (split over
consecutive steps); a single operation refuses ``None`` for the rows or handles it acts on
(``release(None)`` would do nothing; ``evict_window(None)`` alone means every row). Cost:
each function costs the plan (or dry run) it makes; O(1) otherwise unless stated.
"""

from __future__ import annotations

import contextlib

import torch

from .config import AllocatorConfig
from .device.buckets import grid_of
from .device.executor import lanes_of, states_of
from .diagnostics import checkpoint, integrity
from .diagnostics.sync_points import sync_allowed
from .errors import (
    BatchTooLargeError,
    CapacityError,
    ConfigError,
    ContractError,
    NestedGroupError,
    PendingStepError,
    PositionError,
    RecorderError,
    UnknownHandleError,
    UnknownRequestError,
)
from .inputs import as_index, as_rows, one_handle
from .plan.refusals import (
    SHAPE_WINDOW_PAGES,
    SHAPE_WINDOW_ROWS,
    Kind,
    Refusal,
    RefusalCode,
    to_error,
)
from .plan.step import Step, step_from
from .sharing.page_keys import KEY_HASHES
from .state.free_ids import lowest_free
from .state.queries import HandleInfo

__all__ = ["HandleInfo"]

_FREE_KINDS = ("release", "accept", "commit", "trim", "evict", "advance", "drop", "drop_swa")


def check_arguments(config, n_descriptor_bufs, fused_step, prefix_cache, page_tables) -> None:
    if not isinstance(config, AllocatorConfig):
        raise ConfigError(f"HybridAllocator takes an AllocatorConfig, got "
                          f"{type(config).__name__}")
    if isinstance(n_descriptor_bufs, bool) or not isinstance(n_descriptor_bufs, int) or (
            n_descriptor_bufs < 1):
        raise ConfigError(f"n_descriptor_bufs must be an int >= 1, got {n_descriptor_bufs!r}")
    if not isinstance(fused_step, bool):
        raise ConfigError(f"fused_step must be a bool, got {fused_step!r}")
    key_hash_of(prefix_cache)
    from .attention.spec import PageTableSpec

    if page_tables is not None and not isinstance(page_tables, PageTableSpec):
        raise ConfigError(f"page_tables takes a PageTableSpec (or None), got "
                          f"{type(page_tables).__name__}")
    if prefix_cache and (not config.pools.window.shares or config.max_handles == 0):
        raise ConfigError("prefix_cache=True needs pool mode and max_handles > 0 (each cache "
                          "entry is a handle)")


def key_hash_of(prefix_cache) -> str:
    """The page-key hash a ``prefix_cache=`` argument names: ``True`` -> ``"siphash"``,
    ``"siphash"`` / ``"blake2b"`` as they are (``False``: ``""``, no cache); else
    ``ConfigError``."""
    if isinstance(prefix_cache, bool):
        return "siphash" if prefix_cache else ""
    if isinstance(prefix_cache, str) and prefix_cache in KEY_HASHES:
        return prefix_cache
    raise ConfigError(f"prefix_cache must be a bool or a page-key hash {KEY_HASHES}, got "
                      f"{prefix_cache!r}")


# ---- the blocks' rules -----------------------------------------------------------------------
def recorder_open(what: str) -> RecorderError:
    return RecorderError(f"{what}() while a scheduler_step() block is open: it would run as a "
                         f"step of its own before the block's. Record it on the block "
                         f"(it.{what}(...)) or call it after the block")


def guard(alloc, what: str) -> None:
    if alloc.recorder is not None:
        raise recorder_open(what)


def no_group(alloc, what: str) -> None:
    guard(alloc, what)
    if alloc.group is not None:
        raise NestedGroupError(f"{what} inside free_group(): it shortens a request that the "
                               f"block's deferred frees may still read; {what} before or "
                               "after the block")


def step_of(alloc, step, kinds: dict, what: str, *, free_ok: bool, mutates: bool = True,
            plan: bool = False) -> Step:
    """The Step a call names (a Step, or its keywords), after the blocks' rules."""
    if mutates:
        guard(alloc, what)
    if step is None:
        try:
            step = Step(**kinds)
        except TypeError:  # an unknown kind: its typed error (step_from), else as raised
            step_from(None, kinds, what)
            raise
    elif kinds or not isinstance(step, Step):
        step_from(step, kinds, what)  # raises
    if alloc.group is not None:
        if plan:
            raise NestedGroupError("plan() inside free_group(): the block defers frees to its "
                                   "end; use step() (it runs at once) or plan after the block")
        if not free_ok and any(k in _FREE_KINDS or k == "evict_all" for k in step.kinds()):
            raise NestedGroupError("frees through step() inside free_group(): call release() "
                                   "/ evict_window() / advance_frontier() / drop_handle() "
                                   "(deferred to the block's end) instead")
    return step


def idle(alloc, what: str) -> None:
    """``reset_faults()`` / ``recover()`` run with no block open."""
    guard(alloc, what)
    if alloc.group is not None:
        raise NestedGroupError(f"{what}() inside free_group(): close the block first")


def dry_run(alloc, step, use_group, oversize):
    if not isinstance(step, Step):
        raise ContractError(f"dry_run() takes a Step, got {type(step).__name__}")
    for name, value in (("use_group", use_group), ("oversize", oversize)):
        if not isinstance(value, bool):
            raise ContractError(f"dry_run({name}=...) takes a bool, got {value!r}")
    return alloc.pipeline.outcome(step, dry_run=True, use_group=use_group, oversize=oversize)


def is_shortage(exc: ContractError) -> bool:
    refusal = getattr(exc, "refusal", None)
    return refusal is not None and RefusalCode(refusal[0]).shortage


def try_step(alloc, step: Step):
    try:
        planned = alloc.pipeline.plan(step)
    except ContractError as exc:
        if is_shortage(exc):
            return None
        raise
    return alloc.pipeline.run(planned)


def fits(alloc, step: Step) -> bool:
    try:
        alloc.dry_run(step)
    except ContractError as exc:
        if is_shortage(exc):
            return False
        raise
    return True


@contextlib.contextmanager
def grouping(alloc):
    from .plan.free_group import FreeGroup

    guard(alloc, "free_group")
    if alloc.group is not None:
        raise NestedGroupError("free_group() blocks cannot be nested; close the outer block "
                               "first")
    alloc.pipeline.refuse_planning()
    group = alloc.group = FreeGroup(alloc)
    pipeline = alloc.pipeline
    pipeline.masks = group  # its released rows and dropped handles: the planner refuses them
    try:
        yield
    finally:
        alloc.group = None
        pipeline.masks = None
    if group.recorded:
        run_frees(alloc, group.to_step())


def run_frees(alloc, step: Step) -> None:
    """Run a step of frees; when its release rows exceed the frozen shape, plan it past the
    shape and run it as one transaction over consecutive launches
    (:meth:`~graphalloc.plan.pipeline.StepPipeline.run_split`; a model's further window
    pools' release sections are split the same way, part i of each in launch i)."""
    try:
        alloc.pipeline.run(alloc.pipeline.plan(step))
        return
    except BatchTooLargeError as exc:
        refusal = getattr(exc, "refusal", None)
        if refusal is None or refusal[0] != 35 or refusal[2] not in _RELEASE_SHAPES:
            raise
    alloc.pipeline.run_split(step)


# STEP_OVER_SHAPE's shapes a split free lifts: release rows and freed pages, of the main
# section and of a further window pool's
_RELEASE_SHAPES = (0, 1, SHAPE_WINDOW_ROWS, SHAPE_WINDOW_PAGES)


def given(value, what: str, error: type[ContractError]) -> None:
    """A single operation names what it acts on: ``None`` there is refused (in a Step, a
    kind set to ``None`` is absent; a call like ``release(None)`` would silently do
    nothing)."""
    if value is None:
        noun = "handles" if error is UnknownHandleError else "request rows"
        raise error(f"{what}: got None; pass the {noun} (an empty list for none)")


def free(alloc, kind: str, value) -> None:
    """A single free: recorded in an open free group, else one step (split if too big)."""
    what = {"evict": "evict_window", "advance": "advance_frontier", "drop": "drop_handle",
            "drop_swa": "drop_handle_swa"}.get(kind, kind)
    guard(alloc, what)
    if kind in ("release", "drop", "drop_swa"):
        given(value, what, UnknownRequestError if kind == "release" else UnknownHandleError)
    if kind in ("drop", "drop_swa"):
        one_handle(value, what)
    group = alloc.group
    if group is not None:
        if kind == "release":
            group.release(value)
        elif kind == "evict":
            group.evict(value)
        elif kind == "advance":
            group.advance(*value)
        else:
            group.drop(value, swa_only=kind == "drop_swa")
        return
    if kind == "evict":
        step = Step(evict_all=True) if value is None else Step(evict=value)
    else:
        step = Step(**{kind: value})
    run_frees(alloc, step)


def free_row(alloc, reserved=()) -> int:
    group = alloc.group
    if isinstance(reserved, (list, tuple)) and not reserved:
        reserved = None
    else:
        reserved = as_rows(reserved, alloc.config.max_reqs, "free_row reserved rows")
    live = alloc.ledger.live
    row = lowest_free(live, reserved) if group is None else group.free_row(live, reserved)
    if row < 0:
        raise to_error(Refusal(RefusalCode.NO_FREE_ROW, Kind.ADMIT, -1, 0,
                               alloc.config.max_reqs))
    return row


def admit(alloc, handle, n_tokens) -> int:
    guard(alloc, "admit")
    if handle is None and n_tokens is not None:
        raise PositionError("admit(n_tokens=...) shares that much of a handle: pass handle= "
                            "too (a plain admit starts empty)")
    row = free_row(alloc)
    if handle is None:
        alloc.step(admit=[row])
    else:
        alloc.step(admit_on=([row], [handle], [-1 if n_tokens is None else n_tokens]))
    return row


def take_handle(alloc, row, n_tokens) -> int:
    guard(alloc, "take_handle")
    led = alloc.ledger
    if led.n_handles == 0:
        raise CapacityError("take_handle: the allocator has no handle slots; build it with "
                            "AllocatorConfig(max_handles=...)")
    group = alloc.group
    h = lowest_free(led.h_live) if group is None else group.free_handle(led.h_live)
    if h < 0:
        raise CapacityError(f"take_handle: all {led.n_handles} handles are held; drop one "
                            "first")
    alloc.step(take=([h], [row], [n_tokens]))
    return h


def load_back(alloc, row, new_frontier_pos) -> torch.Tensor:
    guard(alloc, "load_back")
    group = alloc.group
    if group is not None:
        r = as_rows(row, alloc.config.max_reqs, "load_back row")
        if len(r) == 1 and group.released[r[0]]:
            raise UnknownRequestError(f"load_back: request {int(r[0])} is released in the "
                                      "open free_group(): it is pending release, not live")
        if len(r) == 1 and group.touched(int(r[0])):
            raise NestedGroupError(f"load_back: request {int(r[0])}'s frontier moves in the "
                                   "open free_group(); load it back after the block")
    result = alloc.step(load_back=([row], [new_frontier_pos]))
    return result.swa_slots[int(result.first_lane[0]):]


def launch(alloc, buffer_index, fusable, n_rows) -> None:
    """``fusable=True`` (only for steps whose ``PlannedStep.fusable`` is set) makes the step
    one fused launch; ``n_rows``: ``(n_release_rows, n_alloc_rows)`` or a ``StepGrid`` --
    rows past a step's are padding, so a launch captured for R and A rows serves every
    step with ``p.fits_rows(R, A)``; None launches every row inside a capture and exactly
    the pending step's rows outside one (which runs the pending step only)."""
    index = as_index(buffer_index, "buffer_index", len(alloc.ring))
    if not isinstance(fusable, bool):
        raise ContractError(f"fusable must be a bool, got {fusable!r}")
    grid = grid_of(alloc.config, n_rows)
    capturing = alloc.config.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not capturing:
        pending = alloc.pending
        if pending is None or pending.buffer_index != index:
            raise PendingStepError(
                f"launch({index}) outside a graph capture runs only the pending planned "
                f"step's buffer ({'none pending' if pending is None else pending.buffer_index})"
                "; plan() first, and launch the buffer its PlannedStep names")
        if fusable and not pending.fusable:
            raise ContractError("launch(fusable=True) for a step the planner did not mark "
                                "fusable: its pops may read this step's pushes")
        if grid is None:
            grid = alloc.kernels.grids.exact(pending.n_release_rows, pending.n_alloc_rows,
                                             pending.n_tokens)
        elif not pending.fits_rows(grid.n_release_rows, grid.n_alloc_rows):
            raise BatchTooLargeError(
                f"launch(n_rows={n_rows!r}): the pending step has {pending.n_release_rows} "
                f"release and {pending.n_alloc_rows} allocation rows; launch at least that "
                "many (PlannedStep.fits_rows tells which captured launch fits)")
        counts = pending.state_counts
        if grid.n_programs == 0:
            if counts:
                alloc.kernels.launch_states(alloc.ring.state_rows(index), counts)
            return
    else:
        counts = None  # a capture: the state kernels' fixed programs
    alloc.kernels(alloc.ring.release_rows(index), alloc.ring.alloc_rows(index),
                  fusable=fusable, grid=grid, lane_rows=lanes_of(alloc.parts, index),
                  state_rows=states_of(alloc.parts, index), state_counts=counts,
                  staged=True if capturing else None)  # (a graph stages its rows)


# ---- queries that are dry runs ---------------------------------------------------------------
def pages_released(alloc, rows, advance, handles) -> tuple[int, int]:
    """Inside an open free group it counts what these frees add to the block's (rows
    released and handles dropped in it are refused, as a second free would be)."""
    query = Step(release=rows, advance=advance, drop=handles)
    out = alloc.dry_run(query, oversize=True)
    if alloc.group is None:
        return out.pages_freed
    block = alloc.group.to_step()
    merged = alloc.group.merged_with(query)
    base = alloc.dry_run(block, use_group=False, oversize=True).pages_freed
    both = alloc.dry_run(merged, use_group=False, oversize=True).pages_freed
    return both[0] - base[0], both[1] - base[1]


def handle_info(alloc, handle) -> HandleInfo:
    frees_full, frees_swa = pages_released(alloc, (), None, [handle])
    led, ps = alloc.ledger, alloc.config.page_size
    h = int(handle)
    n, start = int(led.h_len[h]), int(led.h_swa_start[h])
    return HandleInfo(h, n, start, n // ps, (n - start) // ps, frees_full, frees_swa)


# ---- diagnostics ----------------------------------------------------------------------------
def stats(alloc) -> dict:
    out = alloc.queries.stats()
    out["steps_run"] = alloc.steps_run
    out["descriptor_stalls"] = alloc.ring.stalls
    cache = alloc.prefix_cache
    if cache is not None:
        out.update(cache.stats())
    return out


def snapshot(alloc) -> dict:
    return integrity.snapshot(alloc.parts)


def audit(alloc) -> list:
    return integrity.audit(alloc.parts)


def check_integrity(alloc) -> None:
    integrity.check_integrity(alloc.parts)


def state_dict(alloc) -> dict:
    with sync_allowed():
        return checkpoint.state_dict(alloc.parts, alloc.pipeline)


def load_state_dict(alloc, sd: dict) -> None:
    with sync_allowed():
        checkpoint.load_state_dict(alloc.parts, alloc.pipeline, sd)
