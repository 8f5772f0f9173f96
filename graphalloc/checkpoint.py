"""Recovery: ``state_dict`` / ``load_state_dict`` and SWA load-back. Off the fast path.

A state dict holds the host ledger (numpy) and the device tables (CPU tensors),
in PyTorch's convention. Loading validates the *incoming* state with the
full audit (page-dense mapping, no page with two owners, counts conserved)
before anything is copied; a state that fails raises
:class:`~graphalloc.errors.StateError` naming the first bad page, and the
allocator keeps its previous state. Tables are copied in place, so captured
graphs stay valid.
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import StateError
from .integrity import audit_state
from .ledger import FreeRing, Ledger

__all__ = ["state_dict", "load_state_dict", "load_back"]

_GEOMETRY = ("page_size", "num_full_pages", "num_swa_pages", "max_reqs", "max_context_len",
             "sliding_window", "swa_ring_pages")
_HOST = ("live", "seq_len", "frontier", "protected")


def state_dict(alloc) -> dict:
    """Host ledger and device tables, copied to the CPU (reads the device)."""
    if alloc._pending is not None:
        raise StateError("a planned step was never run(); run it before saving")
    led = alloc.ledger
    return {
        "geometry": {k: getattr(alloc.config, k) for k in _GEOMETRY},
        "index_dtype": str(alloc.config.index_dtype),
        "host": {k: getattr(led, k).copy() for k in _HOST},
        "full_ring": (led.full.head, led.full.n_free),
        "swa_ring": (led.swa.head, led.swa.n_free),
        "device": {k: v.detach().cpu().clone()  # off the fast path
                   for k, v in alloc.state.tables().items()},
    }


def load_state_dict(alloc, sd: dict) -> None:
    """Validate ``sd`` completely, then copy it in. Raises :class:`StateError` (nothing
    changed) when the geometry differs, a table has the wrong shape, or the audit of the
    incoming state finds a discrepancy."""
    cfg = alloc.config
    try:
        geometry, host, device = sd["geometry"], sd["host"], sd["device"]
        full_ring, swa_ring = sd["full_ring"], sd["swa_ring"]
    except (KeyError, TypeError) as exc:
        raise StateError(f"not a graphalloc state dict: missing {exc}") from None
    for k in _GEOMETRY:
        if geometry.get(k) != getattr(cfg, k):
            raise StateError(f"state dict has {k}={geometry.get(k)}, this allocator "
                             f"{getattr(cfg, k)}; build an allocator with the same geometry")
    current = alloc.state.tables()
    for k, t in current.items():
        src = device.get(k)
        if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(t.shape):
            raise StateError(f"state dict table {k!r} has shape "
                             f"{None if src is None else tuple(src.shape)}, expected "
                             f"{tuple(t.shape)}")
    ledger = Ledger(cfg)
    for k in _HOST:
        arr = np.asarray(host[k])
        if arr.shape != getattr(ledger, k).shape:
            raise StateError(f"host array {k!r} has shape {arr.shape}, expected "
                             f"{getattr(ledger, k).shape}")
        setattr(ledger, k, arr.astype(getattr(ledger, k).dtype).copy())
    ledger.full = FreeRing(cfg.num_full_pages, int(full_ring[0]), int(full_ring[1]))
    ledger.swa = FreeRing(cfg.num_swa_pages, int(swa_ring[0]), int(swa_ring[1]))
    snap = {k: device[k].numpy() for k in current}
    findings = audit_state(cfg, ledger, snap)
    if findings:
        first = findings[0]
        raise StateError(f"state dict refused, first bad page {first.page} "
                         f"({first.pool}, request {first.req}): {first.message}; "
                         f"{len(findings)} finding(s) in all. The allocator kept its state")
    for k, t in current.items():
        t.copy_(device[k].to(t.dtype))
    alloc.ledger = ledger
    alloc._faulted = False


def load_back(alloc, row: int, new_frontier_pos: int) -> torch.Tensor:
    """Re-pair full pages with fresh SWA pages after their KV came back from host memory.

    Moves request ``row``'s frontier *back* from ``f`` to ``new_frontier_pos``
    (the one explicit backward move), pops one SWA page per full page of
    ``[new_frontier_pos, f)``, writes the page-dense mapping and returns the SWA
    slots of those positions, where the caller copies the loaded KV. Pool mode
    only. Validated first, including on the device (the full pages must be
    unmapped): a refused load-back raises with nothing changed.
    """
    from .errors import AlignmentError, CapacityError, ContractError, FrontierError
    from .planner import StepBuilder

    cfg, ps = alloc.config, alloc.config.page_size
    if cfg.ring_mode:
        raise ContractError("load_back is for pool mode; a ring request keeps its ring pages")
    if alloc._pending is not None:
        raise StateError("a planned step was never run(); run it first")
    rows = StepBuilder(cfg, alloc.ledger).live_rows([row], "load_back")
    led = alloc.ledger
    old, new = int(led.frontier[rows[0]]), int(new_frontier_pos)
    if new % ps:
        raise AlignmentError(f"load-back frontier {new} is not a multiple of page_size {ps}")
    if not int(led.protected[row]) <= new <= old:
        raise FrontierError(f"request {row}: load-back frontier must lie in "
                            f"[protected {led.protected[row]}, frontier {old}], got {new}")
    n_pages = (old - new) // ps
    if n_pages > led.swa.n_free:
        raise CapacityError(f"load-back needs {n_pages} SWA pages, {led.swa.n_free} are free")
    dev = cfg.device
    offs = torch.arange(ps, device=dev)
    full_pages = alloc.state.req_to_token[row, new + torch.arange(n_pages, device=dev) * ps] // ps
    slots = full_pages[:, None] * ps + offs
    current = alloc.state.full_to_swa[slots]
    if bool((current != 0).any()):  # off the fast path: load-back validates on the device
        raise StateError(f"request {row}: full pages of [{new}, {old}) still have SWA peers; "
                         "nothing to load back")
    start = led.swa.pop(n_pages)
    idx = (start + torch.arange(n_pages, device=dev)) % cfg.num_swa_pages
    swa_pages = alloc.state.swa_free_buf[idx].to(torch.int64)
    if n_pages and bool((swa_pages < 1).any()):  # off the fast path
        led.swa.head, led.swa.n_free = (start, led.swa.n_free + n_pages)
        raise StateError("the SWA free list holds a sink marker; audit() the allocator")
    swa_slots = (swa_pages[:, None] * ps + offs).to(cfg.index_dtype)
    alloc.state.full_to_swa.index_put_((slots.reshape(-1),), swa_slots.reshape(-1))
    led.frontier[row] = new
    return swa_slots.reshape(-1)
