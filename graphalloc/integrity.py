"""Integrity checks and snapshots. These READ THE DEVICE (off the fast path).

``check_integrity`` rebuilds page ownership from the device tables and the host
ledger and checks the conservation law per pool::

    free pages (in the free ring) + owned pages (by live requests) == pool pages

with no page both free and owned, none owned twice, page 0 never free or
owned, ``full_to_swa`` page-dense (every full page's slots are all 0, or all
``swa_page * ps + offset``), mapped exactly where a request owns an SWA peer,
and ``req_to_token`` page-consistent. Each failure raises
:class:`~graphalloc.errors.IntegrityError` with the numbers.
"""

from __future__ import annotations

import numpy as np

from .errors import IntegrityError

__all__ = ["snapshot", "check_integrity", "ownership"]


def snapshot(alloc) -> dict:
    """Copies of every host array and device table (numpy)."""
    led = alloc.ledger
    snap = {name: t.detach().cpu().numpy().copy()  # off the fast path
            for name, t in alloc.state.tables().items()}
    for name in ("live", "seq_len", "frontier", "protected"):
        snap[f"host_{name}"] = getattr(led, name).copy()
    snap["host_full_ring"] = (led.full.head, led.full.n_free)
    snap["host_swa_ring"] = (led.swa.head, led.swa.n_free)
    return snap


def _free_entries(free: np.ndarray, head: int, n_free: int) -> np.ndarray:
    cap = len(free)
    return free[(head + np.arange(n_free)) % cap] if cap else free[:0]


def ownership(alloc, snap: dict | None = None) -> dict:
    """Pages per owner, rebuilt from device tables + host ledger:
    ``{"full": {req: pages}, "swa": {req: pages}, "full_free": ..., "swa_free": ...}``."""
    cfg, led = alloc.config, alloc.ledger
    snap = snap or snapshot(alloc)
    ps = cfg.page_size
    r2t, f2s = snap["req_to_token"], snap["full_to_swa"]
    full_owned, swa_owned = {}, {}
    for r in np.flatnonzero(led.live):
        first_page, end_page = led.protected[r] // ps, -(-led.seq_len[r] // ps)
        pages = r2t[r, np.arange(first_page, end_page) * ps] // ps
        full_owned[int(r)] = pages
        if cfg.ring_mode:
            swa_owned[int(r)] = snap["ring_pages"][r, :cfg.swa_ring_pages]
        else:
            live_pages = r2t[r, np.arange(led.frontier[r] // ps, end_page) * ps] // ps
            swa_owned[int(r)] = f2s[live_pages * ps] // ps
    return {
        "full": full_owned,
        "swa": swa_owned,
        "full_free": _free_entries(snap["full_free"], led.full.head, led.full.n_free),
        "swa_free": _free_entries(snap["swa_free"], led.swa.head, led.swa.n_free),
    }


def _check_pool(name: str, n_pages: int, free: np.ndarray, owned: dict) -> None:
    counts = np.zeros(n_pages + 1, dtype=np.int64)
    if len(free) and (free.min() < 1 or free.max() > n_pages):
        raise IntegrityError(f"{name}: free list holds page {free.min()}..{free.max()}, "
                             f"outside [1, {n_pages}] (0 is the sink marker of a fault)")
    np.add.at(counts, free, 1)
    for r, pages in owned.items():
        if len(pages) and (pages.min() < 1 or pages.max() > n_pages):
            raise IntegrityError(f"{name}: request {r} owns page {pages.min()}..{pages.max()}, "
                                 f"outside [1, {n_pages}]")
        np.add.at(counts, pages, 1)
    n_owned = sum(len(p) for p in owned.values())
    twice = np.flatnonzero(counts[1:] > 1) + 1
    lost = np.flatnonzero(counts[1:] == 0) + 1
    if len(twice) or len(lost) or len(free) + n_owned != n_pages:
        raise IntegrityError(
            f"{name} pool: free {len(free)} + owned {n_owned} != {n_pages} pages; "
            f"pages held twice: {twice[:8].tolist()}, pages lost: {lost[:8].tolist()}")


def check_integrity(alloc) -> None:
    """Raise :class:`IntegrityError` on any broken invariant. Reads the device."""
    cfg, led = alloc.config, alloc.ledger
    ps = cfg.page_size
    led.check_host_invariants()
    snap = snapshot(alloc)
    own = ownership(alloc, snap)
    _check_pool("FULL", cfg.num_full_pages, own["full_free"], own["full"])
    _check_pool("SWA", cfg.num_swa_pages, own["swa_free"], own["swa"])

    # req_to_token: every owned or protected position sits at its in-page offset of one page.
    r2t = snap["req_to_token"]
    for r in np.flatnonzero(led.live):
        length = int(led.seq_len[r])
        pos = np.arange(length)
        slots = r2t[r, :length]
        page_of = slots // ps
        bad = (slots % ps != pos % ps) | (page_of != page_of[pos // ps * ps]) | (page_of < 1)
        if bad.any():
            p = int(np.flatnonzero(bad)[0])
            raise IntegrityError(f"req_to_token[{r}, {p}] = {slots[p]} breaks the page layout "
                                 f"(page_size {ps})")

    # full_to_swa: page-dense, and mapped exactly on owned pages at/after the frontier.
    f2s = snap["full_to_swa"].reshape(cfg.num_full_pages + 1, ps)
    offs = np.arange(ps)
    first = f2s[:, 0]
    dense = (f2s == 0).all(1) | ((first > 0) & (first % ps == 0)
                                 & (f2s == (first // ps * ps)[:, None] + offs).all(1))
    if not dense.all():
        p = int(np.flatnonzero(~dense)[0])
        raise IntegrityError(f"full_to_swa of full page {p} is not page-dense: {f2s[p].tolist()}")
    should_map = np.zeros(cfg.num_full_pages + 1, dtype=bool)
    for r in np.flatnonzero(led.live):
        end_page = -(-led.seq_len[r] // ps)
        pages = r2t[r, np.arange(led.frontier[r] // ps, end_page) * ps] // ps
        should_map[pages] = True
    protected_pages = np.zeros_like(should_map)
    for r in np.flatnonzero(led.live & (led.protected > 0)):
        protected_pages[r2t[r, np.arange(led.protected[r] // ps) * ps] // ps] = True
    mapped = first > 0
    wrong = (mapped != should_map) & ~protected_pages
    if wrong.any():
        p = int(np.flatnonzero(wrong)[0])
        raise IntegrityError(
            f"full page {p}: mapping is {'set' if mapped[p] else 'empty'} but the ledger says "
            f"it should be {'set' if should_map[p] else 'empty'} (stale or missing mapping)")
    if snap["err"][0]:
        raise IntegrityError(f"device error word is set: {snap['err'].tolist()}")
