"""Backends: which kernels execute a planned step.

``torch`` is the fixed-shape, sync-free reference (any device); ``triton`` runs
the Triton kernels (a GPU, or the CPU through ``TRITON_INTERPRET=1``). Both
take the same arguments and must leave identical state.

A step runs as two launches (release, then allocation) or, where the planner
marked it fusable, as one fused launch (``kernels.step``): programs
``[0, R)`` release, ``[R, R + A)`` allocate. Fusing is safe only when the
step's pops of each FIFO ring fit in what was free before the step (then pops
and pushes touch disjoint ring positions and no allocation program reads what
a release program writes); ``StepBuilder.fusable`` says so per step, and the
caller passes it in. A :class:`~graphalloc.graph.StepGraph` captures both
variants per descriptor buffer and replays the one the step allows.
"""

from __future__ import annotations

import torch

from .config import AllocatorConfig
from .device_state import DeviceState

__all__ = ["StepKernels"]


class StepKernels:
    """Launches one step's kernels for a descriptor buffer.

    Args:
        config: the allocator's configuration (backend, geometry, ``validate``).
        state: its device tables.
        fused: allow the one-launch variant. Off, every call is two launches.

    Never synchronises; safe to call inside CUDA graph capture. Returns before
    the device has finished.
    """

    def __init__(self, config: AllocatorConfig, state: DeviceState, *, fused: bool = False):
        self.config = config
        self.state = state
        self.fused = bool(fused)
        if config.backend == "triton":
            from .kernels.allocate import allocate_tokens
            from .kernels.release import release_pages
            from .kernels.step import run_step_fused
            self._release, self._allocate = release_pages, allocate_tokens
            self._step = run_step_fused
        else:
            from .kernels.allocate import allocate_tokens_torch
            from .kernels.release import release_pages_torch
            from .kernels.step import run_step_fused_torch
            self._release, self._allocate = release_pages_torch, allocate_tokens_torch
            self._step = run_step_fused_torch

    def __call__(self, release_rows: torch.Tensor, alloc_rows: torch.Tensor, *,
                 fusable: bool = False) -> None:
        """Run the step in ``release_rows`` / ``alloc_rows``. ``fusable``: the step's
        ``PlannedStep.fusable``; with it and ``fused=True`` the step is one launch,
        otherwise release then allocation."""
        cfg, st = self.config, self.state
        common = dict(page_size=cfg.page_size, n_full_cap=cfg.num_full_pages,
                      n_swa_cap=cfg.num_swa_pages, validate=cfg.validate)
        epochs = (st.full_epoch_buf, st.swa_epoch_buf)
        tables = (st.req_to_token_buf, st.full_to_swa_buf, st.full_free_buf, st.swa_free_buf,
                  st.ring_pages_buf)
        if fusable and self.fused:
            self._step(release_rows, alloc_rows, *tables, st.out_full_buf, st.out_swa_buf,
                       st.err_buf, n_release_lanes=cfg.max_step_pages,
                       n_alloc_lanes=cfg.max_step_tokens, epochs=epochs, **common)
            return
        self._release(release_rows, *tables, st.err_buf, n_lanes=cfg.max_step_pages,
                      epochs=epochs, **common)
        self._allocate(alloc_rows, *tables, st.out_full_buf, st.out_swa_buf, st.err_buf,
                       n_lanes=cfg.max_step_tokens, **common)
