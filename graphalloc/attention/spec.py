"""What the step's attention page tables hold: :class:`PageTableSpec`, the option that makes
every planned step also plan the attention metadata of its batch.

``HybridAllocator(cfg, page_tables=PageTableSpec(max_batch=256))`` gives the allocator
static device buffers for the forms and layers listed (FlashInfer's CSR -- ``kv_indptr``,
``kv_indices``, ``kv_last_page_len`` -- and FlashAttention/vLLM block tables with
``seq_lens``; FULL and SWA layers), written inside the step's replay, after its
allocations, from lane rows the planner writes into the same descriptor buffer. The batch
is the step's: lane i is the i-th decode row, then the extend rows, in the order given; a
lane's query is its new tokens (1 + k for a speculative verify, the chunk for a prefill),
so an extend row of 0 tokens has no lane (the lanes after it move up).

The SWA range of a lane serves every query of it: the first query, at position
``L - q``, reads keys ``>= L - q - W + 1`` (W the model's window), so the range starts at
``ws = max(f, L - (q - 1) - W, 0)`` (f the frontier after the step's evictions) and holds
the SWA pages of ``[floor_page(ws), L)``; keys of that first page below ``ws`` must be masked
by the attention (FlashInfer ``window_left = W - 1``). Block-table entries outside the range
are the null page 0.

Cost: host O(lanes) in the planner (compiled: nanoseconds per lane); device one kernel of
``max_batch`` programs per step with a batch (see :mod:`graphalloc.kernels.page_table`).
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import ConfigError

__all__ = ["PageTableSpec", "FORMS", "LAYERS"]

FORMS = ("csr", "block_table")
LAYERS = ("full", "swa")


@dataclasses.dataclass(frozen=True)
class PageTableSpec:
    """The attention tables every step writes (see the module docstring).

    Args:
        max_batch: B, lanes of the attention batch: the frozen batch size of the buffers.
        forms: any of ``"csr"`` (FlashInfer) and ``"block_table"`` (FlashAttention/vLLM).
        layers: any of ``"full"`` and ``"swa"``; an engine pays only for what it lists.
        model_window: W, the model's window (Hugging Face ``sliding_window``: a query reads
            its last W keys, itself included); 0: the allocator's window + 1.
        max_pages_per_req: block-table width; 0: ``ceil(max_context_len / page_size)``.
        max_full_indices: FULL ``kv_indices`` capacity; 0: ``B * max_pages_per_req``.
        max_swa_indices: SWA ``kv_indices`` capacity; 0: ``B * min(max_pages_per_req,
            ceil((W + q_max) / page_size) + 1)`` with q_max the longest query a row can
            have (``max_tokens_per_alloc_row``).
        out_dtype: ``torch.int32`` (what FlashInfer and FlashAttention take) or int64.
    """

    max_batch: int
    forms: tuple = FORMS
    layers: tuple = LAYERS
    model_window: int = 0
    max_pages_per_req: int = 0
    max_full_indices: int = 0
    max_swa_indices: int = 0
    out_dtype: torch.dtype = torch.int32

    def __post_init__(self) -> None:
        def fix(name, value):
            object.__setattr__(self, name, value)

        for name in ("max_batch",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"PageTableSpec: {name} must be an int >= 1, got {value!r}")
        for name in ("model_window", "max_pages_per_req", "max_full_indices",
                     "max_swa_indices"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"PageTableSpec: {name} must be an int >= 0 (0 picks the "
                                  f"default), got {value!r}")
        for name, allowed in (("forms", FORMS), ("layers", LAYERS)):
            value = getattr(self, name)
            value = (value,) if isinstance(value, str) else tuple(value)
            if not value or any(v not in allowed for v in value) or len(set(value)) != len(value):
                raise ConfigError(f"PageTableSpec: {name} must be a non-empty tuple of "
                                  f"{allowed}, got {getattr(self, name)!r}")
            fix(name, value)
        if self.out_dtype not in (torch.int32, torch.int64):
            raise ConfigError(f"PageTableSpec: out_dtype must be torch.int32 or torch.int64, "
                              f"got {self.out_dtype}")

    def has(self, form: str, layer: str) -> bool:
        return form in self.forms and layer in self.layers

    def resolve(self, config) -> PageTableSpec:
        """This spec with every 0 filled from ``config`` (an AllocatorConfig)."""
        ps = config.page_size
        if not config.pools.window.has_window:
            if "swa" in self.layers:
                raise ConfigError("PageTableSpec: the model has no window layers (no "
                                  "SlidingWindow or ChunkedLocal pool), so there are no SWA "
                                  "tables to write; pass layers=('full',)")
            window = 1
        else:
            window = self.model_window or config.sliding_window + 1
        width = self.max_pages_per_req or -(-config.max_context_len // ps)
        if width * ps < config.max_context_len:
            raise ConfigError(f"PageTableSpec: max_pages_per_req={width} pages of {ps} cannot "
                              f"hold max_context_len={config.max_context_len}")
        swa_width = min(width, -(-(window + config.max_tokens_per_alloc_row) // ps) + 1)
        return dataclasses.replace(
            self, model_window=window, max_pages_per_req=width,
            max_full_indices=self.max_full_indices or self.max_batch * width,
            max_swa_indices=self.max_swa_indices or self.max_batch * swa_width)
