"""How kernels report faults without killing the context: one recorder and its twin.

The error word's layout (``ERR_*``) and the fault codes are the device ABI
(:mod:`graphalloc.kernels.abi`). Every kernel records through :func:`record_fault_bits`,
one block of lanes at a time, each lane carrying its FaultCode bits (0 = no fault)::

    n = number of lanes with any bit set
    if n > 0:
        atomic_or(err[ERR_CODES], OR of the bits); atomic_add(err[ERR_COUNT], n)
        if atomic_cas(err[ERR_CLAIMED], 0, 1) == 0:     # one claim attempt per block
            err[ERR_CODE:] = lowest bit, row, req, page of the block's lowest faulting
                             lane, stage

A lane is counted once however many rules it breaks. Within one launch the first
record is the fault of the lowest (row, lane) in the Torch twin
(:func:`record_fault_bits_torch`) and in the interpreter; on a GPU, programs race
for the claim, so any faulting row may win (the bits and the count are exact).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .abi import (
    ERR_CLAIMED,
    ERR_CODE,
    ERR_CODES,
    ERR_COUNT,
    ERR_PAGE,
    ERR_REQ,
    ERR_ROW,
    ERR_STAGE,
    ERR_WORDS,
    N_FAULT_BITS,
)

__all__ = ["new_error_word", "record_fault_bits_torch", "record_fault_bits"]

# The same offsets as constexprs: jit functions may only read constexpr globals.
_CODES, _COUNT = tl.constexpr(ERR_CODES), tl.constexpr(ERR_COUNT)
_CLAIMED, _CODE = tl.constexpr(ERR_CLAIMED), tl.constexpr(ERR_CODE)
_ROW, _REQ = tl.constexpr(ERR_ROW), tl.constexpr(ERR_REQ)
_PAGE, _STAGE = tl.constexpr(ERR_PAGE), tl.constexpr(ERR_STAGE)
_N_FAULT_BITS = tl.constexpr(N_FAULT_BITS)


def new_error_word(device: torch.device | str) -> torch.Tensor:
    return torch.zeros(ERR_WORDS, dtype=torch.int64, device=device)


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
