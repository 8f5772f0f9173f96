"""The state pool: recurrent-state slots -- who holds which slot, and the state rows
(slot-table writes, state copies) of a step. The planner asks :class:`StatePool` (or
:class:`NoStates`, a model without recurrent layers) at every step kind.

A model with recurrent layers (Mamba, gated delta-net, short convolutions) keeps one
fixed-size state per request instead of per-token KV. With ``num_state_slots`` S > 0 every
request holds one slot (the state after its committed tokens), every handle one snapshot
(the state after its n tokens), and every speculative step in flight one slot per token
(the state after that token). The pool is a host-only FIFO ring (``Ledger.state_ring``):
the host knows every slot id, so the device only receives explicit writes and copies
(``ST_SET`` / ``ST_COPY`` rows, :mod:`graphalloc.kernels.state`). Per kind::

    take h of r (n == C)     pop t; snapshot[h] = t; copy slot(r) -> t
    release r                push slot(r), then its speculative slots; slot(r) = 0
    commit r, n of step s    n >= 1: slot(r) = s[n - 1], push the old slot and the rest of
                             s; n == 0: push all of s (the state stays at C)
    trim r to L' >= C        push the slots of the speculative tokens cut
    drop h                   push snapshot[h] (a tombstone keeps it)
    admit r                  pop s; slot(r) = s (the model starts it from zero)
    admit r on h (n == h's)  pop s; slot(r) = s; copy snapshot[h] -> s
    decode r, lookahead k    pop 1 + k slots: the speculative step's, table row r
    decode / extend          nothing: the model updates slot(r) in place

Rules (refusals): a snapshot exists only where a state does -- a take at the request's
committed length C (code 41), an admit on all of a handle (40); a trim never goes below C
(42); the pool must hold the pops (43); a speculative step has at most ``max_spec_tokens``
tokens (44).

The device runs a step's copies in parallel, each reading the state as it was when the step
began (a handle taken in a step is used from the next step on: an admit on it in the same
step is refused before the states are planned, HANDLE_WRITTEN_THIS_STEP), and a slot that a
copy reads is never a copy's destination in that step (45, a shortage: only when the pool's
every other slot is taken; the slot is free next step). The table writes are one row per
index, the last write of the step (a row released and admitted again in one step ends with
its new slot). :func:`finish` builds the section.
Cost: O(rows + slots moved) numpy.
"""

from __future__ import annotations

import numpy as np

from ..device.layout import STATES
from ..kernels.abi import (
    ROW_WIDTH,
    ST_A,
    ST_B,
    ST_COPY,
    ST_KIND,
    ST_N_COPY,
    ST_N_TABLE,
    ST_SET,
    ST_SPEC,
    ST_SPEC_SLOTS,
)
from ..plan.refusals import Kind, Refusal, RefusalCode, kind_id

__all__ = ["StatePool", "NoStates", "pop", "push", "set_slot", "copy", "spec_index", "finish"]


def _rows(ctx, kind: int, a: np.ndarray, b: np.ndarray) -> None:
    out = np.zeros((len(a), ROW_WIDTH), dtype=np.int64)
    out[:, ST_KIND] = kind
    out[:, ST_A] = a
    out[:, ST_B] = b
    ctx.state_parts.append(out)


def need(ctx, n: int, kind: str, row: int = 0) -> None:
    """Refuse (43) unless the pool holds ``n`` more free slots (the prefix cache's offered
    entries dropped first, when the allocator owns one: their snapshots come back)."""
    free = ctx.ledger.states.n_free
    if n > free:
        ctx.reclaim_pages(0, 0, n)
        free = ctx.ledger.states.n_free
    if n > free:
        raise Refusal(RefusalCode.STATE_SLOTS_SHORT, kind_id(kind), row, n, free)


def pop(ctx, n: int) -> np.ndarray:
    """The next ``n`` free slots (the caller checked :func:`need`)."""
    led = ctx.ledger
    if not n:
        return np.zeros(0, dtype=np.int64)
    start = led.states.pop(n)
    return led.state_ring[(start + np.arange(n)) % led.states.capacity].copy()


def push(ctx, slots: np.ndarray) -> None:
    """Return ``slots`` (nonzero entries, in order) to the free ring."""
    slots = slots[slots != 0]
    if not len(slots):
        return
    led = ctx.ledger
    start = led.states.push(len(slots))
    ctx.journal.put(led.state_ring, (start + np.arange(len(slots))) % led.states.capacity,
                    slots)
    ctx.state_freed += len(slots)


def set_slot(ctx, index: np.ndarray, slots: np.ndarray) -> None:
    """``state_slot[index] = slots`` on the host and the device (``ST_SET`` rows; index:
    request rows, or ``max_reqs + h`` for handles)."""
    if len(index):
        ctx.journal.put(ctx.ledger.state_slot, index, slots)
        _rows(ctx, ST_SET, index, slots)


def copy(ctx, src: np.ndarray, dst: np.ndarray) -> None:
    """State copies ``src -> dst`` (``ST_COPY`` rows)."""
    if len(src):
        _rows(ctx, ST_COPY, src, dst)


def spec_index(ctx, rows: np.ndarray, n: np.ndarray) -> np.ndarray:
    """State-table indices of the first ``n[i]`` speculative slots of ``rows[i]``."""
    cfg = ctx.config
    base = cfg.max_reqs + cfg.max_handles + rows * cfg.max_spec_tokens
    return np.repeat(base, n) + (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))


def release(ctx, rows: np.ndarray) -> None:
    """The released rows' slots back to the pool: each row's own, then its speculative
    ones (oldest step first), rows in order."""
    led = ctx.ledger
    slots = np.concatenate([led.state_slot[rows][:, None],
                            led.spec_state[rows].reshape(len(rows), -1)], axis=1)
    push(ctx, slots.reshape(-1))
    set_slot(ctx, rows, np.zeros(len(rows), dtype=np.int64))
    ctx.journal.put(led.spec_state, rows, 0)


def commit(ctx, rows: np.ndarray, n: np.ndarray, oldest: np.ndarray) -> None:
    """Each row keeps the state after its last accepted token (a slot swap) and gives the
    rest of its oldest speculative step back; the next step moves up."""
    led = ctx.ledger
    step = led.spec_state[rows, 0]  # [rows, K]
    K = step.shape[1]
    keep = np.where(n > 0, step[np.arange(len(rows)), np.maximum(n - 1, 0)], 0)
    own = led.state_slot[rows]
    j = np.arange(K)[None, :]
    back = np.where((j < oldest[:, None]) & ~((j == (n - 1)[:, None]) & (n > 0)[:, None]),
                    step, 0)
    push(ctx, np.concatenate([np.where(n > 0, own, 0)[:, None], back], axis=1).reshape(-1))
    moved = n > 0
    set_slot(ctx, rows[moved], keep[moved])
    later = led.spec_state[rows, 1:].copy()
    shifted = np.zeros_like(led.spec_state[rows])
    shifted[:, :-1] = later
    ctx.journal.put(led.spec_state, rows, shifted)


def trim(ctx, rows: np.ndarray, new_len: np.ndarray) -> None:
    """Refuse a cut below the committed length (42: a state cannot be rolled back); give
    back the slots of the speculative tokens cut."""
    led = ctx.ledger
    committed = led.committed[rows]
    low = new_len < committed
    if low.any():
        i = int(np.flatnonzero(low)[0])
        raise Refusal(RefusalCode.STATE_TRIM_BELOW_COMMITTED, Kind.TRIM, int(rows[i]),
                      int(new_len[i]), int(committed[i]))


def trim_slots(ctx, rows: np.ndarray, kept: np.ndarray) -> None:
    """After a trim: ``kept[i, j]`` tokens of step j stay; the other slots go back. A row
    whose newest step was cut whole while an older one stays shows that one on the device
    (its ``spec_state`` row)."""
    led = ctx.ledger
    spec = led.spec_state[rows]  # [rows, depth, K]
    K = spec.shape[2]
    cut = np.arange(K)[None, None, :] >= kept[:, :, None]
    push(ctx, np.where(cut, spec, 0).reshape(-1))
    ctx.journal.put(led.spec_state, rows, np.where(cut, 0, spec))
    depth = np.count_nonzero(kept, axis=1)
    older = (depth > 0) & (depth < np.count_nonzero(led.spec_steps[rows], axis=1))
    if older.any():
        step = depth[older] - 1
        ctx.spec_parts.append(np.stack([rows[older], step,
                                        kept[np.flatnonzero(older), step]], axis=1))


def drop(ctx, handles: np.ndarray, swa_only: np.ndarray) -> None:
    """A whole drop gives the handle's snapshot back (a tombstone keeps it)."""
    whole = handles[swa_only == 0]
    index = ctx.config.max_reqs + whole
    push(ctx, ctx.ledger.state_slot[index])
    set_slot(ctx, index, np.zeros(len(index), dtype=np.int64))


def take(ctx, handles: np.ndarray, rows: np.ndarray, n: np.ndarray) -> None:
    """Snapshots where a state exists (41: n == C when the step begins), then the pops."""
    limit = np.minimum(ctx.len_at_start[rows], ctx.ledger.committed[rows])
    bad = n != limit
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise Refusal(RefusalCode.STATE_TAKE_NOT_AT_COMMITTED, Kind.TAKE_HANDLE, int(rows[i]),
                      int(n[i]), int(limit[i]))
    need(ctx, len(handles), "take_handle", int(rows[0]))
    slots = pop(ctx, len(handles))
    src = ctx.ledger.state_slot[rows].copy()
    set_slot(ctx, ctx.config.max_reqs + handles, slots)
    copy(ctx, src, slots)
    if ctx.taken_state is None:
        ctx.taken_state = np.zeros(ctx.config.max_handles, dtype=np.int64)
    ctx.taken_state[handles] = src  # an admit on h this step copies from the same state


def admit(ctx, rows: np.ndarray, kind: str = "admit") -> np.ndarray:
    """A slot for each admitted row (the caller checked the pool)."""
    slots = pop(ctx, len(rows))
    set_slot(ctx, rows, slots)
    return slots


def admit_on(ctx, rows: np.ndarray, handles: np.ndarray, n: np.ndarray,
             h_len: np.ndarray) -> None:
    """A request on a handle restores its snapshot (40: only at the handle's length)."""
    bad = n != h_len
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise Refusal(RefusalCode.STATE_SHARE_NOT_AT_SNAPSHOT, Kind.ADMIT_ON, int(handles[i]),
                      int(n[i]), int(h_len[i]))
    need(ctx, len(rows), "admit(handle=)", int(rows[0]))
    src = ctx.ledger.state_slot[ctx.config.max_reqs + handles]
    if ctx.taken_state is not None:
        src = np.where(ctx.taken_state[handles] != 0, ctx.taken_state[handles], src)
    copy(ctx, src, admit(ctx, rows))


def speculative(ctx, rows: np.ndarray, n: np.ndarray, depth: np.ndarray, kind: str) -> None:
    """Slots for every token of new speculative steps (``depth``: each row's step index);
    44 when a step is longer than ``max_spec_tokens``, 43 when the pool is short."""
    K = ctx.config.max_spec_tokens
    long = n > K
    if long.any():
        i = int(np.flatnonzero(long)[0])
        raise Refusal(RefusalCode.STATE_SPEC_OVER_SHAPE, kind_id(kind), int(rows[i]), int(n[i]), K)
    need(ctx, int(n.sum()), kind, int(rows[0]) if len(rows) else 0)


def speculative_slots(ctx, rows: np.ndarray, n: np.ndarray, depth: np.ndarray) -> None:
    """The pops of :func:`speculative` (after every check of the step part passed)."""
    total = int(n.sum())
    if not total:
        return
    slots = pop(ctx, total)
    led = ctx.ledger
    seg = np.repeat(np.arange(len(rows)), n)
    i = np.arange(total) - np.repeat(np.cumsum(n) - n, n)
    ctx.journal.put(led.spec_state, (rows[seg], depth[seg], i), slots)
    ctx.spec_parts.append(np.stack([rows, depth, n], axis=1)[n > 0])


def _spec_rows(ctx) -> np.ndarray:
    """``ST_SPEC`` rows: each row's newest speculative step (the last one the step named
    for it, read as the step leaves it), its slots in runs of six at the row's entries."""
    parts = ctx.spec_parts
    if not parts:
        return np.zeros((0, ROW_WIDTH), dtype=np.int64)
    entries = np.concatenate(parts) if len(parts) > 1 else parts[0]
    if len(entries) > 1:  # a trimmed row that also decodes: its decode's step
        _, last = np.unique(entries[::-1, 0], return_index=True)
        entries = entries[::-1][np.sort(last)[::-1]]
    rows, depth, n = entries[:, 0], entries[:, 1], entries[:, 2]
    total = int(n.sum())
    seg = np.repeat(np.arange(len(rows)), n)
    i = np.arange(total) - np.repeat(np.cumsum(n) - n, n)
    slots = ctx.ledger.spec_state[rows[seg], depth[seg], i]
    per_row = -(-n // ST_SPEC_SLOTS)
    out = np.zeros((int(per_row.sum()), ROW_WIDTH), dtype=np.int64)
    run = np.repeat(np.cumsum(per_row) - per_row, n) + i // ST_SPEC_SLOTS
    out[:, ST_KIND] = ST_SPEC
    out[run, ST_B + i % ST_SPEC_SLOTS] = slots
    starts = spec_index(ctx, rows, n)
    first = i % ST_SPEC_SLOTS == 0
    out[run[first], ST_A] = starts[first]
    return out


def finish(ctx) -> np.ndarray:
    """The step's state section: the header, the copy rows, then one table row per index
    (its last write) and the speculative rows (one step per request row, the last named).
    Refuses (45) a copy whose destination another copy of the step reads."""
    parts = ctx.state_parts
    rows = (np.concatenate(parts) if len(parts) > 1 else parts[0]) if parts else \
        np.zeros((0, ROW_WIDTH), dtype=np.int64)
    kind = rows[:, ST_KIND]
    copies = rows[kind == ST_COPY]
    if len(copies):
        clash = np.isin(copies[:, ST_B], copies[:, ST_A])
        if clash.any():
            slot = int(copies[np.flatnonzero(clash)[0], ST_B])
            raise Refusal(RefusalCode.STATE_COPY_SOURCE_BUSY, Kind.ADMIT_ON, 0, slot, 0)
    sets = rows[kind == ST_SET]
    if len(sets):  # the last write per index: unique over the reversed rows
        _, last = np.unique(sets[::-1, ST_A], return_index=True)
        sets = sets[::-1][np.sort(last)]
    table = np.concatenate([sets, _spec_rows(ctx)])
    out = np.zeros((1 + len(copies) + len(table), ROW_WIDTH), dtype=np.int64)
    out[0, ST_N_COPY], out[0, ST_N_TABLE] = len(copies), len(table)
    out[1:1 + len(copies)] = copies
    out[1 + len(copies):] = table
    return out


class StatePool:
    """Recurrent-state slots (``RecurrentState(num_slots)``): the rules of this module, one
    per step kind, for the planner to call (the compiled twin: ``_cplan_states.c``)."""

    has_states = True

    def __init__(self, num_slots: int, max_spec_tokens: int):
        self.num_slots, self.max_spec_tokens = int(num_slots), int(max_spec_tokens)

    @staticmethod
    def descriptor_sections(config) -> tuple:
        """Its descriptor section (:mod:`graphalloc.device.layout`): the header row, then
        ``config.max_state_rows`` rows (:func:`finish`)."""
        return ((STATES, config.max_state_rows + 1),)

    take = staticmethod(take)
    release = staticmethod(release)
    commit = staticmethod(commit)
    trim = staticmethod(trim)
    trim_slots = staticmethod(trim_slots)
    drop = staticmethod(drop)
    admit_on = staticmethod(admit_on)
    speculative = staticmethod(speculative)
    speculative_slots = staticmethod(speculative_slots)
    finish = staticmethod(finish)

    @staticmethod
    def admit(ctx, rows: np.ndarray) -> None:
        need(ctx, len(rows), "admit", int(rows[0]))
        admit(ctx, rows)


class NoStates:
    """A model without recurrent layers: every rule does nothing, the step has no state
    section."""

    has_states = False
    num_slots = 0

    @staticmethod
    def descriptor_sections(config) -> tuple:
        return ()

    def take(self, ctx, handles, rows, n) -> None:
        return None

    def release(self, ctx, rows) -> None:
        return None

    def commit(self, ctx, rows, n, oldest) -> None:
        return None

    def trim(self, ctx, rows, new_len) -> None:
        return None

    def trim_slots(self, ctx, rows, kept) -> None:
        return None

    def drop(self, ctx, handles, swa_only) -> None:
        return None

    def admit(self, ctx, rows) -> None:
        return None

    def admit_on(self, ctx, rows, handles, n, h_len) -> None:
        return None

    def speculative(self, ctx, rows, n, depth, kind) -> None:
        return None

    def speculative_slots(self, ctx, rows, n, depth) -> None:
        return None

    def finish(self, ctx) -> None:
        return None
