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
"""

from __future__ import annotations

import torch

__all__ = [
    "ERR_CODES", "ERR_COUNT", "ERR_CLAIMED", "ERR_CODE", "ERR_ROW", "ERR_REQ", "ERR_PAGE",
    "ERR_STAGE", "ERR_WORDS", "STAGE_RELEASE", "STAGE_ALLOC", "STAGE_SINGLE",
    "new_error_word", "record_faults_torch",
]

ERR_CODES, ERR_COUNT, ERR_CLAIMED, ERR_CODE, ERR_ROW, ERR_REQ, ERR_PAGE, ERR_STAGE = range(8)
ERR_WORDS = 8
STAGE_RELEASE, STAGE_ALLOC, STAGE_SINGLE = 0, 1, 2


def new_error_word(device: torch.device | str) -> torch.Tensor:
    return torch.zeros(ERR_WORDS, dtype=torch.int64, device=device)


def record_faults_torch(err: torch.Tensor, fault: torch.Tensor, code: int, stage: int,
                        row: torch.Tensor, req: torch.Tensor, page: torch.Tensor) -> None:
    """Fixed-shape, sync-free fault recording for the Torch twins.

    ``fault`` is a bool lane mask; ``row``, ``req``, ``page`` give each lane's
    record fields (same shape). The first faulting lane claims the record if
    nobody has since the last reset.
    """
    fault = fault.reshape(-1)
    count = fault.sum(dtype=torch.int64)
    any_fault = count > 0
    first = torch.argmax(fault.to(torch.int8))  # first True lane (0 when none)
    record = torch.stack([
        torch.ones((), dtype=torch.int64, device=err.device),
        torch.full((), code, dtype=torch.int64, device=err.device),
        row.reshape(-1)[first].to(torch.int64),
        req.reshape(-1)[first].to(torch.int64),
        page.reshape(-1)[first].to(torch.int64),
        torch.full((), stage, dtype=torch.int64, device=err.device),
    ])
    claim = (err[ERR_CLAIMED] == 0) & any_fault
    err[ERR_CLAIMED:] = torch.where(claim, record, err[ERR_CLAIMED:])
    err[ERR_CODES] |= torch.where(any_fault, code, 0)
    err[ERR_COUNT] += count
