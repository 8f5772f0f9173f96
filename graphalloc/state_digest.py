"""Digests of allocator state, and the host ledger's wire format (for tensor-parallel replicas).

Two digests, both deterministic bit for bit on every rank and every run:

* :func:`ledger_digest`: 64-bit BLAKE2b of the host ledger's int64 bytes (per-request
  ``live, seq_len, frontier, protected`` and both free rings' head and count); no
  Python ``hash``, so ``PYTHONHASHSEED`` cannot change it.
* :class:`StateDigest`: one 64-bit digest per device table, by Torch ops into a
  caller's buffer, sync-free and capturable.

The wire format packs a ledger into int64 rows of 8 (the descriptor's row width), so
it travels in the same tensor as a step descriptor (see :mod:`graphalloc.replicas`)::

    row 0      meta: [step, ledger digest, full head, full free, swa head, swa free,
                      steps_run, magic]
    rows 1..   live | seq_len | frontier | protected   (max_reqs int64 each, then padding)
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from .config import AllocatorConfig
from .errors import IntegrityError
from .kernels.abi import ROW_WIDTH
from .ledger import Ledger

__all__ = [
    "StateDigest",
    "ledger_digest",
    "pack_ledger",
    "unpack_ledger",
    "n_ledger_rows",
    "META_STEP",
    "META_LEDGER",
    "META_STEPS_RUN",
    "META_MAGIC",
]

# Columns of the meta row.
META_STEP, META_LEDGER = 0, 1  # replica step number, ledger digest (adjacent: copied as a pair)
META_FULL_HEAD, META_FULL_FREE, META_SWA_HEAD, META_SWA_FREE = 2, 3, 4, 5
META_STEPS_RUN, META_MAGIC = 6, 7
_MAGIC = 0x6761_7265_706C  # marks a header written by pack_ledger


def n_ledger_rows(config: AllocatorConfig) -> int:
    """Payload rows after the meta row: ``live, seq_len, frontier, protected`` as int64."""
    return -(-4 * config.max_reqs // ROW_WIDTH)


def _ring_counts(ledger: Ledger) -> np.ndarray:
    return np.array([ledger.full.head, ledger.full.n_free, ledger.swa.head, ledger.swa.n_free],
                    dtype=np.int64)


def _hash64(*arrays: np.ndarray) -> int:
    """BLAKE2b-64 of the arrays' int64 bytes, in order (== the hash of their concatenation)."""
    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


def ledger_digest(ledger: Ledger) -> int:
    """64-bit digest of a host ledger: per-request arrays and both free rings' head and count.
    Deterministic (no Python ``hash``), so equal ledgers give equal digests on every rank."""
    return _hash64(ledger.live, ledger.seq_len, ledger.frontier, ledger.protected,
                   _ring_counts(ledger))


def pack_ledger(ledger: Ledger, header: np.ndarray) -> int:
    """Write ``ledger`` into a payload header (int64 ``[1 + n_ledger_rows, 8]``: the meta row,
    then the arrays) and return its digest. Leaves ``META_STEP`` and ``META_STEPS_RUN``."""
    n = ledger.config.max_reqs
    body = header[1:].reshape(-1)
    body[0:n] = ledger.live
    body[n:2 * n] = ledger.seq_len
    body[2 * n:3 * n] = ledger.frontier
    body[3 * n:4 * n] = ledger.protected
    meta = header[0]
    meta[META_FULL_HEAD:META_SWA_FREE + 1] = _ring_counts(ledger)
    meta[META_LEDGER] = digest = _hash64(body[:4 * n], meta[META_FULL_HEAD:META_SWA_FREE + 1])
    meta[META_MAGIC] = _MAGIC
    return digest


def unpack_ledger(config: AllocatorConfig, header: np.ndarray) -> Ledger:
    """The ledger a payload header carries; raises :class:`IntegrityError` when the header's
    digest does not match its contents (a torn or foreign payload)."""
    n = config.max_reqs
    body, meta = header[1:].reshape(-1), header[0]
    if meta[META_MAGIC] != _MAGIC or meta[META_LEDGER] != _hash64(
            body[:4 * n], meta[META_FULL_HEAD:META_SWA_FREE + 1]):
        raise IntegrityError("the payload's ledger does not match its digest: the payload was "
                             "not written by a planner of this geometry, or was torn")
    ledger = Ledger(config)
    ledger.refs = None  # the wire format carries no page mirror: a follower's audit reads
    # ownership from the device tables (broadcast mode refuses shared pages, see replicas)
    ledger.live = body[0:n] != 0
    ledger.seq_len = body[n:2 * n].copy()
    ledger.frontier = body[2 * n:3 * n].copy()
    ledger.protected = body[3 * n:4 * n].copy()
    ledger.full.head, ledger.full.n_free = int(meta[META_FULL_HEAD]), int(meta[META_FULL_FREE])
    ledger.swa.head, ledger.swa.n_free = int(meta[META_SWA_HEAD]), int(meta[META_SWA_FREE])
    return ledger


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
