"""The two launches of an engine-facing allocator step on host-counted page rings.

``ring_frees``: the frees recorded since the last step, one launch. Programs
``[0, cdiv(n_swa, BLOCK))`` take SWA representatives (full slots whose SWA peer goes
back), the rest take FULL representatives (full slots whose full page goes back)::

    # SWA section, lane i < n_swa
    rep = swa_reps[i]; peer = full_to_swa[rep]
    swa_page = peer // ps if peer > 0 else 0;  faults += (peer <= 0)
    barrier                                  # rep is one of the slots cleared next
    full_to_swa[(rep // ps) * ps + 0..ps-1] = 0
    swa_ring[(swa_tail + i) % n_swa_ring] = swa_page
    # FULL section, lane j < n_full
    full_ring[(full_tail + j) % n_full_ring] = full_reps[j] // ps

``ring_alloc``: the allocation, one launch, one lane per new token. The host built a
descriptor row per token (owner request, fresh-page rank or -1, offset)::

    loc = last_loc[owner]
    if rank < 0:  full = loc + 1 + off;  swa = full_to_swa[loc] + 1 + off
    else:         full = full_ring[(full_head + rank) % n_full_ring] * ps + off
                  swa  = swa_ring[(swa_head + rank) % n_swa_ring] * ps + off
    out[t] = full;  full_to_swa[full] = swa          # (no SWA pool: out only)

Bytes: per freed page two index reads, ps index writes (the clear), one ring write; per
new token three descriptor reads, two gathers, two writes. Padded lanes exit through
masks. ``ring_frees_torch`` / ``ring_alloc_torch`` are the twins: same signature, same
results, fixed-shape eager ops. No launch synchronises; the host passes every count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["ring_frees", "ring_frees_torch", "ring_alloc", "ring_alloc_torch"]

_BLOCK = 128


@triton.jit
def _push_full_pages(full_reps_ptr, full_ring_ptr, block, n_full, full_tail, n_full_ring,
                     page_size, BLOCK: tl.constexpr):
    lanes = block * BLOCK + tl.arange(0, BLOCK)
    live = lanes < n_full
    rep = tl.load(full_reps_ptr + lanes, mask=live, other=0).to(tl.int64)
    tl.store(full_ring_ptr + (full_tail + lanes) % n_full_ring, rep // page_size, mask=live)


@triton.jit(do_not_specialize=["n_swa", "n_full", "swa_tail", "full_tail"])
def _ring_frees_kernel(swa_reps_ptr, full_reps_ptr, f2s_ptr, swa_ring_ptr, full_ring_ptr,
                       faults_ptr, n_swa, n_full, swa_tail, full_tail, n_swa_ring,
                       n_full_ring, page_size,
                       HAS_SWA: tl.constexpr, BLOCK: tl.constexpr, BLOCK_PS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    if HAS_SWA:
        n_swa_programs = tl.cdiv(n_swa, BLOCK)
        if pid < n_swa_programs:
            lanes = pid * BLOCK + tl.arange(0, BLOCK)
            live = lanes < n_swa
            rep = tl.load(swa_reps_ptr + lanes, mask=live, other=0).to(tl.int64)
            peer = tl.load(f2s_ptr + rep, mask=live, other=0).to(tl.int64)
            mapped = peer > 0
            swa_page = tl.where(mapped, peer // page_size, 0)
            tl.atomic_add(faults_ptr, tl.sum((live & ~mapped).to(tl.int64), axis=0))
            offs = tl.arange(0, BLOCK_PS)
            slots = ((rep // page_size) * page_size)[:, None] + offs[None, :]
            tile = live[:, None] & (offs[None, :] < page_size)
            tl.debug_barrier()  # every gather before any clear: rep is a cleared slot
            tl.store(f2s_ptr + slots,
                     tl.zeros([BLOCK, BLOCK_PS], f2s_ptr.dtype.element_ty), mask=tile)
            tl.store(swa_ring_ptr + (swa_tail + lanes) % n_swa_ring, swa_page, mask=live)
        else:
            _push_full_pages(full_reps_ptr, full_ring_ptr, pid - n_swa_programs, n_full,
                             full_tail, n_full_ring, page_size, BLOCK)
    else:
        _push_full_pages(full_reps_ptr, full_ring_ptr, pid, n_full, full_tail, n_full_ring,
                         page_size, BLOCK)


def ring_frees(swa_reps, full_reps, full_to_swa, swa_ring, full_ring, faults, n_swa: int,
               n_full: int, swa_tail: int, full_tail: int, page_size: int) -> None:
    """Run the recorded frees (see the module docstring): ``swa_reps[:n_swa]`` give back
    their SWA peers into ``swa_ring`` from position ``swa_tail``, ``full_reps[:n_full]``
    their full pages into ``full_ring`` from ``full_tail``; ``faults`` (a 0-d int64) counts
    SWA representatives without a peer. ``full_to_swa``/``swa_ring`` None: no SWA pool."""
    has_swa = full_to_swa is not None
    n_swa = n_swa if has_swa else 0
    grid = triton.cdiv(n_swa, _BLOCK) + triton.cdiv(n_full, _BLOCK)
    if grid == 0:
        return
    dummy = full_ring
    _ring_frees_kernel[(grid,)](
        swa_reps if has_swa else dummy, full_reps, full_to_swa if has_swa else dummy,
        swa_ring if has_swa else dummy, full_ring, faults, n_swa, n_full, swa_tail,
        full_tail, swa_ring.numel() if has_swa else 1, full_ring.numel(), page_size,
        HAS_SWA=has_swa, BLOCK=_BLOCK, BLOCK_PS=triton.next_power_of_2(page_size))


def ring_frees_torch(swa_reps, full_reps, full_to_swa, swa_ring, full_ring, faults,
                     n_swa: int, n_full: int, swa_tail: int, full_tail: int,
                     page_size: int) -> None:
    """Reference twin of :func:`ring_frees`: same signature, same results."""
    ps = page_size
    if full_to_swa is not None and n_swa:
        rep = swa_reps[:n_swa].to(torch.int64)
        peer = full_to_swa[rep].to(torch.int64)
        mapped = peer > 0
        faults += (~mapped).sum()
        swa_page = torch.where(mapped, peer // ps, 0)
        slots = ((rep // ps * ps)[:, None] + torch.arange(ps, device=rep.device)).reshape(-1)
        full_to_swa.index_fill_(0, slots, 0)  # after the gathers above: the twin's barrier
        pos = (torch.arange(n_swa, device=rep.device) + swa_tail) % swa_ring.numel()
        swa_ring.index_copy_(0, pos, swa_page.to(swa_ring.dtype))
    if n_full:
        rep = full_reps[:n_full].to(torch.int64)
        pos = (torch.arange(n_full, device=rep.device) + full_tail) % full_ring.numel()
        full_ring.index_copy_(0, pos, (rep // ps).to(full_ring.dtype))


@triton.jit(do_not_specialize=["n_tokens", "full_head", "swa_head"])
def _ring_alloc_kernel(desc_ptr, last_loc_ptr, f2s_ptr, full_ring_ptr, swa_ring_ptr,
                       out_ptr, n_tokens, full_head, swa_head, n_full_ring, n_swa_ring,
                       page_size, HAS_SWA: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    lanes = pid * BLOCK + tl.arange(0, BLOCK)
    live = lanes < n_tokens
    owner = tl.load(desc_ptr + lanes, mask=live, other=0)
    rank = tl.load(desc_ptr + n_tokens + lanes, mask=live, other=-1)
    off = tl.load(desc_ptr + 2 * n_tokens + lanes, mask=live, other=0)
    tail = rank < 0
    loc = tl.load(last_loc_ptr + owner, mask=live & tail, other=0).to(tl.int64)
    pick = tl.where(tail, 0, rank)
    page = tl.load(full_ring_ptr + (full_head + pick) % n_full_ring, mask=live & ~tail,
                   other=0).to(tl.int64)
    full = tl.where(tail, loc + 1 + off, page * page_size + off)
    tl.store(out_ptr + lanes, full, mask=live)
    if HAS_SWA:
        swa_loc = tl.load(f2s_ptr + loc, mask=live & tail, other=0).to(tl.int64)
        swa_page = tl.load(swa_ring_ptr + (swa_head + pick) % n_swa_ring,
                           mask=live & ~tail, other=0).to(tl.int64)
        swa = tl.where(tail, swa_loc + 1 + off, swa_page * page_size + off)
        tl.store(f2s_ptr + full, swa.to(f2s_ptr.dtype.element_ty), mask=live)


def ring_alloc(desc, last_loc, full_to_swa, full_ring, swa_ring, out, n_tokens: int,
               full_head: int, swa_head: int, page_size: int) -> None:
    """Write the ``n_tokens`` new slots into ``out`` (and pair them in ``full_to_swa``) from
    ``desc`` (int64 ``[3, n_tokens]``: owner, fresh-page rank or -1, offset), ``last_loc``
    and the rings' pages from ``full_head`` / ``swa_head``; see the module docstring."""
    if n_tokens == 0:
        return
    has_swa = full_to_swa is not None
    _ring_alloc_kernel[(triton.cdiv(n_tokens, _BLOCK),)](
        desc, last_loc, full_to_swa if has_swa else out, full_ring,
        swa_ring if has_swa else full_ring, out, n_tokens, full_head, swa_head,
        full_ring.numel(), swa_ring.numel() if has_swa else 1, page_size,
        HAS_SWA=has_swa, BLOCK=_BLOCK)


def ring_alloc_torch(desc, last_loc, full_to_swa, full_ring, swa_ring, out, n_tokens: int,
                     full_head: int, swa_head: int, page_size: int) -> None:
    """Reference twin of :func:`ring_alloc`: same signature, same results."""
    if n_tokens == 0:
        return
    owner, rank, off = desc[0], desc[1], desc[2]
    tail = rank < 0
    pick = rank.clamp(min=0)
    loc = last_loc.to(torch.int64)[owner]
    page = full_ring[(pick + full_head) % full_ring.numel()]
    full = torch.where(tail, loc + 1 + off, page * page_size + off)
    out.copy_(full)
    if full_to_swa is not None:
        swa_loc = full_to_swa[loc].to(torch.int64)
        swa_page = swa_ring[(pick + swa_head) % swa_ring.numel()]
        swa = torch.where(tail, swa_loc + 1 + off, swa_page * page_size + off)
        full_to_swa[full] = swa.to(full_to_swa.dtype)
