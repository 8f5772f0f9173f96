"""The allocator's geometry and frozen capacities, in one dataclass."""

from __future__ import annotations

import dataclasses
import math

import torch

from .errors import ConfigError

__all__ = ["AllocatorConfig"]


@dataclasses.dataclass(frozen=True)
class AllocatorConfig:
    """Geometry of the two pools and the frozen shape of a step.

    Pools: the FULL pool has pages ``1..num_full_pages`` and the SWA pool pages
    ``1..num_swa_pages``; page 0 of each is a sink that is never handed out.
    A slot is ``page * page_size + offset``.

    The ``max_*`` fields freeze the step descriptor's shape, so a captured
    graph never sees a new shape: a step that needs more rows, pages or tokens
    is refused with :class:`~graphalloc.errors.BatchTooLargeError`.

    Args:
        page_size: tokens per page (any positive integer).
        num_full_pages: usable FULL pages (page 0 excluded).
        num_swa_pages: usable SWA pages (page 0 excluded).
        max_reqs: rows of ``req_to_token``.
        max_context_len: columns of ``req_to_token`` (positions per request).
        sliding_window: W, in tokens: an SWA layer at length L reads positions ``>= L - W``.
        index_dtype: ``torch.int32`` or ``torch.int64`` for slots and page ids on the device.
        device: where the device tables live (``"cpu"`` runs everything eagerly).
        backend: ``"torch"`` (reference) or ``"triton"``.
        swa_ring_pages: 0 for pool mode; R > 0 gives each request a fixed ring of
            R SWA pages (needs ``R >= ceil(W / page_size) + 1``).
        max_release_rows: release/evict segment rows per step.
        max_pages_per_row: pages in one release row (longer segments are split).
        max_alloc_rows: allocation rows (requests allocating) per step.
        max_tokens_per_alloc_row: tokens one request may allocate in one step.
        max_step_pages: pages freed in one step, all release rows together.
        max_step_tokens: tokens allocated in one step, all allocation rows together.
        validate: device-side validation inside the kernels (debug; off by default).
    """

    page_size: int
    num_full_pages: int
    num_swa_pages: int
    max_reqs: int
    max_context_len: int
    sliding_window: int
    index_dtype: torch.dtype = torch.int64
    device: str | torch.device = "cpu"
    backend: str = "torch"
    swa_ring_pages: int = 0
    max_release_rows: int = 0  # 0: 3 * max_reqs
    max_pages_per_row: int = 0  # 0: pages of max_context_len
    max_alloc_rows: int = 0  # 0: max_reqs
    max_tokens_per_alloc_row: int = 0  # 0: max_context_len
    max_step_pages: int = 0  # 0: num_full_pages + num_swa_pages
    max_step_tokens: int = 0  # 0: max_alloc_rows + max_tokens_per_alloc_row
    validate: bool = False

    def __post_init__(self) -> None:
        def fix(name: str, value: int) -> None:
            object.__setattr__(self, name, value)

        for name in ("page_size", "num_full_pages", "num_swa_pages", "max_reqs",
                     "max_context_len", "sliding_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if self.index_dtype not in (torch.int32, torch.int64):
            raise ConfigError(
                f"index_dtype must be torch.int32 or torch.int64, got {self.index_dtype}")
        if self.backend not in ("torch", "triton"):
            raise ConfigError(f"backend must be 'torch' or 'triton', got {self.backend!r}")
        fix("device", torch.device(self.device))
        max_slot = (max(self.num_full_pages, self.num_swa_pages) + 1) * self.page_size
        if self.index_dtype == torch.int32 and max_slot >= 2**31:
            raise ConfigError(
                f"{max_slot} slots do not fit int32 indices; use index_dtype=torch.int64")
        if self.swa_ring_pages < 0:
            raise ConfigError(f"swa_ring_pages must be >= 0, got {self.swa_ring_pages}")
        if self.swa_ring_pages:
            need = math.ceil(self.sliding_window / self.page_size) + 1
            if self.swa_ring_pages < need:
                raise ConfigError(
                    f"swa_ring_pages={self.swa_ring_pages} cannot hold a window of "
                    f"{self.sliding_window} tokens at page_size {self.page_size}: need >= {need}")
        fix("max_release_rows", self.max_release_rows or 3 * self.max_reqs)
        fix("max_pages_per_row", self.max_pages_per_row or self.pages_per_request)
        fix("max_alloc_rows", self.max_alloc_rows or self.max_reqs)
        fix("max_tokens_per_alloc_row", self.max_tokens_per_alloc_row or self.max_context_len)
        fix("max_step_pages", self.max_step_pages or self.num_full_pages + self.num_swa_pages)
        fix("max_step_tokens",
            self.max_step_tokens or self.max_alloc_rows + self.max_tokens_per_alloc_row)
        for name in ("max_release_rows", "max_pages_per_row", "max_alloc_rows",
                     "max_tokens_per_alloc_row", "max_step_pages", "max_step_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def ring_mode(self) -> bool:
        return self.swa_ring_pages > 0

    @property
    def pages_per_request(self) -> int:
        """Most pages one request can span: ``ceil(max_context_len / page_size)``."""
        return -(-self.max_context_len // self.page_size)

    @property
    def num_full_slots(self) -> int:
        """Length of ``full_to_swa``: ``(num_full_pages + 1) * page_size``."""
        return (self.num_full_pages + 1) * self.page_size

