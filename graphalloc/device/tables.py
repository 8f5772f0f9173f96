"""Device tables: write-only projections of the host's decisions.

Every tensor is allocated once here and afterwards updated only in place, so
the addresses a captured graph holds stay valid for the allocator's lifetime.
Each table carries one scratch entry that padded lanes of the Torch twins may
write to; the public views exclude it.

================  ===========================================  ======================
name              shape (index dtype unless noted)             meaning
================  ===========================================  ======================
full_to_swa_buf   [(num_full_pages + 1) * ps]                  SWA slot of a full slot, 0 = none
req_to_token_buf  [max_reqs + max_handles + 1, max_context_len] full slot of (row, position):
                                                               requests, then handles
full_free_buf     [num_full_pages + 1]                         FULL free ring (+ scratch)
swa_free_buf      [num_swa_pages + 1]                          SWA free ring (+ scratch)
ring_pages_buf    [max_reqs + 1, max(1, swa_ring_pages)]       ring mode: a request's SWA pages
out_full_buf      [max_step_tokens + 1]                        this step's new full slots
out_swa_buf       [max_step_tokens + 1]                        this step's new SWA slots
err_buf           [8] int64                                    device error word
full_epoch_buf    [num_full_pages + 1] int64                   validate mode: the epoch
swa_epoch_buf     [num_swa_pages + 1] int64                    (step) that last pushed
                                                               each page to its ring
state_table_buf   [max_reqs + max_handles + max_reqs * K + 1]  recurrent-state slots: a
                  (K = max_spec_tokens; [1] without states)    request's, a handle's
                                                               snapshot, a request's newest
                                                               speculative step's
seen_buf          [2] int64                                    step stamps: the largest
                                                               seen, steps counted
================  ===========================================  ======================

A model's further window pools have tables of their own (``windows``:
:class:`~graphalloc.device.window_sections.WindowTables`, in :meth:`tables` as
``window{p}_full_to_swa`` and ``window{p}_swa_free``) and share ``window_out_buf`` (the
scratch output lanes of their allocation sections' twins).

The epoch tables are scratch of the validate-mode duplicate-push check (see
``kernels.release``), and ``seen_buf`` the step kernels' count of the steps that ran
(``kernels.stamp``, read by ``check()``); neither is allocator state: they are not in
:meth:`tables`.
"""

from __future__ import annotations

import torch

from ..config import AllocatorConfig
from ..kernels.error_word import new_error_word
from ..kernels.stamp import new_seen_word
from ..pools.extra_window import section_tokens
from .window_sections import WindowTables

__all__ = ["DeviceState"]


class DeviceState:
    def __init__(self, config: AllocatorConfig):
        cfg = config
        dev, dt = cfg.device, cfg.index_dtype
        self.config = cfg
        self.full_to_swa_buf = torch.zeros(cfg.num_full_slots, dtype=dt, device=dev)
        self.n_handles = getattr(cfg, "max_handles", 0)
        self.req_to_token_buf = torch.zeros(cfg.max_reqs + self.n_handles + 1,
                                            cfg.max_context_len, dtype=dt, device=dev)
        self.full_free_buf = torch.zeros(cfg.num_full_pages + 1, dtype=dt, device=dev)
        # (no window layers: a ring of capacity 1 that nothing reads, and its scratch entry)
        self.swa_free_buf = torch.zeros(max(cfg.num_swa_pages, 1) + 1, dtype=dt, device=dev)
        self.ring_pages_buf = torch.zeros(cfg.max_reqs + 1, max(1, cfg.swa_ring_pages), dtype=dt,
                                          device=dev)
        self.out_full_buf = torch.zeros(cfg.max_step_tokens + 1, dtype=dt, device=dev)
        self.out_swa_buf = torch.zeros(cfg.max_step_tokens + 1, dtype=dt, device=dev)
        self.err_buf = new_error_word(dev)
        self.full_epoch_buf = torch.zeros(cfg.num_full_pages + 1, dtype=torch.int64, device=dev)
        self.swa_epoch_buf = torch.zeros(cfg.num_swa_pages + 1, dtype=torch.int64, device=dev)
        n_state = (cfg.max_reqs + cfg.max_handles + cfg.max_reqs * cfg.max_spec_tokens
                   if cfg.num_state_slots else 0)
        self.state_table_buf = torch.zeros(n_state + 1, dtype=dt, device=dev)
        self.seen_buf = new_seen_word(dev)
        # A model's further window pools: their tables, and one scratch pair of output lanes
        # their allocation sections' twins write (the Triton kernels write no output lanes).
        self.windows = tuple(WindowTables(cfg, pool) for pool in cfg.pools.extras)
        self.window_out_buf = torch.zeros(section_tokens(cfg) + 1 if self.windows else 1,
                                          dtype=dt, device=dev)
        self.reset()

    def reset(self) -> None:
        """Every page free, in order 1..n; no mappings; no faults. In place."""
        cfg = self.config
        for name in ("full_to_swa_buf", "req_to_token_buf", "ring_pages_buf", "out_full_buf",
                     "out_swa_buf", "err_buf", "full_epoch_buf", "swa_epoch_buf",
                     "state_table_buf", "seen_buf"):
            getattr(self, name).zero_()
        dev, dt = cfg.device, cfg.index_dtype
        self.full_free_buf[:-1].copy_(torch.arange(1, cfg.num_full_pages + 1, dtype=dt, device=dev))
        self.swa_free_buf[:cfg.num_swa_pages].copy_(torch.arange(1, cfg.num_swa_pages + 1,
                                                                 dtype=dt, device=dev))
        self.full_free_buf[-1:].zero_()
        self.swa_free_buf[-1:].zero_()
        for window in self.windows:
            window.reset()

    # Public views (no scratch entries).
    @property
    def full_to_swa(self) -> torch.Tensor:
        return self.full_to_swa_buf

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.req_to_token_buf[:self.config.max_reqs]

    @property
    def handle_to_token(self) -> torch.Tensor:
        """``[max_handles, max_context_len]``: the slots each handle holds (its row)."""
        return self.req_to_token_buf[self.config.max_reqs:-1]

    @property
    def full_free(self) -> torch.Tensor:
        return self.full_free_buf[:-1]

    @property
    def swa_free(self) -> torch.Tensor:
        return self.swa_free_buf[:self.config.num_swa_pages]

    @property
    def ring_pages(self) -> torch.Tensor:
        return self.ring_pages_buf[:-1]

    @property
    def req_to_state(self) -> torch.Tensor:
        """``[max_reqs]``: each request's recurrent-state slot (0: none)."""
        return self.state_table_buf[:self.config.max_reqs]

    @property
    def handle_to_state(self) -> torch.Tensor:
        """``[max_handles]``: each handle's state snapshot slot (0: none)."""
        cfg = self.config
        return self.state_table_buf[cfg.max_reqs:cfg.max_reqs + cfg.max_handles]

    @property
    def spec_state(self) -> torch.Tensor:
        """``[max_reqs, max_spec_tokens]``: the state slot after each token of a request's
        newest speculative step (defined while one is in flight, for its tokens only)."""
        cfg = self.config
        base = cfg.max_reqs + cfg.max_handles
        n = cfg.max_reqs * cfg.max_spec_tokens if cfg.num_state_slots else 0
        return self.state_table_buf[base:base + n].view(-1, cfg.max_spec_tokens)

    def tables(self) -> dict[str, torch.Tensor]:
        """The state that defines the allocator (for snapshots, digests and comparisons)."""
        return {
            "full_to_swa": self.full_to_swa,
            "req_to_token": self.req_to_token,
            "full_free": self.full_free,
            "swa_free": self.swa_free,
            "ring_pages": self.ring_pages,
            "err": self.err_buf,
            **({"handle_to_token": self.handle_to_token} if self.n_handles else {}),
            **({"state_table": self.state_table_buf[:-1]} if self.config.num_state_slots
               else {}),
            **{name: t for window in self.windows for name, t in window.tables().items()},
        }
