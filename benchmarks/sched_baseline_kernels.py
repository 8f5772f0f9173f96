"""Shared parts of the scheduler benchmark's baselines (``sched_baselines.py``).

The clock protocol the drivers call around their device work (``NullClock``), the
SGLang-style allocation kernels (Triton, defined on first use) with their Torch twins
(``alloc_slots`` / ``write_rows``: one launch per pool and call), and the pinned host
buffers rewritten only after the copy that read them completed (``_PinnedRing``).
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["NullClock", "NULL_CLOCK", "alloc_slots", "write_rows", "alloc_slots_torch",
           "write_rows_torch", "BLOCK_T", "N_META", "M_ROW", "M_PRE", "M_N", "M_PREV",
           "M_LANE", "M_PAGE"]

BLOCK_T = 128  # tokens per loop iteration of the allocation kernels
# meta rows of one allocation call (int64 [6, k], one host-to-device copy)
M_ROW, M_PRE, M_N, M_PREV, M_LANE, M_PAGE = range(6)
N_META = 6


class NullClock:
    """The clock protocol the drivers call around their device work (here: nothing)."""

    def device_begin(self) -> None:
        pass

    def device_end(self) -> None:
        pass


NULL_CLOCK = NullClock()


def _ceil_div(a, b):
    return -(-a // b)


# ---- allocation kernels (Triton, defined on first use) and their Torch twins -------------
_KERNELS: dict = {}


def _triton_kernels():
    """``(alloc_slots_kernel, write_rows_kernel)``, defined on first use (``@triton.jit``
    reads TRITON_INTERPRET when it runs; the scripts settle it in ``main()``)."""
    if _KERNELS:
        return _KERNELS["alloc"], _KERNELS["write"]
    import triton
    import triton.language as tl

    args = {"do_not_specialize": ["k", "head", "cap", "page_size", "stride"]}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        args["do_not_specialize_on_alignment"] = ["meta_ptr"]

    @triton.jit(**args)
    def alloc_slots_kernel(meta_ptr, last_ptr, ring_ptr, out_ptr, k, head, cap, page_size,
                           stride, BLOCK: tl.constexpr):
        """Request i: tokens [pre, pre + n) -> slots; the partial page continues from the
        last location, new pages come from ring[(head + page0 + j) % cap]."""
        i = tl.program_id(0).to(tl.int64)
        pre = tl.load(meta_ptr + 1 * k + i)
        n = tl.load(meta_ptr + 2 * k + i).to(tl.int32)  # a chunk: < 2^31 tokens
        lane0 = tl.load(meta_ptr + 4 * k + i)
        page0 = tl.load(meta_ptr + 5 * k + i)
        last = tl.load(last_ptr + i)
        first_new = (pre + page_size - 1) // page_size * page_size
        for t0 in range(0, n, BLOCK):
            t = t0 + tl.arange(0, BLOCK)
            mask = t < n
            pos = pre + t
            cont = pos < first_new
            j = tl.where(cont, 0, (pos - first_new) // page_size)
            page = tl.load(ring_ptr + (head + page0 + j) % cap, mask=mask & ~cont, other=0)
            slot = tl.where(cont, last + 1 + t, page * page_size + pos % page_size)
            tl.store(out_ptr + lane0 + t, slot, mask=mask)

    @triton.jit(**args)
    def write_rows_kernel(meta_ptr, last_ptr, ring_ptr, out_ptr, k, head, cap, page_size,
                          stride, BLOCK: tl.constexpr):
        """Request i: req_to_token[row, pre:pre + n] = slots[lane0:lane0 + n] (``ring_ptr``
        is req_to_token, ``out_ptr`` the slots; the other pointers are unused)."""
        i = tl.program_id(0).to(tl.int64)
        row = tl.load(meta_ptr + 0 * k + i)
        pre = tl.load(meta_ptr + 1 * k + i)
        n = tl.load(meta_ptr + 2 * k + i).to(tl.int32)
        lane0 = tl.load(meta_ptr + 4 * k + i)
        for t0 in range(0, n, BLOCK):
            t = t0 + tl.arange(0, BLOCK)
            mask = t < n
            slot = tl.load(out_ptr + lane0 + t, mask=mask, other=0)
            tl.store(ring_ptr + row * stride + pre + t, slot, mask=mask)

    _KERNELS.update(alloc=alloc_slots_kernel, write=write_rows_kernel)
    return alloc_slots_kernel, write_rows_kernel


def _token_layout(meta: torch.Tensor, k: int, n_tokens: int):
    """Twins: per token its request index and offset t (device ops, sizes from the host)."""
    n = meta[M_N]
    req = torch.repeat_interleave(torch.arange(k, device=meta.device), n,
                                  output_size=n_tokens)
    t = torch.arange(n_tokens, device=meta.device) - meta[M_LANE][req]
    return req, t


def alloc_slots_torch(meta, last, ring, out, k: int, n_tokens: int, head: int, cap: int,
                      page_size: int) -> None:
    """Twin of the allocation kernel: same slots into ``out[:n_tokens]``."""
    ps = page_size
    req, t = _token_layout(meta, k, n_tokens)
    pos = meta[M_PRE][req] + t
    first_new = (meta[M_PRE][req] + ps - 1) // ps * ps
    cont = pos < first_new
    j = torch.where(cont, 0, (pos - first_new) // ps)
    page = ring[(head + meta[M_PAGE][req] + j) % cap]
    out[:n_tokens] = torch.where(cont, last[req] + 1 + t, page * ps + pos % ps)


def write_rows_torch(meta, req_to_token, slots, k: int, n_tokens: int) -> None:
    """Twin of the req_to_token write kernel."""
    req, t = _token_layout(meta, k, n_tokens)
    req_to_token[meta[M_ROW][req], meta[M_PRE][req] + t] = slots[:n_tokens]


def alloc_slots(meta, last, ring, out, k: int, n_tokens: int, head: int, cap: int,
                page_size: int, backend: str) -> None:
    """One pool's allocation for k requests: one launch (Triton) or the twin's ops."""
    if backend != "triton":
        return alloc_slots_torch(meta, last, ring, out, k, n_tokens, head, cap, page_size)
    kernel, _ = _triton_kernels()
    kernel[(k,)](meta, last, ring, out, k, head, cap, page_size, 0, BLOCK=BLOCK_T)


def write_rows(meta, req_to_token, slots, k: int, n_tokens: int, backend: str) -> None:
    """req_to_token rows of k requests: one launch (Triton) or the twin's ops."""
    if backend != "triton":
        return write_rows_torch(meta, req_to_token, slots, k, n_tokens)
    _, kernel = _triton_kernels()
    kernel[(k,)](meta, slots, req_to_token, slots, k, 0, 1, 1, req_to_token.stride(0),
                 BLOCK=BLOCK_T)


class _PinnedRing:
    """``n`` host buffers (pinned on CUDA), each rewritten only after the copy that read it
    completed (an event per buffer). ``stalls`` counts the waits."""

    def __init__(self, n: int, size: int, dtype, is_cuda: bool):
        self.bufs = [torch.zeros(size, dtype=dtype, pin_memory=is_cuda) for _ in range(n)]
        self.np = [b.numpy() for b in self.bufs]
        self.events = [None] * n
        self.is_cuda = is_cuda
        self.next = 0
        self.stalls = 0

    def acquire(self) -> int:
        i = self.next
        event = self.events[i]
        if event is not None and not event.query():
            self.stalls += 1
            event.synchronize()  # only when the device is n copies behind
        self.next = (i + 1) % len(self.bufs)
        return i

    def submitted(self, i: int) -> None:
        if self.is_cuda:
            event = self.events[i] or torch.cuda.Event()
            event.record()
            self.events[i] = event


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run benchmarks/bench_scheduler.py "
            "instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
