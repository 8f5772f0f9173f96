"""What an allocator's tables cost in memory, and the refusal of a config that cannot fit.

``HybridAllocator`` allocates every table once, at construction. A config whose tables
cannot fit (a typo of ``num_full_pages=10**12``, a ``max_context_len`` meant for tokens in
another unit) must be refused with a :class:`~graphalloc.errors.ConfigError` naming the
tables and the fix, before anything is allocated, not with numpy's ``MemoryError`` or
torch's allocator failure half-way through. :func:`table_bytes` lists the large tables by
name (host: the ledger's page mirror and per-row arrays; device: ``req_to_token``,
``full_to_swa``, the free rings, the epoch and state tables; pinned: the descriptor ring);
:func:`check_fits` refuses a config whose tables exceed the memory there is (host RAM;
the GPU's total memory for device tables on CUDA), and :func:`building` turns an
allocation that fails anyway (memory taken by others) into the same error. Cost: O(1);
one device-property query on CUDA.
"""

from __future__ import annotations

import contextlib
import os

import torch

from .device.layout import DescriptorLayout
from .errors import ConfigError
from .kernels.abi import ROW_WIDTH

__all__ = ["table_bytes", "check_fits", "building"]

_GIB = float(1 << 30)


def table_bytes(config, n_descriptor_bufs: int = 2, layout=None) -> dict:
    """``{"host": {name: bytes}, "device": {name: bytes}}`` of the large tables (an
    estimate: the small per-step buffers are left out). ``layout``: the descriptor's
    (:class:`~graphalloc.device.layout.DescriptorLayout`; None: the config's, without page
    tables)."""
    cfg = config
    if layout is None:
        layout = DescriptorLayout.of(cfg)
    idx = torch.empty(0, dtype=cfg.index_dtype).element_size()
    n_rows = cfg.max_reqs + cfg.max_handles
    n_state = cfg.max_reqs + cfg.max_handles + cfg.max_reqs * cfg.max_spec_tokens
    host = {
        "ledger rows": n_rows * 8 * 8 + cfg.max_reqs * 8 * 2 * cfg.max_spec_tokens,
        "descriptor ring": n_descriptor_bufs * 8 * ROW_WIDTH * layout.n_rows,
        "state ring": 8 * cfg.num_state_slots,
    }
    if not cfg.ring_mode:
        host["page mirror (page_of)"] = 4 * n_rows * cfg.pages_per_request
        host["page mirror (pools)"] = 4 * 3 * (cfg.num_full_pages + cfg.num_swa_pages + 2)
    device = {
        "req_to_token": idx * (n_rows + 1) * cfg.max_context_len,
        "full_to_swa": idx * (cfg.num_full_pages + 1) * cfg.page_size,
        "free rings": idx * (cfg.num_full_pages + cfg.num_swa_pages + 2),
        "epoch tables": 8 * (cfg.num_full_pages + cfg.num_swa_pages + 2),
        "ring_pages": idx * (cfg.max_reqs + 1) * max(1, cfg.swa_ring_pages),
        "output slots": 2 * idx * (cfg.max_step_tokens + 1),
        "state table": idx * (n_state + 1 if cfg.num_state_slots else 1),
    }
    return {"host": host, "device": device}


def _host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        return None


def _device_memory(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    try:
        return torch.cuda.get_device_properties(device).total_memory
    except Exception:  # no usable device: the construction reports it later
        return None


def _describe(parts: dict) -> str:
    big = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
    return ", ".join(f"{name} {size / _GIB:.3g} GiB" for name, size in big)


def check_fits(config, n_descriptor_bufs: int = 2, layout=None) -> None:
    """Refuse (``ConfigError``) a config whose tables exceed the memory there is; nothing is
    allocated before. Device tables on a CPU device count as host memory. ``layout``: as
    :func:`table_bytes`."""
    sizes = table_bytes(config, n_descriptor_bufs, layout)
    host, device = dict(sizes["host"]), sizes["device"]
    dev = torch.device(config.device)
    on_device = _device_memory(dev)
    if dev.type != "cuda":
        host.update(device)
    checks = [("host", host, _host_memory())]
    if dev.type == "cuda":
        checks.append((f"{dev}", device, on_device))
    for where, parts, have in checks:
        need = sum(parts.values())
        if have is not None and need > have:
            raise ConfigError(
                f"this config's tables need {need / _GIB:.3g} GiB of {where} memory "
                f"({_describe(parts)}); there are {have / _GIB:.3g} GiB. Lower the sizes "
                "that drive them (req_to_token: (max_reqs + max_handles) x max_context_len; "
                "the pools: num_full_pages / num_swa_pages; num_state_slots), or check their "
                "units (max_context_len in tokens, pools in pages)")


def _out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


@contextlib.contextmanager
def building(config):
    """Around the construction of the tables: an allocation that fails anyway (the memory
    :func:`check_fits` saw is taken by others) becomes a :class:`ConfigError` (cause
    chained); every other error passes through."""
    try:
        yield
    except Exception as exc:
        if not _out_of_memory(exc):
            raise
        raise _refused(config, exc) from exc


def _refused(config, exc: BaseException) -> ConfigError:
    sizes = table_bytes(config)
    return ConfigError(
        f"allocating the allocator's tables failed ({type(exc).__name__}: {exc}); they need "
        f"about {sum(sizes['host'].values()) / _GIB:.3g} GiB of host and "
        f"{sum(sizes['device'].values()) / _GIB:.3g} GiB of {config.device} memory "
        f"({_describe({**sizes['host'], **sizes['device']})}). Free memory, or lower the "
        "sizes that drive them")
