"""Recovery: ``state_dict`` / ``load_state_dict``. Off the fast path.

A state dict holds the host ledger (numpy) and the device tables (CPU tensors),
in PyTorch's convention. Loading validates the *incoming* state with the
full audit (page-dense mapping, no page with two owners, counts conserved)
before anything is copied; a state that fails raises
:class:`~graphparts.errors.StateError` naming the first bad page, and the
allocator keeps its previous state. Tables are copied in place, so captured
graphs stay valid.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import StateError
from ..parts import DeviceParts, PipelinePart
from ..state.ledger import Ledger
from .integrity import audit_state

__all__ = ["state_dict", "load_state_dict"]

_GEOMETRY = ("page_size", "num_full_pages", "num_swa_pages", "max_reqs", "max_context_len",
             "sliding_window", "swa_ring_pages")
FORMAT = 2  # 1: the first format (with a "protected" row array); 2: Ledger.arrays()


def state_dict(parts: DeviceParts, pipeline: PipelinePart) -> dict:
    """Host ledger and device tables of ``parts`` (:class:`~graphparts.parts.DeviceParts`),
    copied to the CPU (reads the device); refused while ``pipeline`` has a step pending."""
    if pipeline.pending is not None:
        raise StateError("a planned step was neither run nor cancelled; finish it before "
                         "saving")
    return {
        "format": FORMAT,
        "geometry": {k: getattr(parts.config, k) for k in _GEOMETRY},
        "index_dtype": str(parts.config.index_dtype),
        "host": {k: v.copy() for k, v in parts.ledger.arrays().items()},
        "device": {k: v.detach().cpu().clone()  # off the fast path
                   for k, v in parts.state.tables().items()},
    }


def _host_arrays(sd: dict) -> dict:
    """The host arrays of a state dict of either format, as ``Ledger.arrays()`` names them."""
    host = sd["host"]
    if sd.get("format", 1) == FORMAT:
        return dict(host)
    if sd.get("format", 1) != 1:
        raise StateError(f"state dict format {sd.get('format')!r} is not one this version "
                         f"reads (1 or {FORMAT})")
    protected = np.asarray(host.get("protected", 0))
    if protected.any():
        raise StateError("a format-1 state dict with a protected prefix (the sharing form "
                         "before handles) cannot be loaded: protected prefixes no longer exist")
    arrays = {k: v for k, v in host.items() if k != "protected"}
    arrays.setdefault("admitted_once", np.asarray(host["live"]))
    if "committed" not in arrays:  # older still: nothing speculative, all committed
        arrays["committed"] = np.asarray(host["seq_len"])
        arrays["spec_steps"] = None
    arrays["rings"] = np.array([sd["full_ring"], sd["swa_ring"]], dtype=np.int64)
    arrays.update(sd.get("refs") or {})
    return arrays


def load_state_dict(parts: DeviceParts, pipeline: PipelinePart, sd: dict) -> None:
    """Validate ``sd`` completely, then copy it in. Raises :class:`StateError` (nothing
    changed) when the geometry differs, a table has the wrong shape, or the audit of the
    incoming state finds a discrepancy. Reads both formats (format 1 without a protected
    prefix)."""
    cfg = parts.config
    if not isinstance(sd, dict):
        raise StateError(f"not a graphalloc state dict: a {type(sd).__name__}")
    try:
        geometry, device = sd["geometry"], sd["device"]
        arrays = _host_arrays(sd)
    except (KeyError, TypeError) as exc:
        raise StateError(f"not a graphalloc state dict: missing {exc}") from None
    for k in _GEOMETRY:
        if geometry.get(k) != getattr(cfg, k):
            raise StateError(f"state dict has {k}={geometry.get(k)}, this allocator "
                             f"{getattr(cfg, k)}; build an allocator with the same geometry")
    current = parts.state.tables()
    for k, t in current.items():
        src = device.get(k)
        if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(t.shape):
            raise StateError(f"state dict table {k!r} has shape "
                             f"{None if src is None else tuple(src.shape)}, expected "
                             f"{tuple(t.shape)}")
    ledger = Ledger(cfg)  # a scratch ledger: audited before anything is copied in
    own = ledger.arrays()
    for k, target in own.items():
        if k not in arrays:
            raise StateError(f"state dict has no host array {k!r}")
        if arrays[k] is None:
            continue
        arr = np.asarray(arrays[k])
        if arr.shape != target.shape:
            raise StateError(f"host array {k!r} has shape {arr.shape}, expected "
                             f"{target.shape}")
        target[...] = arr.astype(target.dtype)
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
    if pipeline.pending is not None:
        raise StateError("a planned step was neither run nor cancelled; finish it before "
                         "loading a state")
    for k, t in current.items():
        t.copy_(device[k].to(t.dtype))
    parts.ledger.assign(ledger.arrays())
    from .recovery import clear_faults

    clear_faults(parts, pipeline)
