"""The host ledger's wire format, and the page mirror rebuilt from a replica's own tables.

**Wire format.** A ledger packs into int64 rows of 8 (the descriptor's row width), so it
travels in the same tensor as a step descriptor (:func:`pack_ledger`)::

    row 0   meta: [step, ledger, spec, handles, refs, pages, cache, magic]
                   (the replica step number, then the sender's host digests)
    row 1   meta: [full head, full free, swa head, swa free, steps_run, body digest, 0, 0]
    rows 2..      every array of Ledger.ROW_ARRAYS (max_reqs entries each; spec_steps
                  max_reqs x SPEC_DEPTH), then every array of Ledger.HANDLE_ARRAYS
                  (max_handles each), flattened in that order, padded to a whole row

Format 2 (the one-step redesign: no ``protected`` array; the magic says which format a
header is, and a header of another format is refused as torn).

The page mirror does not travel (it is O(rows x pages); see :mod:`graphalloc.replicas`
for why): :func:`rebuild_page_refs` rebuilds it from a replica's own device tables and
the ledger arrays -- page ids from ``req_to_token`` at each held page's first position,
``swa_of`` from ``full_to_swa``, ring contents from the device free rings, reference
counts from the holders' ranges -- and the host digests of the result are compared with
the sender's (row 0).
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import AllocatorConfig
from ..device.layout import ALLOCATION, RELEASE, DescriptorLayout
from ..errors import IntegrityError
from ..kernels.abi import ROW_WIDTH
from ..state.ledger import Ledger
from ..state.references import PageRefs
from .digest import (
    _MAGIC,
    _N_META_ROWS,
    _RING_COLUMNS,
    HOST_PARTS,
    META_BODY,
    META_LEDGER,
    META_MAGIC,
    META_STEPS_RUN,
    _digest,
    _held_pages,
    _ring_counts,
    holders,
    host_digests,
)

__all__ = ["Payload", "pack_ledger", "unpack_ledger", "planned_digests", "has_ledger",
           "steps_run_of", "rebuild_page_refs", "n_header_rows"]


def _body_arrays(ledger: Ledger) -> list[tuple[str, np.ndarray]]:
    names = list(ledger.ROW_ARRAYS) + list(ledger.HANDLE_ARRAYS)
    if ledger.config.num_state_slots:
        names += list(ledger.STATE_ARRAYS)
    return [(name, getattr(ledger, name)) for name in names]


def n_header_rows(ledger: Ledger) -> int:
    """Rows of a header for ``ledger``'s geometry: 2 meta rows, then the arrays."""
    n = sum(arr.size for _, arr in _body_arrays(ledger))
    return _N_META_ROWS + -(-n // ROW_WIDTH)


def pack_ledger(ledger: Ledger, header: np.ndarray, cache=None,
                full: bool = True) -> dict[str, int]:
    """Write ``ledger`` into a header (int64 ``[n_header_rows, 8]``) with its host digests
    (and ``cache``'s; ``full`` as for :func:`host_digests`); returns the digests. Leaves
    ``META_STEP`` and ``META_STEPS_RUN``. Cost: O(rows + handles) copies plus
    :func:`host_digests`."""
    body = header[_N_META_ROWS:].reshape(-1)
    end = 0
    for _, arr in _body_arrays(ledger):
        body[end:end + arr.size] = arr.reshape(-1)
        end += arr.size
    meta = header[1]
    meta[_RING_COLUMNS] = _ring_counts(ledger)
    meta[META_BODY] = _digest(body[:end], meta[_RING_COLUMNS])
    digests = host_digests(ledger, cache, full)
    header[0, META_LEDGER:META_LEDGER + len(HOST_PARTS)] = list(digests.values())
    header[0, META_MAGIC] = _MAGIC
    return digests


def planned_digests(header: np.ndarray) -> dict[str, int]:
    """The sender's host digests a header carries, by part."""
    values = header[0, META_LEDGER:META_LEDGER + len(HOST_PARTS)]  # host numpy
    return {part: int(v) for part, v in zip(HOST_PARTS, values, strict=True)}


def steps_run_of(header: np.ndarray) -> int:
    return int(header[1, META_STEPS_RUN])


def has_ledger(header: np.ndarray) -> bool:
    """Whether a planner has written a ledger into this header (not all padding)."""
    return int(header[0, META_MAGIC]) == _MAGIC


def unpack_ledger(config: AllocatorConfig, header: np.ndarray) -> Ledger:
    """The ledger a header carries, its page mirror empty (the page mirror does not
    travel: :func:`rebuild_page_refs`). Raises :class:`IntegrityError` when the header's
    body digest does not match its contents (a torn or foreign payload)."""
    ledger = Ledger(config)
    body = header[_N_META_ROWS:].reshape(-1)
    meta = header[1]
    arrays = _body_arrays(ledger)
    end = sum(arr.size for _, arr in arrays)
    if header.shape[0] != n_header_rows(ledger) or not has_ledger(header) or (
            meta[META_BODY] != _digest(body[:end], meta[_RING_COLUMNS])):
        raise IntegrityError("the payload's ledger does not match its digest: the payload was "
                             "not written by a planner of this geometry, or was torn")
    start = 0
    for _, arr in arrays:  # in place: the ledger's arrays are never rebound
        values = body[start:start + arr.size].reshape(arr.shape)
        arr[...] = values != 0 if arr.dtype == bool else values
        start += arr.size
    ledger.rings.reshape(-1)[:] = meta[_RING_COLUMNS]
    return ledger


# ---- the page mirror, rebuilt --------------------------------------------------------------
def rebuild_page_refs(config: AllocatorConfig, ledger: Ledger, first_slots: np.ndarray,
                      full_to_swa_first: np.ndarray, full_free: np.ndarray,
                      swa_free: np.ndarray) -> PageRefs:
    """The page mirror (pool mode) that device tables and a ledger's arrays imply.

    Args:
        first_slots: ``req_to_token`` rows of requests then handles, at every page's first
            position (``req_to_token_buf[:max_reqs + max_handles, ::ps]``), as numpy.
        full_to_swa_first: ``full_to_swa`` at every FULL page's first slot
            (``full_to_swa_buf[::ps]``, ``num_full_pages + 1`` entries).
        full_free, swa_free: the device free rings (whole, every position).

    ``page_of`` holds each holder's pages (other entries 0), ``swa_of`` and the rings come
    from the tables, and the reference counts are the holders' references (FULL
    ``[0, n)``, SWA ``[swa_start, n)`` of every live row and held handle). Cost:
    O(rows x pages_per_request + pages) numpy. Never raises on corrupt tables (an id out of
    range is held as page 0 and counted nowhere): the digests tell.
    """
    ps = config.page_size
    n_rows = config.max_reqs + ledger.n_handles
    refs = ledger.refs  # written in place (the ledger's own mirror)
    rows, n_pages, first_swa = holders(ledger)
    pages = (first_slots[:n_rows, :config.pages_per_request] // ps).astype(np.int32)
    pages[(pages < 0) | (pages > config.num_full_pages)] = 0  # corrupt: held as no page
    n_valid = np.zeros(n_rows, dtype=np.int64)
    n_valid[rows] = n_pages
    valid = np.arange(config.pages_per_request)[None, :] < n_valid[:, None]
    refs.page_of[:] = np.where(valid, pages, 0)
    refs.swa_of[:] = full_to_swa_first[:config.num_full_pages + 1] // ps
    refs.full_ring[:] = full_free[:config.num_full_pages]
    refs.swa_ring[:] = swa_free[:config.num_swa_pages]
    for counts, pages_held, n in (
            (refs.full_ref, _held_pages(refs.page_of, rows, n_pages), config.num_full_pages),
            (refs.swa_ref, refs.swa_of[_held_pages(refs.page_of, rows, n_pages, first_swa)],
             config.num_swa_pages)):
        ok = pages_held[(pages_held > 0) & (pages_held <= n)]  # a corrupt id counts nowhere
        counts[:] = np.bincount(ok, minlength=n + 1)
    return refs


class Payload:
    """One replica's broadcast payload, allocated once and updated in place (graphs hold
    its addresses)::

        buf       int64 [n_desc + n_header_rows, 8]  device  what a step broadcasts
        desc      buf[:n_desc]  (release, then alloc: the descriptor's two tables)
        header    buf[n_desc:]  (the ledger, :func:`pack_ledger`); meta its row 0
        staging   int64 [n_header_rows, 8] x n_bufs  pinned  the planner's header for each
                  descriptor buffer (``staging_np``: numpy views)

    ``n_desc``: the rows of the descriptor ``layout``'s release and allocation sections (the
    buffer's first rows, :class:`~graphalloc.device.layout.DescriptorLayout`); ``n_bufs``: the
    planner's descriptor buffers (0 on a follower)."""

    def __init__(self, layout: DescriptorLayout, ledger: Ledger, device: torch.device,
                 n_bufs: int):
        n_rel, n_desc = layout[RELEASE].end_row, layout[ALLOCATION].end_row
        n_rows = n_desc + n_header_rows(ledger)
        self.buf = torch.zeros(n_rows, ROW_WIDTH, dtype=torch.int64, device=device)
        self.desc, self.release, self.alloc = self.buf[:n_desc], self.buf[:n_rel], \
            self.buf[n_rel:n_desc]
        self.header, self.meta = self.buf[n_desc:], self.buf[n_desc]
        pinned = device.type == "cuda"
        self.staging = [torch.zeros(n_rows - n_desc, ROW_WIDTH, dtype=torch.int64,
                                    pin_memory=pinned) for _ in range(n_bufs)]
        self.staging_np = [b.numpy() for b in self.staging]
