"""The device error word: how kernels report faults without killing the context.

Layout of ``err`` (int64, 8 entries, on the device)::

    ERR_CODES   OR of every FaultCode bit seen since the last reset
    ERR_COUNT   number of faulting lanes since the last reset
    ERR_CLAIMED 0 until the first fault claims the record below (compare-and-swap)
    ERR_CODE    first fault's code
    ERR_ROW     first fault's descriptor row
    ERR_REQ     first fault's request
    ERR_PAGE    first fault's page (full page for release, popped value for alloc)
    ERR_STAGE   first fault's stage: 0 release, 1 alloc, 2 single-call op

Within one launch the first record is the fault of the lowest (row, lane) in
the Torch twin and in the interpreter; on a GPU, programs race for the claim,
so any faulting row may win (the bits and the count are exact either way).

Kernels record through :func:`record_faults` (one block of lanes at a time)::

    n = number of faulting lanes in the block
    if n > 0:
        atomic_or(err[ERR_CODES], code); atomic_add(err[ERR_COUNT], n)
        if atomic_cas(err[ERR_CLAIMED], 0, 1) == 0:     # one claim attempt per block
            err[ERR_CODE:] = code, row, req, page of the block's lowest faulting lane, stage

Validate mode checks several rules per lane; it records through
:func:`record_fault_bits`, which takes each lane's FaultCode bits at once: the
word gets the OR of the bits, the count grows by the lanes with any bit set
(a lane is counted once, however many rules it breaks), and the claim goes to
the lowest faulting lane with the lowest bit it carries. One call per block
keeps the first record in (row, lane) order whatever the mix of codes, so the
Torch twin (:func:`record_fault_bits_torch`) gives the same record.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = [
    "ERR_CODES", "ERR_COUNT", "ERR_CLAIMED", "ERR_CODE", "ERR_ROW", "ERR_REQ", "ERR_PAGE",
    "ERR_STAGE", "ERR_WORDS", "STAGE_RELEASE", "STAGE_ALLOC", "STAGE_SINGLE",
    "N_FAULT_BITS", "new_error_word", "record_faults_torch", "record_faults",
    "record_fault_bits_torch", "record_fault_bits",
]

ERR_CODES, ERR_COUNT, ERR_CLAIMED, ERR_CODE, ERR_ROW, ERR_REQ, ERR_PAGE, ERR_STAGE = range(8)
ERR_WORDS = 8
STAGE_RELEASE, STAGE_ALLOC, STAGE_SINGLE = 0, 1, 2
N_FAULT_BITS = 5  # FaultCode bits 1 .. 16

# The same offsets as constexprs: jit functions may only read constexpr globals.
_CODES, _COUNT = tl.constexpr(ERR_CODES), tl.constexpr(ERR_COUNT)
_CLAIMED, _CODE = tl.constexpr(ERR_CLAIMED), tl.constexpr(ERR_CODE)
_ROW, _REQ = tl.constexpr(ERR_ROW), tl.constexpr(ERR_REQ)
_PAGE, _STAGE = tl.constexpr(ERR_PAGE), tl.constexpr(ERR_STAGE)
_N_FAULT_BITS = tl.constexpr(N_FAULT_BITS)


def new_error_word(device: torch.device | str) -> torch.Tensor:
    return torch.zeros(ERR_WORDS, dtype=torch.int64, device=device)


def record_faults_torch(err: torch.Tensor, fault: torch.Tensor, code: int, stage: int,
                        row: torch.Tensor, req: torch.Tensor, page: torch.Tensor,
                        order: torch.Tensor | None = None) -> None:
    """Fixed-shape, sync-free fault recording for the Torch twins.

    ``fault`` is a bool lane mask; ``row``, ``req``, ``page`` give each lane's
    record fields (same shape). The first faulting lane claims the record if
    nobody has since the last reset: the lowest ``order`` (an int64 lane key,
    distinct per lane) when given, else the first in flat order.
    """
    fault = fault.reshape(-1)
    count = fault.sum(dtype=torch.int64)
    any_fault = count > 0
    if order is None:
        first = torch.argmax(fault.to(torch.int8))  # first True lane (0 when none)
    else:
        big = torch.iinfo(torch.int64).max
        first = torch.argmin(torch.where(fault, order.reshape(-1), big))
    first = first.reshape(1)  # a 0-dim tensor index would be read on the host (a sync)
    record = torch.stack([
        torch.ones((), dtype=torch.int64, device=err.device),
        torch.full((), code, dtype=torch.int64, device=err.device),
        row.reshape(-1)[first][0].to(torch.int64),
        req.reshape(-1)[first][0].to(torch.int64),
        page.reshape(-1)[first][0].to(torch.int64),
        torch.full((), stage, dtype=torch.int64, device=err.device),
    ])
    claim = (err[ERR_CLAIMED] == 0) & any_fault
    err[ERR_CLAIMED:] = torch.where(claim, record, err[ERR_CLAIMED:])
    err[ERR_CODES] |= torch.where(any_fault, code, 0)
    err[ERR_COUNT] += count


@triton.jit
def record_faults(err_ptr, fault, lanes, code: tl.constexpr, stage: tl.constexpr, row, req, page,
                  BLOCK: tl.constexpr):
    """Record one block's faults: ``fault`` is a bool ``[BLOCK]`` mask over ``lanes``
    (``tl.arange(0, BLOCK)``); ``page`` gives each lane's page; ``row``, ``req`` are scalars.
    The block's lowest faulting lane attempts the claim once."""
    n_fault = tl.sum(fault.to(tl.int64), axis=0)
    if n_fault > 0:
        zero = n_fault * 0  # an int64 scalar: the word's type for the atomics below
        first = tl.min(tl.where(fault, lanes, BLOCK), axis=0)
        first_page = tl.sum(tl.where(lanes == first, page.to(tl.int64), 0), axis=0)
        tl.atomic_or(err_ptr + _CODES, zero + code)
        tl.atomic_add(err_ptr + _COUNT, n_fault)
        claimed = tl.atomic_cas(err_ptr + _CLAIMED, zero, zero + 1)
        if claimed == 0:
            tl.store(err_ptr + _CODE, zero + code)
            tl.store(err_ptr + _ROW, zero + row)
            tl.store(err_ptr + _REQ, zero + req)
            tl.store(err_ptr + _PAGE, first_page)
            tl.store(err_ptr + _STAGE, zero + stage)


def record_fault_bits_torch(err: torch.Tensor, bits: torch.Tensor, stage: int, row: torch.Tensor,
                            req: torch.Tensor, page: torch.Tensor,
                            order: torch.Tensor | None = None) -> None:
    """Twin of :func:`record_fault_bits`: ``bits`` holds each lane's FaultCode bits (int64,
    0 = no fault). Fixed-shape and sync-free; the claim as in :func:`record_faults_torch`,
    with the first lane's lowest bit as the code."""
    bits = bits.reshape(-1).to(torch.int64)
    fault = bits != 0
    count = fault.sum(dtype=torch.int64)
    any_fault = count > 0
    codes = torch.zeros((), dtype=torch.int64, device=err.device)
    for bit in range(N_FAULT_BITS):
        codes = codes | torch.where(((bits >> bit) & 1).any(), 1 << bit, 0)
    if order is None:
        first = torch.argmax(fault.to(torch.int8))  # first faulting lane (0 when none)
    else:
        big = torch.iinfo(torch.int64).max
        first = torch.argmin(torch.where(fault, order.reshape(-1), big))
    first = first.reshape(1)  # a 0-dim tensor index would be read on the host (a sync)
    first_bits = bits[first][0]
    record = torch.stack([
        torch.ones((), dtype=torch.int64, device=err.device),
        first_bits & -first_bits,  # its lowest bit
        row.reshape(-1)[first][0].to(torch.int64),
        req.reshape(-1)[first][0].to(torch.int64),
        page.reshape(-1)[first][0].to(torch.int64),
        torch.full((), stage, dtype=torch.int64, device=err.device),
    ])
    claim = (err[ERR_CLAIMED] == 0) & any_fault
    err[ERR_CLAIMED:] = torch.where(claim, record, err[ERR_CLAIMED:])
    err[ERR_CODES] |= codes
    err[ERR_COUNT] += count


@triton.jit
def record_fault_bits(err_ptr, bits, lanes, stage: tl.constexpr, row, req, page,
                      BLOCK: tl.constexpr):
    """Record one block's faults of several kinds: ``bits`` is an int64 ``[BLOCK]`` of
    FaultCode bits per lane (0 = none). Adds the OR of the bits to the word and the number of
    faulting lanes to the count; the block's lowest faulting lane attempts the claim once,
    with its lowest bit as the code."""
    fault = bits != 0
    n_fault = tl.sum(fault.to(tl.int64), axis=0)
    if n_fault > 0:
        zero = n_fault * 0  # an int64 scalar: the word's type for the atomics below
        codes = zero
        for bit in tl.static_range(_N_FAULT_BITS):
            codes = codes | (tl.max((bits >> bit) & 1, axis=0) << bit)
        first = tl.min(tl.where(fault, lanes, BLOCK), axis=0)
        first_bits = tl.sum(tl.where(lanes == first, bits, 0), axis=0)
        first_page = tl.sum(tl.where(lanes == first, page.to(tl.int64), 0), axis=0)
        tl.atomic_or(err_ptr + _CODES, codes)
        tl.atomic_add(err_ptr + _COUNT, n_fault)
        claimed = tl.atomic_cas(err_ptr + _CLAIMED, zero, zero + 1)
        if claimed == 0:
            tl.store(err_ptr + _CODE, first_bits & (zero - first_bits))
            tl.store(err_ptr + _ROW, zero + row)
            tl.store(err_ptr + _REQ, zero + req)
            tl.store(err_ptr + _PAGE, first_page)
            tl.store(err_ptr + _STAGE, zero + stage)
