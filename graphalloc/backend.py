"""Backends: which kernels execute a planned step.

``torch`` is the fixed-shape, sync-free reference (any device); ``triton`` runs
the Triton kernels (a GPU, or the CPU through ``TRITON_INTERPRET=1``). Both
take the same arguments and must leave identical state.
"""

from __future__ import annotations

import torch

from .config import AllocatorConfig
from .device_state import DeviceState

__all__ = ["StepKernels"]


class StepKernels:
    """Launches one step's kernels (release, then allocation) for a descriptor buffer.

    Never synchronises; safe to call inside CUDA graph capture. Returns before
    the device has finished.
    """

    def __init__(self, config: AllocatorConfig, state: DeviceState):
        self.config = config
        self.state = state
        if config.backend == "triton":
            from .kernels.allocate import allocate_tokens
            from .kernels.release import release_pages
            self._release, self._allocate = release_pages, allocate_tokens
        else:
            from .kernels.allocate import allocate_tokens_torch
            from .kernels.release import release_pages_torch
            self._release, self._allocate = release_pages_torch, allocate_tokens_torch

    def __call__(self, release_rows: torch.Tensor, alloc_rows: torch.Tensor) -> None:
        cfg, st = self.config, self.state
        common = dict(page_size=cfg.page_size, n_full_cap=cfg.num_full_pages,
                      n_swa_cap=cfg.num_swa_pages, validate=cfg.validate)
        self._release(release_rows, st.req_to_token_buf, st.full_to_swa_buf, st.full_free_buf,
                      st.swa_free_buf, st.ring_pages_buf, st.err_buf,
                      n_lanes=cfg.max_step_pages, **common)
        self._allocate(alloc_rows, st.req_to_token_buf, st.full_to_swa_buf, st.full_free_buf,
                       st.swa_free_buf, st.ring_pages_buf, st.out_full_buf, st.out_swa_buf,
                       st.err_buf, n_lanes=cfg.max_step_tokens, **common)
