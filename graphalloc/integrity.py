"""Audit, integrity checks and snapshots. These READ THE DEVICE (off the fast path).

:func:`audit` rebuilds page ownership from the device tables and the host
ledger and lists every discrepancy. The conservation law, per pool::

    free pages (in the free ring) + owned pages (by live requests) == pool pages

with no page both free and owned, none owned twice, page 0 never free or
owned, ``full_to_swa`` page-dense (every full page's slots are all 0, or all
``swa_page * ps + offset``), mapped exactly where a request owns an SWA peer
(no stale mapping), and ``req_to_token`` page-consistent.
:func:`check_integrity` raises :class:`~graphalloc.errors.IntegrityError` on the
first finding, with the numbers.

The functions work on a *snapshot* (numpy copies) plus a ledger, so a state
that is not loaded yet (``load_state_dict``) is audited before it is accepted.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .errors import IntegrityError
from .kernels.abi import ERR_CODES, ERR_PAGE, ERR_REQ
from .sync_points import sync_allowed

__all__ = ["Finding", "snapshot", "audit", "audit_state", "check_integrity", "ownership"]


@dataclasses.dataclass
class Finding:
    """One discrepancy: ``kind`` (leak, double_owner, stale_mapping, ...), the ``pool``,
    the ``page`` (or -1), the request ``req`` (or -1) and a message."""

    kind: str
    pool: str
    page: int
    req: int
    message: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}"


def snapshot(alloc) -> dict:
    """Copies of every host array and device table (numpy)."""
    led = alloc.ledger
    with sync_allowed():
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


def ownership(config, ledger, snap: dict) -> dict:
    """Pages per owner, rebuilt from device tables + host ledger:
    ``{"full": {req: pages}, "swa": {req: pages}, "full_free": ..., "swa_free": ...}``."""
    ps = config.page_size
    r2t, f2s = snap["req_to_token"], snap["full_to_swa"]
    full_owned, swa_owned = {}, {}
    for r in np.flatnonzero(ledger.live):
        first_page, end_page = ledger.protected[r] // ps, -(-ledger.seq_len[r] // ps)
        full_owned[int(r)] = r2t[r, np.arange(first_page, end_page) * ps] // ps
        if config.ring_mode:
            swa_owned[int(r)] = snap["ring_pages"][r, :config.swa_ring_pages]
        else:
            live_pages = r2t[r, np.arange(ledger.frontier[r] // ps, end_page) * ps] // ps
            swa_owned[int(r)] = f2s[np.clip(live_pages, 0, None) * ps] // ps
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


def audit_state(config, ledger, snap: dict) -> list[Finding]:
    """Every discrepancy between ``snap`` (device tables) and ``ledger`` (host)."""
    ps = config.page_size
    findings: list[Finding] = []
    try:
        ledger.check_host_invariants()
    except IntegrityError as exc:
        findings.append(Finding("host_ledger", "-", -1, -1, str(exc)))
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
    protected_pages = np.zeros_like(should_map)
    for r in np.flatnonzero(ledger.live):
        end_page = -(-ledger.seq_len[r] // ps)
        pages = r2t[r, np.arange(ledger.frontier[r] // ps, end_page) * ps] // ps
        should_map[np.clip(pages, 0, config.num_full_pages)] = True
        prot = r2t[r, np.arange(ledger.protected[r] // ps) * ps] // ps
        protected_pages[np.clip(prot, 0, config.num_full_pages)] = True
    mapped = first > 0
    for p in np.flatnonzero((mapped != should_map) & ~protected_pages)[:8]:
        kind = "stale_mapping" if mapped[p] else "missing_mapping"
        findings.append(Finding(kind, "FULL", int(p), -1,
                                f"full page {p}: mapping is {'set' if mapped[p] else 'empty'} "
                                f"but the ledger says it should be "
                                f"{'set' if should_map[p] else 'empty'}"))
    swa_targets = first[mapped & ~protected_pages] // ps
    vals, counts = np.unique(swa_targets, return_counts=True)
    for v in vals[counts > 1][:8]:
        findings.append(Finding("double_owner", "SWA", int(v), -1,
                                f"SWA page {v} is the peer of {counts[vals == v][0]} full pages"))
    err = snap["err"]
    if err[ERR_CODES]:
        findings.append(Finding("device_fault", "-", int(err[ERR_PAGE]), int(err[ERR_REQ]),
                                f"device error word: {err.tolist()}"))  # off the fast path
    return findings


def audit(alloc) -> list[Finding]:
    """Every discrepancy of a live allocator (empty list when healthy). Reads the device."""
    return audit_state(alloc.config, alloc.ledger, snapshot(alloc))


def check_integrity(alloc) -> None:
    """Raise :class:`IntegrityError` on the first discrepancy :func:`audit` finds."""
    findings = audit(alloc)
    if findings:
        more = f" (+{len(findings) - 1} more)" if len(findings) > 1 else ""
        raise IntegrityError(f"{findings[0]}{more}")
