"""Audit, integrity checks and snapshots. These READ THE DEVICE (off the fast path).

:func:`audit` rebuilds page ownership from the device tables and the host
ledger and lists every discrepancy. The conservation law, per pool::

    free pages (in the free ring) + owned pages (by live requests) == pool pages

with no page both free and owned, none owned twice, page 0 never free or
owned, ``full_to_swa`` page-dense (every full page's slots are all 0, or all
``swa_page * ps + offset``), mapped exactly where a request owns an SWA peer
(no stale mapping), and ``req_to_token`` page-consistent. With recurrent-state slots
(:func:`audit_slots`): every slot free or held exactly once (free + held == slots), and the
device's state table equal to the host's slots. A model's further window pools are audited
the same way, each against its own slice (:mod:`graphalloc.diagnostics.window_audit`).
:func:`check_integrity` raises :class:`~graphalloc.errors.IntegrityError` on the
first finding, with the numbers.

The functions work on a *snapshot* (numpy copies) plus a ledger, so a state
that is not loaded yet (``load_state_dict``) is audited before it is accepted.
"""

from __future__ import annotations

import numpy as np

from ..errors import IntegrityError
from ..kernels.abi import ERR_CODES, ERR_PAGE, ERR_REQ
from ..parts import DeviceParts
from .findings import Finding
from .ring_audit import audit_free_ring
from .sync_points import sync_allowed
from .window_audit import audit_windows

__all__ = ["Finding", "snapshot", "audit", "audit_state", "audit_slots", "check_integrity",
           "ownership"]


def snapshot(parts: DeviceParts) -> dict:
    """Copies of every host array and device table (numpy)."""
    led = parts.ledger
    with sync_allowed():
        snap = {name: t.detach().cpu().numpy().copy()  # off the fast path
                for name, t in parts.state.tables().items()}
    for name, arr in led.arrays().items():
        snap[f"host_{name}"] = arr.copy()
    snap["host_full_ring"] = (led.full.head, led.full.n_free)
    snap["host_swa_ring"] = (led.swa.head, led.swa.n_free)
    return snap


def _free_entries(free: np.ndarray, head: int, n_free: int) -> np.ndarray:
    cap = len(free)
    return free[(head + np.arange(n_free)) % cap] if cap else free[:0]


def ownership(config, ledger, snap: dict) -> dict:
    """Pages per owner, rebuilt from device tables + host ledger:
    ``{"full": {req: pages}, "swa": {req: pages}, "full_free": ..., "swa_free": ...}``."""
    ps, window = config.page_size, config.pools.window
    r2t = snap["req_to_token"]
    full_owned, swa_owned = {}, {}
    for r in np.flatnonzero(ledger.live):
        end_page = -(-ledger.seq_len[r] // ps)
        full_owned[int(r)] = r2t[r, np.arange(end_page) * ps] // ps
        swa_owned[int(r)] = window.owned_on_device(snap, r, ledger.frontier[r] // ps, end_page,
                                                   ps)
    return {
        "full": full_owned,
        "swa": swa_owned,
        "full_free": _free_entries(snap["full_free"], ledger.full.head, ledger.full.n_free),
        "swa_free": _free_entries(snap["swa_free"], ledger.swa.head, ledger.swa.n_free),
    }


def _audit_pool(name: str, n_pages: int, free: np.ndarray, owned: dict) -> list[Finding]:
    out: list[Finding] = []
    counts = np.zeros(n_pages + 1, dtype=np.int64)
    owner = np.full(n_pages + 1, -1, dtype=np.int64)
    bad_free = (free < 1) | (free > n_pages)
    for page in free[bad_free][:8]:
        out.append(Finding("bad_free_entry", name, int(page), -1,
                           f"{name} free list holds page {page}, outside [1, {n_pages}] "
                           "(0 is the sink marker a faulty release pushes)"))
    np.add.at(counts, free[~bad_free], 1)
    for r, pages in owned.items():
        bad = (pages < 1) | (pages > n_pages)
        for page in pages[bad][:8]:
            out.append(Finding("bad_owned_page", name, int(page), r,
                               f"request {r} owns {name} page {page}, outside [1, {n_pages}]"))
        good = pages[~bad]
        np.add.at(counts, good, 1)
        owner[good] = r
    for page in (np.flatnonzero(counts[1:] > 1) + 1)[:8]:
        out.append(Finding("double_owner", name, int(page), int(owner[page]),
                           f"{name} page {page} is held {counts[page]} times (free/owned)"))
    for page in (np.flatnonzero(counts[1:] == 0) + 1)[:8]:
        out.append(Finding("leak", name, int(page), -1,
                           f"{name} page {page} is neither free nor owned (leaked)"))
    n_owned = sum(len(p) for p in owned.values())
    if len(free) + n_owned != n_pages:
        out.append(Finding("conservation", name, -1, -1,
                           f"{name} pool: free {len(free)} + owned {n_owned} != {n_pages} pages"))
    return out


def _holders(config, ledger):
    """Every holder as (row of page_of / req_to_token, n_tokens, swa_start): live requests,
    then held handles."""
    rows = np.flatnonzero(ledger.live)
    handles = np.flatnonzero(ledger.h_live)
    lens = np.concatenate([ledger.seq_len[rows], ledger.h_len[handles]])
    starts = np.concatenate([ledger.frontier[rows], ledger.h_swa_start[handles]])
    return (np.concatenate([rows, config.max_reqs + handles]), lens,
            config.pools.window.held_from(starts, lens, config.page_size))


def audit_references(config, ledger, snap: dict) -> list[Finding]:
    """Pool mode, exact: the host's page mirror against the device tables, and every
    reference count against the holders. Per pool: free + referenced == pages, page 0 never
    referenced, no referenced page free, counts equal to the holders' references."""
    ps, refs, out = config.page_size, ledger.refs, []
    r2t = snap["req_to_token"]
    if "handle_to_token" in snap:
        r2t = np.concatenate([r2t, snap["handle_to_token"]])
    f2s = snap["full_to_swa"]
    rows, lens, starts = _holders(config, ledger)
    want_full = np.zeros(config.num_full_pages + 1, dtype=np.int64)
    want_swa = np.zeros(config.num_swa_pages + 1, dtype=np.int64)
    for row, length, start in zip(rows, lens, starts, strict=True):
        n_pages = -(-int(length) // ps)
        pages = refs.page_of[row, :n_pages].astype(np.int64)
        who = f"request {row}" if row < config.max_reqs else f"handle {row - config.max_reqs}"
        slots = r2t[row, :length]
        expect = pages[np.arange(length) // ps] * ps + np.arange(length) % ps
        if not np.array_equal(slots, expect):
            p = int(np.flatnonzero(slots != expect)[0])
            out.append(Finding("req_to_token", "FULL", int(expect[p] // ps), int(row),
                               f"{who}: req_to_token at position {p} is {slots[p]}, the host "
                               f"mirror says {expect[p]}"))
        np.add.at(want_full, pages, 1)
        swa = refs.swa_of[pages[int(start) // ps:]].astype(np.int64)
        if (swa == 0).any():
            k = int(np.flatnonzero(swa == 0)[0]) + int(start) // ps
            out.append(Finding("missing_mapping", "SWA", int(pages[k]), int(row),
                               f"{who} holds the SWA page of its page {k} (FULL page "
                               f"{pages[k]}) but that page has no SWA page"))
        np.add.at(want_swa, swa[swa > 0], 1)
    for name, want, have in (("FULL", want_full, refs.full_ref),
                             ("SWA", want_swa, refs.swa_ref)):
        bad = np.flatnonzero(want != have)
        for page in bad[:8]:
            out.append(Finding("bad_refcount", name, int(page), -1,
                               f"{name} page {page}: reference count {have[page]}, but "
                               f"{want[page]} holders reference it"))
        if have[0] or want[0]:
            out.append(Finding("sink_referenced", name, 0, -1,
                               f"{name} page 0 (the sink) is referenced"))
    # the free rings: device == mirror at the free positions; in range, unique, unreferenced
    for name, key, ring, mirror, have, n in (
            ("FULL", "full_free", ledger.full, refs.full_ring, refs.full_ref,
             config.num_full_pages),
            ("SWA", "swa_free", ledger.swa, refs.swa_ring, refs.swa_ref, config.num_swa_pages)):
        out += audit_free_ring(name, snap[key], mirror, ring.head, ring.n_free, have, n)
    # the mapping: device == mirror, page-dense; an SWA page is the peer of one FULL page
    table = f2s.reshape(config.num_full_pages + 1, ps)
    expect = np.where(refs.swa_of[:, None] > 0,
                      refs.swa_of[:, None].astype(np.int64) * ps + np.arange(ps), 0)
    for p in np.flatnonzero((table != expect).any(1))[:8]:
        kind = "stale_mapping" if table[p, 0] else "missing_mapping"
        out.append(Finding(kind, "FULL", int(p), -1,
                           f"full_to_swa of full page {p} is {list(table[p])}, the host "
                           f"mirror says SWA page {refs.swa_of[p]}"))
    first = table[:, 0]
    peers = first[first > 0] // ps  # from the device table: what corruption looks like there
    vals, counts = np.unique(peers, return_counts=True)
    for v in vals[counts > 1][:8]:
        out.append(Finding("double_owner", "SWA", int(v), -1,
                           f"SWA page {v} is the peer of {counts[vals == v][0]} full pages"))
    orphan = np.flatnonzero((refs.swa_of > 0) & (refs.full_ref == 0))
    for p in orphan[:8]:
        out.append(Finding("stale_mapping", "FULL", int(p), -1,
                           f"free full page {p} still maps to SWA page {refs.swa_of[p]}"))
    return out


def audit_state(config, ledger, snap: dict) -> list[Finding]:
    """Every discrepancy between ``snap`` (device tables) and ``ledger`` (host)."""
    ps = config.page_size
    findings: list[Finding] = []
    try:
        ledger.check_host_invariants()
    except IntegrityError as exc:
        findings.append(Finding("host_ledger", "-", -1, -1, str(exc)))
    if ledger.refs is not None:  # pool mode: exact, against the host mirror
        findings += audit_references(config, ledger, snap)
        findings += audit_windows(config, ledger, snap)  # a model's further window pools
        return findings + audit_slots(config, ledger, snap) + _error_word_findings(snap)
    own = ownership(config, ledger, snap)
    findings += _audit_pool("FULL", config.num_full_pages, own["full_free"], own["full"])
    findings += _audit_pool("SWA", config.num_swa_pages, own["swa_free"], own["swa"])

    r2t = snap["req_to_token"]
    for r in np.flatnonzero(ledger.live):
        length = int(ledger.seq_len[r])
        pos = np.arange(length)
        slots = r2t[r, :length]
        page_of = slots // ps
        bad = (slots % ps != pos % ps) | (page_of != page_of[pos // ps * ps]) | (page_of < 1)
        if bad.any():
            p = int(np.flatnonzero(bad)[0])
            findings.append(Finding("req_to_token", "FULL", int(page_of[p]), int(r),
                                    f"req_to_token[{r}, {p}] = {slots[p]} breaks the page "
                                    f"layout (page_size {ps})"))

    f2s = snap["full_to_swa"].reshape(config.num_full_pages + 1, ps)
    first = f2s[:, 0]
    dense = (f2s == 0).all(1) | ((first > 0) & (first % ps == 0)
                                 & (f2s == (first // ps * ps)[:, None] + np.arange(ps)).all(1))
    for p in np.flatnonzero(~dense)[:8]:
        findings.append(Finding("not_page_dense", "FULL", int(p), -1,
                                f"full_to_swa of full page {p} is not page-dense: "
                                f"{f2s[p].tolist()}"))  # numpy: off the fast path
    should_map = np.zeros(config.num_full_pages + 1, dtype=bool)
    live = np.flatnonzero(ledger.live)
    held = config.pools.window.held_from(ledger.frontier[live], ledger.seq_len[live], ps)
    for r, start in zip(live, held, strict=True):
        end_page = -(-ledger.seq_len[r] // ps)
        pages = r2t[r, np.arange(start // ps, end_page) * ps] // ps
        should_map[np.clip(pages, 0, config.num_full_pages)] = True
    mapped = first > 0
    for p in np.flatnonzero(mapped != should_map)[:8]:
        kind = "stale_mapping" if mapped[p] else "missing_mapping"
        findings.append(Finding(kind, "FULL", int(p), -1,
                                f"full page {p}: mapping is {'set' if mapped[p] else 'empty'} "
                                f"but the ledger says it should be "
                                f"{'set' if should_map[p] else 'empty'}"))
    swa_targets = first[mapped] // ps
    vals, counts = np.unique(swa_targets, return_counts=True)
    for v in vals[counts > 1][:8]:
        findings.append(Finding("double_owner", "SWA", int(v), -1,
                                f"SWA page {v} is the peer of {counts[vals == v][0]} full pages"))
    return findings + audit_slots(config, ledger, snap) + _error_word_findings(snap)


def audit_slots(config, ledger, snap: dict) -> list[Finding]:
    """Recurrent-state slots: each of ``1..num_state_slots`` exactly once free or held (by a
    request, a handle's snapshot or a speculative token), and the device table (requests',
    handles', each request's newest speculative step's slots) equal to the host's."""
    n_slots = config.num_state_slots
    if not n_slots:
        return []
    findings: list[Finding] = []
    ring = ledger.state_ring
    head, n_free = int(ledger.states.head), int(ledger.states.n_free)
    free = ring[(head + np.arange(n_free)) % len(ring)]
    held = np.concatenate([ledger.state_slot, ledger.spec_state.reshape(-1)])
    seen = np.concatenate([free, held[held != 0]])
    counts = np.bincount(np.clip(seen, 0, n_slots + 1), minlength=n_slots + 2)
    for slot in np.flatnonzero(counts[1:n_slots + 1] != 1)[:8] + 1:
        kind = "slot_leak" if counts[slot] == 0 else "slot_double_owner"
        findings.append(Finding(kind, "STATE", int(slot), -1,
                                f"state slot {slot} is free or held {counts[slot]} times"))
    if counts[0] or counts[n_slots + 1]:
        findings.append(Finding("slot_range", "STATE", -1, -1,
                                f"a state slot outside 1..{n_slots} is free or held"))
    table = snap["state_table"]
    n = config.max_reqs + config.max_handles
    for i in np.flatnonzero(table[:n] != ledger.state_slot)[:8]:
        who = f"request {i}" if i < config.max_reqs else f"handle {i - config.max_reqs}"
        findings.append(Finding("state_table", "STATE", int(table[i]), int(i),
                                f"{who}: the device's state slot {table[i]}, the host's "
                                f"{ledger.state_slot[i]}"))
    spec = table[n:].reshape(config.max_reqs, config.max_spec_tokens)
    depth = np.count_nonzero(ledger.spec_steps, axis=1)
    for r in np.flatnonzero(depth)[:64]:
        host = ledger.spec_state[r, depth[r] - 1]
        k = int(np.count_nonzero(host))
        if (spec[r, :k] != host[:k]).any():
            findings.append(Finding("spec_state", "STATE", -1, int(r),
                                    f"request {r}: the device's speculative slots "
                                    f"{spec[r, :k].tolist()}, the host's {host[:k].tolist()}"))
    return findings


def _error_word_findings(snap: dict) -> list[Finding]:
    err = snap["err"]
    if not err[ERR_CODES]:
        return []
    return [Finding("device_fault", "-", int(err[ERR_PAGE]), int(err[ERR_REQ]),
                    f"device error word: {err.tolist()}")]  # off the fast path


def audit(parts: DeviceParts) -> list[Finding]:
    """Every discrepancy of a live allocator's parts (empty list when healthy). Reads the device."""
    return audit_state(parts.config, parts.ledger, snapshot(parts))


def check_integrity(parts: DeviceParts) -> None:
    """Raise :class:`IntegrityError` on the first discrepancy :func:`audit` finds."""
    findings = audit(parts)
    if findings:
        more = f" (+{len(findings) - 1} more)" if len(findings) > 1 else ""
        raise IntegrityError(f"{findings[0]}{more}")
