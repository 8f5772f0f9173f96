"""Recovery: ``state_dict`` / ``load_state_dict``. Off the fast path.

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

__all__ = ["state_dict", "load_state_dict"]

_GEOMETRY = ("page_size", "num_full_pages", "num_swa_pages", "max_reqs", "max_context_len",
             "sliding_window", "swa_ring_pages")
_HOST = ("live", "seq_len", "frontier", "protected")
_SPEC = ("committed", "spec_steps")  # speculative decoding; absent from older state dicts


def state_dict(alloc) -> dict:
    """Host ledger and device tables, copied to the CPU (reads the device)."""
    if alloc.pending is not None:
        raise StateError("a planned step was never run(); run it before saving")
    led = alloc.ledger
    return {
        "geometry": {k: getattr(alloc.config, k) for k in _GEOMETRY},
        "index_dtype": str(alloc.config.index_dtype),
        "host": {k: getattr(led, k).copy() for k in _HOST + _SPEC + led.HANDLE_ARRAYS},
        "refs": None if led.refs is None else led.refs.copy_arrays(),
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
    if not isinstance(sd, dict):
        raise StateError(f"not a graphalloc state dict: a {type(sd).__name__}")
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
    for k in _HOST + ledger.HANDLE_ARRAYS:
        arr = np.asarray(host.get(k))
        if arr.shape != getattr(ledger, k).shape:
            raise StateError(f"host array {k!r} has shape {arr.shape}, expected "
                             f"{getattr(ledger, k).shape}")
        setattr(ledger, k, arr.astype(getattr(ledger, k).dtype).copy())
    if "committed" not in host:  # an older state dict: nothing speculative, all committed
        host = {**host, "committed": ledger.seq_len, "spec_steps": ledger.spec_steps}
    for k in _SPEC:
        arr = np.asarray(host[k])
        if arr.shape != getattr(ledger, k).shape:
            raise StateError(f"host array {k!r} has shape {arr.shape}, expected "
                             f"{getattr(ledger, k).shape}")
        setattr(ledger, k, arr.astype(np.int64).copy())
    if ledger.refs is not None:
        refs = sd.get("refs") or {}
        for k in ledger.refs.NAMES:
            arr = np.asarray(refs.get(k))
            if arr.shape != getattr(ledger.refs, k).shape:
                raise StateError(f"state dict refs array {k!r} has shape {arr.shape}, "
                                 f"expected {getattr(ledger.refs, k).shape}")
            setattr(ledger.refs, k, arr.astype(np.int32).copy())
    ledger.full = FreeRing(cfg.num_full_pages, int(full_ring[0]), int(full_ring[1]))
    ledger.swa = FreeRing(cfg.num_swa_pages, int(swa_ring[0]), int(swa_ring[1]))
    try:
        ledger.check_host_invariants()
    except Exception as exc:  # IntegrityError: the incoming ledger is inconsistent
        raise StateError(f"state dict refused: {exc}. The allocator kept its state") from None
    snap = {k: device[k].numpy() for k in current}
    findings = audit_state(cfg, ledger, snap)
    if findings:
        first = findings[0]
        raise StateError(f"state dict refused, first bad page {first.page} "
                         f"({first.pool}, request {first.req}): {first.message}; "
                         f"{len(findings)} finding(s) in all. The allocator kept its state")
    if alloc.pending is not None:
        raise StateError("a planned step was never run(); run it before loading a state")
    ledger.admitted_once[:] = ledger.live
    for k, t in current.items():
        t.copy_(device[k].to(t.dtype))
    alloc.install_ledger(ledger)
    alloc.reset_faults()
