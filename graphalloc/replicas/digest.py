"""Digests of allocator state: the host ledger's parts, the prefix cache, the device tables.

Used by the tensor-parallel replicas (:mod:`graphalloc.replicas`); everything here is a
pure function of its inputs, deterministic bit for bit on every rank and every run (no
Python ``hash``, so ``PYTHONHASHSEED`` cannot change anything).

**Host digests** (:func:`host_digests`): one 64-bit BLAKE2b per part of the host state,
so a divergence names the part that differs:

==========  ==================================================================  ==========
part        what it covers                                                      cost
==========  ==================================================================  ==========
``ledger``  per request ``live, admitted_once, seq_len, frontier``; both free   O(rows)
            rings' head and count
``spec``    speculative decoding: ``committed`` and ``spec_steps`` per request   O(rows)
``handles`` ``h_live, h_len, h_swa_start`` per handle                            O(handles)
``refs``    the FULL and SWA reference counts (pool mode)                        O(pages)
``pages``   the page mirror: the FULL page of every held page index (live rows'  O(held
            ``[0, ceil(L / ps))``, held handles' ``[0, n / ps)``), ``swa_of``     pages)
            and both free rings' contents at their free positions
``cache``   the prefix cache's entries (handle, tokens, last key, LRU clock,     O(entries)
            parent, children) and counters; 0 without a cache
==========  ==================================================================  ==========

Stale page ids outside a holder's range and ring positions that are not free are not
state (nothing reads them) and are not digested.

**Device digests** (:class:`StateDigest`): one 64-bit digest per device table, by Torch
ops into a caller's buffer, sync-free and capturable.

The host ledger's wire format and the page mirror rebuilt from device tables:
:mod:`graphalloc.replicas.wire`.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from ..state.ledger import Ledger

__all__ = [
    "HOST_PARTS",
    "StateDigest",
    "host_digests",
    "ledger_digest",
    "cache_digest",
    "holders",
    "META_STEP",
    "META_LEDGER",
    "META_MAGIC",
    "META_STEPS_RUN",
]

HOST_PARTS = ("ledger", "spec", "handles", "refs", "pages", "cache")

# Row 0 of a header: the step, then the host digests in HOST_PARTS order (adjacent: a
# follower's digest row copies them as one slice), then the magic.
META_STEP, META_LEDGER = 0, 1
META_MAGIC = 7
# Row 1 of a header.
META_FULL_HEAD, META_FULL_FREE, META_SWA_HEAD, META_SWA_FREE = 0, 1, 2, 3
META_STEPS_RUN, META_BODY = 4, 5
META_STATE_HEAD, META_STATE_FREE = 6, 7  # the recurrent-state slot ring
_RING_COLUMNS = np.array([META_FULL_HEAD, META_FULL_FREE, META_SWA_HEAD, META_SWA_FREE,
                          META_STATE_HEAD, META_STATE_FREE])
_N_META_ROWS = 2
_MAGIC = 0x6761_7265_7032  # marks a header written by pack_ledger, wire format 2
_EMPTY = np.zeros(0, dtype=np.int64)


# ---- digests -------------------------------------------------------------------------------
def _hash64(*arrays: np.ndarray, dtype=np.int64) -> int:
    """BLAKE2b-64 of the arrays' bytes as ``dtype``, in order (for small arrays)."""
    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        h.update(np.ascontiguousarray(a, dtype=dtype))
    return int.from_bytes(h.digest(), "little", signed=True)


_WEIGHTS: dict[int, np.ndarray] = {}  # salt -> odd weights (grown on demand, never changed)


def _weights(salt: int, n: int) -> np.ndarray:
    w = _WEIGHTS.get(salt)
    if w is None or len(w) < n:
        w = _odd_weights(max(n, 2 * len(w) if w is not None else 1024), 1_000 + salt)
        _WEIGHTS[salt] = w
    return w[:n]


def _digest(*arrays: np.ndarray) -> int:
    """64-bit digest of the arrays, in order: per array its length and
    ``sum_i w_i * x_i`` (int64, wrapping; odd pseudo-random weights per array position, as
    :class:`StateDigest`), then BLAKE2b-64 of those numbers. Exact and order-sensitive: a
    single changed entry always changes it (``delta * odd != 0 mod 2**64``). Cost: one
    multiply-add per entry (about 20x less host time than BLAKE2b of the bytes)."""
    sums = np.zeros(2 * len(arrays), dtype=np.int64)
    for i, a in enumerate(arrays):
        flat = np.asarray(a).reshape(-1)
        sums[2 * i] = flat.size
        if flat.size:
            sums[2 * i + 1] = (flat.astype(np.int64) * _weights(i, flat.size)).sum()
    return _hash64(sums)


def _ring_counts(ledger: Ledger) -> np.ndarray:
    return ledger.rings.reshape(-1)  # [full, swa, state] x [head, free]


def _spec_arrays(ledger: Ledger) -> tuple:
    """``committed`` and ``spec_steps``."""
    return ledger.committed, ledger.spec_steps


def holders(ledger: Ledger) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every holder of pages as ``(row of page_of, n_pages, first SWA page index)``: live
    request rows in row order, then held handles (rows ``max_reqs + h``) in handle order."""
    ps, n = ledger.config.page_size, ledger.config.max_reqs
    rows = np.flatnonzero(ledger.live)
    handles = np.flatnonzero(ledger.h_live)
    return (np.concatenate([rows, n + handles]).astype(np.int64),
            np.concatenate([-(-ledger.seq_len[rows] // ps), ledger.h_len[handles] // ps]),
            np.concatenate([ledger.frontier[rows] // ps, ledger.h_swa_start[handles] // ps]))


def _held_pages(page_of: np.ndarray, rows: np.ndarray, n_pages: np.ndarray,
                first: np.ndarray | None = None) -> np.ndarray:
    """``page_of[rows[i], first[i]:n_pages[i]]`` for every i, concatenated (first: 0)."""
    lo = np.zeros_like(n_pages) if first is None else np.minimum(first, n_pages)
    count = n_pages - lo
    total = int(count.sum())
    if total == 0:
        return np.zeros(0, dtype=page_of.dtype)
    base = rows * page_of.shape[1] + lo - (np.cumsum(count) - count)  # flat index - position
    return page_of.reshape(-1)[np.arange(total) + np.repeat(base, count)]


def _free_contents(ring: np.ndarray, head: int, n_free: int) -> np.ndarray:
    """The ring's entries ``[head, head + n_free)`` (mod its length), in ring order."""
    cap = len(ring)
    if head + n_free <= cap:
        return ring[head:head + n_free]
    return np.concatenate([ring[head:], ring[:head + n_free - cap]])


def _entry_values(entry) -> list[int]:
    """An entry's fields as ints, in definition order: ints as they are, ``None`` as -1,
    another entry as its handle, a list of page keys as its length and its last key (the
    keys are chained: the last one names the whole prefix)."""
    out: list[int] = []
    for value in vars(entry).values():
        if isinstance(value, (bool, int, np.integer)):
            out.append(int(value))
        elif value is None:
            out.append(-1)
        elif isinstance(value, list):
            out.append(len(value))
            if value and isinstance(value[-1], bytes):
                out += list(value[-1])  # the bytes' values
        elif hasattr(value, "handle"):
            out.append(int(value.handle))
    return out


def cache_digest(cache) -> int:
    """64-bit digest of a :class:`~graphalloc.sharing.prefix_cache.PrefixCache`'s state (0 for
    ``None``): every entry, in handle order, by its fields (handle, tokens, LRU time,
    parent, locks, last page key, ...), then the LRU clock and the hit counters. The cache
    offers no export, so this reads its fields, and never calls a method (a digest must not
    change what it digests). Cost: O(entries)."""
    if cache is None:
        return 0
    state = cache.digest_state()
    return _hash64(np.asarray(state["counters"], dtype=np.int64),
                   np.asarray(state["order"], dtype=np.int64),
                   *[np.asarray(_entry_values(e), dtype=np.int64) for e in state["entries"]])


def host_digests(ledger: Ledger, cache=None, full: bool = True) -> dict[str, int]:
    """The host digests of ``ledger`` (and ``cache``), by part (:data:`HOST_PARTS`; see the
    module docstring). Equal ledgers give equal digests on every rank. ``full=False``
    computes only the O(rows) parts (``ledger``, ``spec``, ``handles``) and gives 0 for the
    others ("not computed"). Cost: O(rows + handles + pages + held pages + entries) numpy
    and BLAKE2b (``full=False``: O(rows + handles))."""
    out = {
        "ledger": _digest(ledger.live, ledger.admitted_once, ledger.seq_len, ledger.frontier,
                          _ring_counts(ledger), ledger.state_slot, ledger.spec_state,
                          _free_contents(ledger.state_ring, ledger.states.head,
                                         ledger.states.n_free)),
        "spec": _digest(*_spec_arrays(ledger)),
        "handles": _digest(ledger.h_live, ledger.h_len, ledger.h_swa_start),
    }
    refs = ledger.refs
    if not full:
        return {**out, "refs": 0, "pages": 0, "cache": 0}
    if refs is None:  # ring mode: no page mirror
        out["refs"] = out["pages"] = _digest()
    else:
        rows, n_pages, _ = holders(ledger)
        held = _held_pages(refs.page_of, rows, n_pages)
        out["refs"] = _digest(refs.full_ref, refs.swa_ref)
        out["pages"] = _digest(
            n_pages, held, refs.swa_of,
            _free_contents(refs.full_ring, ledger.full.head, ledger.full.n_free),
            _free_contents(refs.swa_ring, ledger.swa.head, ledger.swa.n_free))
    out["cache"] = cache_digest(cache)
    return out


def ledger_digest(ledger: Ledger, cache=None) -> int:
    """One 64-bit digest of all of :func:`host_digests` (for traces and quick comparisons)."""
    return _hash64(np.fromiter(host_digests(ledger, cache).values(), dtype=np.int64))


# ---- wire format ---------------------------------------------------------------------------
# ---- device tables -------------------------------------------------------------------------
def _odd_weights(n: int, salt: int) -> np.ndarray:
    """``n`` odd pseudo-random int64 weights (splitmix64 of the position; wraps mod 2**64)."""
    x = np.arange(n, dtype=np.uint64) + np.full(n, salt, dtype=np.uint64) * np.uint64(
        0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return (x | np.uint64(1)).view(np.int64)


class StateDigest:
    """One 64-bit digest per device table, written into a caller's int64 buffer.

    For a table viewed as ``[R, C]`` (1-D tables as ``[1, n]``)::

        digest = sum_r w_row[r] * sum_c w_col[c] * x[r, c]      (int64, wrapping)

    Weights are fixed odd pseudo-random numbers (a different stream per table) and the
    int64 ``scratch_bufs`` / ``rowsum_bufs`` are allocated once, so :meth:`compute`
    allocates nothing, never synchronises and can be captured into a CUDA graph. Integer
    sums wrap mod 2**64 and are exact, so the reduction order (threads, blocks) cannot
    change a bit. A single changed entry always changes its table's digest (``delta``
    times two odd weights is not 0 mod 2**64). Cost: one read of each table and one
    write of an int64 copy of it.
    """

    def __init__(self, tables: dict[str, torch.Tensor]):
        self.names = list(tables)
        self.tables, self.w_col, self.w_row = [], [], []
        self.scratch_bufs, self.rowsum_bufs = [], []
        for j, t in enumerate(tables.values()):
            t2 = t if t.dim() == 2 else t.reshape(1, -1)
            n_rows, n_cols = t2.shape
            dev = t.device
            self.tables.append(t2)
            self.w_col.append(torch.from_numpy(_odd_weights(n_cols, 2 * j + 1)).to(dev))
            self.w_row.append(torch.from_numpy(_odd_weights(n_rows, 2 * j + 2)).to(dev))
            self.scratch_bufs.append(torch.empty(n_rows, n_cols, dtype=torch.int64, device=dev))
            self.rowsum_bufs.append(torch.empty(n_rows, dtype=torch.int64, device=dev))

    def __len__(self) -> int:
        return len(self.names)

    def compute(self, out: torch.Tensor) -> None:
        """``out[j]`` = digest of table ``j`` (``out``: int64, at least ``len(self)`` entries)."""
        for j, t in enumerate(self.tables):
            scratch, rowsum = self.scratch_bufs[j], self.rowsum_bufs[j]
            torch.mul(t, self.w_col[j], out=scratch)
            torch.sum(scratch, dim=1, out=rowsum)
            rowsum.mul_(self.w_row[j])
            torch.sum(rowsum, dim=0, out=out[j])
