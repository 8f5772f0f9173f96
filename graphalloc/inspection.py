"""The sanctioned synchronisation points of an allocator: faults, audits, snapshots, state.

These read the device on purpose (inside :func:`~graphalloc.sync_points.sync_allowed`, so
they may be called under ``torch.cuda.set_sync_debug_mode("error")``); nothing on the
per-step path calls them. ``check()`` belongs where the engine synchronises anyway.
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import DeviceFaultError
from .sync_points import sync_allowed

__all__ = ["Inspection"]


class Inspection:
    """A part of :class:`graphalloc.HybridAllocator`."""

    def check(self, sync: bool = False) -> None:
        """Raise :class:`DeviceFaultError` if a kernel recorded a fault.

        Reads the 8-word device error word: a device-to-host read that waits for the steps
        already queued, so call it where the engine synchronises anyway (after reading
        sampled tokens) and it costs no extra wait. ``sync=True`` synchronises the whole
        device first (for faults from other streams).
        """
        with sync_allowed():
            if sync and self.config.device.type == "cuda":
                torch.cuda.synchronize(self.config.device)  # sync ok: requested by the caller
            words = self.state.err_buf.cpu().tolist()  # sync ok: the documented check point
        error = DeviceFaultError.from_error_word(words)
        if error is not None:
            self._faulted = True
            raise error

    def reset_faults(self) -> None:
        """Clear the error word and accept steps again (after the caller repaired or audited)."""
        self.state.err_buf.zero_()
        self._faulted = False

    def stats(self) -> dict:
        """Host-side counts for humans (no device read; builds dicts over the live rows: use
        the O(1) queries on the hot path)."""
        led, cfg = self.ledger, self.config
        live = np.flatnonzero(led.live)
        return {
            "full_free_pages": led.full.n_free,
            "full_used_pages": cfg.num_full_pages - led.full.n_free,
            "swa_free_pages": led.swa.n_free,
            "swa_used_pages": cfg.num_swa_pages - led.swa.n_free,
            "live_requests": len(live),
            "seq_len": {int(r): int(led.seq_len[r]) for r in live},
            "frontier": {int(r): int(led.frontier[r]) for r in live},
            "steps_run": self.steps_run,
            "descriptor_stalls": self.ring.stalls,
            "handles": int(np.count_nonzero(led.h_live)),
            **({} if self.prefix_cache is None else {
                "cache_entries": len(self.prefix_cache), "cache_hits": self.prefix_cache.hits,
                "cache_misses": self.prefix_cache.misses,
                "cache_hit_tokens": self.prefix_cache.hit_tokens,
                "cache_evicted_pages": self.prefix_cache.evicted_pages,
                "cache_tombstoned_pages": self.prefix_cache.tombstoned_pages}),
        }

    def snapshot(self) -> dict:
        """A full copy of host and device state (reads the device)."""
        from .integrity import snapshot
        return snapshot(self)

    def audit(self) -> list:
        """Every discrepancy between device tables and host ledger (leaked pages, pages
        owned twice, stale mappings, ...) as :class:`~graphalloc.integrity.Finding`s; an
        empty list when healthy. Reads the device: for tests and periodic health checks."""
        from .integrity import audit
        return audit(self)

    def state_dict(self) -> dict:
        """Host ledger + device tables on the CPU (PyTorch convention; reads the device)."""
        from .checkpoint import state_dict
        with sync_allowed():
            return state_dict(self)

    def load_state_dict(self, sd: dict) -> None:
        """Validate ``sd`` (audit of the incoming state) and copy it in place; refuses with
        :class:`~graphalloc.errors.StateError`, keeping the current state, when it fails."""
        from .checkpoint import load_state_dict
        with sync_allowed():
            load_state_dict(self, sd)

    def check_integrity(self) -> None:
        """Raise :class:`~graphalloc.errors.IntegrityError` on any broken invariant (reads the
        device; see ``graphalloc.integrity``)."""
        from .integrity import check_integrity
        check_integrity(self)
