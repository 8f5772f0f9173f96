"""The audit of a model's further window pools (p >= 1). READS THE DEVICE (via a snapshot).

For each further pool (:mod:`graphalloc.pools.extra_window`), exact, against its host slice
(:class:`~graphalloc.state.window_ledger.WindowLedger`) -- the same laws as the first
window pool's (:func:`graphalloc.diagnostics.integrity.audit_references`)::

    free (ring) + referenced == num_pages      page 0 never referenced nor free
    swa_ref[page] == holders of it             a holder: a live request from its f_p, a
                                               handle from its h_start_p, to its last page
    device free ring == mirror, in range,      full_to_swa_p == mirror, page-dense; a pool
    unique, never referenced                   page the peer of one FULL page at most; no
                                               mapping on a free FULL page

Findings name the pool ``window{p}``. Cost: O(holders x pages + pages) numpy.
"""

from __future__ import annotations

import numpy as np

from .findings import Finding
from .ring_audit import audit_free_ring

__all__ = ["audit_windows"]


def audit_windows(config, ledger, snap: dict) -> list[Finding]:
    """Every discrepancy of the further window pools in ``snap`` against ``ledger``."""
    out: list[Finding] = []
    for pool, window in zip(config.pools.extras, ledger.windows, strict=True):
        out += _audit_pool(config, ledger, window, pool.num_pages, snap)
    return out


def _audit_pool(config, ledger, window, n: int, snap: dict) -> list[Finding]:
    ps, refs, name = config.page_size, ledger.refs, f"window{window.index}"
    out: list[Finding] = []
    rows = np.flatnonzero(ledger.live)
    handles = np.flatnonzero(ledger.h_live)
    want = np.zeros(n + 1, dtype=np.int64)
    for row, length, start in zip(
            np.concatenate([rows, config.max_reqs + handles]),
            np.concatenate([ledger.seq_len[rows], ledger.h_len[handles]]),
            np.concatenate([window.frontier[rows], window.h_start[handles]]), strict=True):
        pages = refs.page_of[row, int(start) // ps:-(-int(length) // ps)].astype(np.int64)
        peers = window.swa_of[pages].astype(np.int64)
        if (peers == 0).any():
            k = int(np.flatnonzero(peers == 0)[0])
            out.append(Finding("missing_mapping", name, int(pages[k]), int(row),
                               f"{name}: holder row {row} holds the pool page of FULL page "
                               f"{pages[k]}, which has none"))
        np.add.at(want, peers[peers > 0], 1)
    have = window.swa_ref
    for page in np.flatnonzero(want != have)[:8]:
        out.append(Finding("bad_refcount", name, int(page), -1,
                           f"{name} page {page}: reference count {have[page]}, but "
                           f"{want[page]} holders reference it"))
    if have[0] or want[0]:
        out.append(Finding("sink_referenced", name, 0, -1, f"{name} page 0 is referenced"))
    out += audit_free_ring(name, snap[f"{name}_swa_free"], window.swa_ring,
                           int(window.ring[0]), int(window.ring[1]), have, n)
    table = snap[f"{name}_full_to_swa"].reshape(config.num_full_pages + 1, ps)
    expect = np.where(window.swa_of[:, None] > 0,
                      window.swa_of[:, None].astype(np.int64) * ps + np.arange(ps), 0)
    for p in np.flatnonzero((table != expect).any(1))[:8]:
        kind = "stale_mapping" if table[p, 0] else "missing_mapping"
        out.append(Finding(kind, name, int(p), -1,
                           f"{name}_full_to_swa of full page {p} is {list(table[p])}, the "
                           f"host mirror says pool page {window.swa_of[p]}"))
    first = table[:, 0]
    vals, n_peers = np.unique(first[first > 0] // ps, return_counts=True)
    for v in vals[n_peers > 1][:8]:
        out.append(Finding("double_owner", name, int(v), -1,
                           f"{name} page {v} is the peer of {n_peers[vals == v][0]} full pages"))
    for p in np.flatnonzero((window.swa_of > 0) & (refs.full_ref == 0))[:8]:
        out.append(Finding("stale_mapping", name, int(p), -1,
                           f"free full page {p} still maps to {name} page {window.swa_of[p]}"))
    return out
