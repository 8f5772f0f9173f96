"""A random continuous-batching workload applied identically to several allocators.

Used by the graph-vs-eager, soak and backend-equality tests: every allocator
gets the same operation; a contract error must be raised by all of them or by
none (the host ledgers are identical, so they decide identically).
"""

from __future__ import annotations

import numpy as np

from graphalloc import ContractError, HybridAllocator


def apply_all(allocs: list[HybridAllocator], fn) -> object:
    """Run ``fn(alloc)`` on each allocator; contract errors must agree."""
    results, errors = [], []
    for alloc in allocs:
        try:
            results.append(fn(alloc))
            errors.append(None)
        except ContractError as exc:
            results.append(None)
            errors.append(type(exc))
    if len(set(errors)) != 1:
        raise AssertionError(f"allocators disagree on a contract error: {errors}")
    return results[0]


def random_step(allocs: list[HybridAllocator], rng: np.random.Generator) -> str:
    """One random operation (or combined step) on every allocator; returns its name."""
    a0 = allocs[0]
    cfg, led = a0.config, a0.ledger
    live = np.flatnonzero(led.live)
    ps = cfg.page_size
    roll = rng.random()
    if roll < 0.15 or len(live) == 0:
        row = apply_all(allocs, lambda a: a.admit())
        if row is not None:
            room = cfg.max_context_len - 1
            n = int(min(room, rng.zipf(1.6) * rng.integers(1, 3 * ps + 2)))
            apply_all(allocs, lambda a: a.alloc_extend([row], [n]))
        return "admit+extend"
    if roll < 0.25:
        rows = rng.choice(live, size=int(rng.integers(1, len(live) + 1)), replace=False)
        lens = rng.integers(0, 2 * ps + 2, size=len(rows))
        apply_all(allocs, lambda a: a.alloc_extend(rows, lens))
        return "extend"
    if roll < 0.35:
        n_rel = int(rng.integers(1, len(live) + 1))
        rel = rng.choice(live, size=n_rel, replace=False)
        with_evict = bool(rng.random() < 0.5)

        def group(a):
            with a.free_group():
                if with_evict:
                    a.evict_window()
                a.release(rel)
        apply_all(allocs, group)
        return "free_group"
    if roll < 0.42:
        r = int(rng.choice(live))
        target = (led.frontier[r] + ps * int(rng.integers(0, 3)))
        apply_all(allocs, lambda a: a.advance_frontier([r], [target]))
        return "advance_frontier"
    if led.n_handles and not cfg.ring_mode and roll < 0.52:  # shared pages
        if cfg.num_state_slots and rng.random() < 0.5:
            return _snapshot_op(allocs, rng, live)
        return _sharing_op(allocs, rng, live)
    if roll < 0.62:
        return _speculative_op(allocs, rng, live)
    # a scheduler step: release some finished, evict all, decode the rest (plain decodes:
    # rows with a speculative tail are left to _speculative_op)
    finished = live[rng.random(len(live)) < 0.1]
    decode = np.setdiff1d(live, finished)
    decode = decode[(led.seq_len[decode] < cfg.max_context_len)
                    & (led.spec_steps[decode, 0] == 0)]
    apply_all(allocs, lambda a: a.step(release=finished, evict_all=True, decode=decode))
    return "step"


def _speculative_op(allocs: list[HybridAllocator], rng: np.random.Generator, live) -> str:
    """A speculative round on some rows: commit the oldest step's accepted counts (any
    count, all rejected and all accepted included), evict by the committed window and draft
    the next verify tokens, in one step; or, now and then, a second step in flight
    (overlap) or a trim back to the committed length or a page boundary."""
    a0 = allocs[0]
    led, ps = a0.ledger, a0.config.page_size
    rows = np.sort(rng.choice(live, size=int(rng.integers(1, len(live) + 1)), replace=False))
    k = int(rng.integers(0, 4))
    roll = rng.random()
    pending = rows[led.spec_steps[rows, 0] > 0]
    if roll < 0.15 and len(pending):
        new = np.maximum(led.committed[pending] // ps * ps, led.frontier[pending]
                         + a0.config.sliding_window * (led.frontier[pending] > 0))
        new = np.minimum(new, led.seq_len[pending])
        apply_all(allocs, lambda a: a.trim(pending, new))
        return "trim"
    room = led.seq_len[rows] + 1 + k <= a0.config.max_context_len
    if roll < 0.3:  # overlap: another step in flight before the commit
        rows = rows[room & (led.spec_steps[rows, -1] == 0)]
        apply_all(allocs, lambda a: a.step(decode=rows, lookahead=k))
        return "spec_overlap"
    commit = None
    if len(pending):
        n = rng.integers(0, led.spec_steps[pending, 0] + 1)
        commit = (pending, n)
    apply_all(allocs, lambda a: a.step(commit=commit, evict=rows, decode=rows[room],
                                       lookahead=k))
    return "spec_round"


def _sharing_op(allocs: list[HybridAllocator], rng: np.random.Generator, live) -> str:
    """Take a handle on a live request's whole pages, admit on a held handle (and extend),
    drop or tombstone one: the allocators must agree (their ledgers are identical)."""
    a0 = allocs[0]
    ps, held = a0.config.page_size, a0.live_handles()
    roll = rng.random()
    if roll < 0.4 or len(held) == 0:
        r = int(rng.choice(live))
        n = a0.seq_len(r) // ps * ps
        if n == 0:
            return "take_handle(skip)"
        n = int(rng.integers(1, n // ps + 1)) * ps
        apply_all(allocs, lambda a: a.take_handle(r, n))
        return "take_handle"
    h = int(rng.choice(held))
    if roll < 0.7:
        n = int(rng.integers(1, 3 * ps))  # drawn once: every allocator gets the same step
        row = apply_all(allocs, lambda a: a.admit(handle=h))
        if row is not None:
            apply_all(allocs, lambda a: a.alloc_extend([row], [n]))
        return "admit(handle)"
    if roll < 0.85:
        apply_all(allocs, lambda a: a.drop_handle_swa(h))
        return "drop_handle_swa"
    apply_all(allocs, lambda a: a.drop_handle(h))
    return "drop_handle"


def _snapshot_op(allocs: list[HybridAllocator], rng: np.random.Generator, live) -> str:
    """With recurrent-state slots a snapshot exists only at a request's committed length:
    extend a request without a speculative tail to a page boundary, or take a handle there
    (its state copied inside the step)."""
    a0 = allocs[0]
    led, ps = a0.ledger, a0.config.page_size
    plain = live[led.spec_steps[live, 0] == 0]
    if not len(plain):
        return "snapshot(skip)"
    r = int(rng.choice(plain))
    c = int(led.committed[r])
    if c % ps or c == 0:
        n = ps - c % ps
        if c + n <= a0.config.max_context_len:
            apply_all(allocs, lambda a: a.alloc_extend([r], [n]))
        return "align"
    apply_all(allocs, lambda a: a.take_handle(r, c))
    return "take_handle(state)"
