"""The audit of one pool's free ring against its host mirror and its reference counts.

Every pool with a free ring of pages (FULL, the first window pool, each further window
pool) is checked the same way: the device ring equals the host mirror at the free
positions ``[head, head + n_free)``; every free entry is a page in ``[1, n]``, free once,
and referenced by nobody; free plus referenced pages are the whole pool; and no page is
neither (a leak). Findings carry the pool's ``name``; each kind lists at most 8 pages.
Cost: O(n_free + n) numpy.
"""

from __future__ import annotations

import numpy as np

from .findings import Finding

__all__ = ["audit_free_ring"]


def audit_free_ring(name: str, device_ring: np.ndarray, mirror: np.ndarray, head: int,
                    n_free: int, have: np.ndarray, n: int) -> list[Finding]:
    """Findings for pool ``name`` of ``n`` pages: ``device_ring`` (the device's free ring,
    read back), ``mirror`` (the host's), the ring's ``head`` and ``n_free``, ``have`` (the
    host reference count of each page, page 0 the sink)."""
    out: list[Finding] = []
    pos = (head + np.arange(n_free)) % max(n, 1)
    device, host = device_ring[pos], mirror[pos]
    if not np.array_equal(device, host):
        i = int(np.flatnonzero(device != host)[0])
        out.append(Finding("free_ring", name, int(device[i]), -1,
                           f"{name} free ring position {pos[i]} holds {device[i]} on the "
                           f"device, {host[i]} in the host mirror"))
    for page in device[(device < 1) | (device > n)][:8]:
        out.append(Finding("bad_free_entry", name, int(page), -1,
                           f"{name} free list holds page {page}, outside [1, {n}]"))
    counts = np.bincount(device[(device >= 1) & (device <= n)], minlength=n + 1)
    for page in np.flatnonzero(counts > 1)[:8]:
        out.append(Finding("double_free", name, int(page), -1,
                           f"{name} page {page} is in the free ring {counts[page]} times"))
    for page in np.flatnonzero((counts > 0) & (have > 0))[:8]:
        out.append(Finding("double_owner", name, int(page), -1,
                           f"{name} page {page} is free and referenced ({have[page]})"))
    n_ref = int(np.count_nonzero(have[1:]))
    if n_free + n_ref != n:
        out.append(Finding("conservation", name, -1, -1,
                           f"{name} pool: free {n_free} + referenced {n_ref} != {n}"))
    for page in (np.flatnonzero((counts[1:] == 0) & (have[1:] == 0)) + 1)[:8]:
        out.append(Finding("leak", name, int(page), -1,
                           f"{name} page {page} is neither free nor referenced (leaked)"))
    return out
