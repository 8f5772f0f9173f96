"""State rows: the recurrent-state slot table written, and state tensors copied, per step.

The step descriptor's state section (layout ``ST_*`` in :mod:`graphalloc.kernels.abi`) is a
header row ``[n_copy, n_table, 0...]``, then ``n_copy`` copy rows, then ``n_table`` table
rows. Both kernels loop to the header's counts, so a captured graph launched over the
whole section costs what the step's rows do (an empty section: one header load)::

    write_state_rows:   for each table row i (programs stride over them):
                            ST_SET:  table[A] = B
                            ST_SPEC: table[A + j] = row[2 + j] for j < 6 where row[2 + j] != 0
    copy_state_rows:    for each copy row, for each state tensor t (slot dimension d):
                            t[..., B, ...] = t[..., A, ...]   (blocks of the slot shared out)

The planner (:mod:`graphalloc.plan.states`) writes one table row per index (the last write
wins on the host) and never makes a copy destination the source of another copy of the same
step, so programs never race. Fixed-shape launches and sync-free (capturable); neither reads
a device value on the host.

Bytes: 64 per row read (pinned host memory, over the bus); 8 per table write; per copy row,
twice one slot's bytes of each tensor. Host: one launch for the table, one per tensor. The
twins (``*_torch``) share the launchers' signatures and results; they mask by row kind over
every row of the section, so they cost the section's size (references, not fast paths).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .abi import ROW_WIDTH, ST_A, ST_B, ST_COPY, ST_KIND, ST_N_COPY, ST_N_TABLE, ST_SET, ST_SPEC
from .errors import ConfigError, TensorSpecError
from .rows import check_rows, load_row, row_col

__all__ = ["write_state_rows", "write_state_rows_torch", "copy_state_rows",
           "copy_state_rows_torch", "state_tensor_spec", "check_state_tensors", "copyable_as",
           "bit_views"]

_KIND, _A, _B = tl.constexpr(ST_KIND), tl.constexpr(ST_A), tl.constexpr(ST_B)
_SET, _SPEC = tl.constexpr(ST_SET), tl.constexpr(ST_SPEC)
_N_COPY, _N_TABLE = tl.constexpr(ST_N_COPY), tl.constexpr(ST_N_TABLE)
_COPY_BLOCK = 1024  # elements one copy program moves per iteration
_MAX_COPY_CHUNKS = 64  # programs sharing one copy row (each strides over the slot's blocks)


@triton.jit
def _table_kernel(rows_ptr, table_ptr):
    pid = tl.program_id(0).to(tl.int64)
    n_prog = tl.num_programs(0).to(tl.int64)
    n_copy = tl.load(rows_ptr + _N_COPY)
    n_table = tl.load(rows_ptr + _N_TABLE)
    for i in range(pid, n_table, n_prog):
        row, cols = load_row(rows_ptr, 1 + n_copy + i)
        kind = row_col(row, cols, _KIND)
        index = row_col(row, cols, _A)
        if kind == _SET:
            tl.store(table_ptr + index,
                     row_col(row, cols, _B).to(table_ptr.dtype.element_ty))
        if kind == _SPEC:  # columns 2.. are slots at index, index + 1, ... (a 0 ends them)
            mask = (cols >= _B) & (row != 0)
            tl.store(table_ptr + index + cols - _B, row.to(table_ptr.dtype.element_ty),
                     mask=mask)


@triton.jit
def _copy_kernel(rows_ptr, t_ptr, total, inner, outer_stride, BLOCK: tl.constexpr):
    pid_row = tl.program_id(0).to(tl.int64)
    pid_chunk = tl.program_id(1).to(tl.int64)
    n_row_prog = tl.num_programs(0).to(tl.int64)
    n_chunk_prog = tl.num_programs(1).to(tl.int64)
    n_copy = tl.load(rows_ptr + _N_COPY)
    offs = tl.arange(0, BLOCK).to(tl.int64)
    for i in range(pid_row, n_copy, n_row_prog):
        row, cols = load_row(rows_ptr, 1 + i)
        src = row_col(row, cols, _A) * inner
        dst = row_col(row, cols, _B) * inner
        for start in range(pid_chunk * BLOCK, total, n_chunk_prog * BLOCK):
            e = start + offs
            mask = e < total
            base = (e // inner) * outer_stride + e % inner
            tl.store(t_ptr + base + dst, tl.load(t_ptr + base + src, mask=mask), mask=mask)


def _check_section(rows: torch.Tensor, like: torch.Tensor) -> None:
    check_rows(rows, like, "state")
    if rows.shape[0] < 1:
        raise TensorSpecError("state rows need their header row (row 0: [n_copy, n_table])")


def write_state_rows(rows: torch.Tensor, table: torch.Tensor, n_programs: int = 1) -> None:
    """Apply the table rows of the state section ``rows`` (int64 ``[1 + n, 8]``, header
    first; may be pinned host memory) to ``table`` (a contiguous 1-D index tensor).
    ``n_programs`` programs stride over the header's ``n_table`` rows (any value >= 1 is
    correct; the eager executor passes the step's count, a graph a fixed one). Returns before
    the device has finished."""
    _check_section(rows, table)
    _table_kernel[(max(int(n_programs), 1),)](rows, table)


def write_state_rows_torch(rows: torch.Tensor, table: torch.Tensor, n_programs: int = 1) -> None:
    """Reference twin of :func:`write_state_rows` (fixed shape: every row of the section
    writes; a copy or padded row writes the table's scratch entry, its last, with its own
    value). ``n_programs`` is accepted and ignored."""
    _check_section(rows, table)
    body = rows[1:].to(table.device, non_blocking=True)
    if not body.shape[0]:
        return
    scratch = table.shape[0] - 1
    kind = body[:, ST_KIND]
    j = torch.arange(ROW_WIDTH - ST_B, device=table.device)
    slots = body[:, ST_B:]  # [n, 6]: ST_SET's B first; ST_SPEC's slots
    write = (((kind == ST_SPEC)[:, None] & (slots != 0))
             | ((kind == ST_SET)[:, None] & (j == 0)[None, :]))
    index = torch.where(write, body[:, ST_A, None] + j[None, :], scratch)
    value = torch.where(write, slots.to(table.dtype), table[scratch])
    table.index_put_((index.reshape(-1),), value.reshape(-1))


def state_tensor_spec(entry) -> tuple[torch.Tensor, int]:
    """``(tensor, slot_dim)`` from a registered state tensor: a tensor (slots on dimension
    0) or a ``(tensor, slot_dim)`` pair. The tensor must be contiguous (copies move whole
    slots as flat blocks)."""
    if isinstance(entry, torch.Tensor):
        t, dim = entry, 0
    elif isinstance(entry, (tuple, list)) and len(entry) == 2:
        t, dim = entry
    else:
        t, dim = None, 0
    if not isinstance(t, torch.Tensor) or isinstance(dim, bool) or not isinstance(dim, int):
        raise TensorSpecError(f"a state tensor is a tensor or a (tensor, slot_dim) pair, got "
                              f"{_describe(entry)}")
    if not -t.dim() <= dim < t.dim():
        raise TensorSpecError(f"slot_dim {dim} out of range for a {t.dim()}-d state tensor")
    if not t.is_contiguous():
        raise TensorSpecError("state tensors must be contiguous")
    return t, dim % t.dim()


def _describe(entry) -> str:
    if isinstance(entry, (tuple, list)):
        inner = ", ".join(type(x).__name__ for x in entry)
        return f"a {type(entry).__name__} of {len(entry)} ({inner})"
    return type(entry).__name__


# Bit-for-bit copies: a slot is copied as raw words of its element width, so the kernels and
# the twin take every dtype of a width they move (Triton and index_copy_ do not know every
# dtype; a float8 or a complex64 is moved as the integer of its width).
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copyable_as(t: torch.Tensor, backend: str) -> torch.dtype | None:
    """The dtype ``backend`` moves state tensor ``t`` as (a same-width integer), or None when
    it cannot copy it: quantized tensors (no raw view), and elements wider than 8 bytes with
    the Triton backend (complex128: register ``torch.view_as_real`` of it)."""
    if t.is_quantized:
        return None
    width = t.element_size()
    if width in _WORDS:
        return _WORDS[width]
    return t.dtype if backend == "torch" else None


def check_state_tensors(state_tensors, n_slots: int, device, backend: str = "torch") -> tuple:
    """The registered state tensors as ``(tensor, slot_dim)`` pairs, checked before anything
    is built: a sequence, only with state slots (``n_slots > 0``), each a contiguous tensor
    on ``device`` with ``n_slots + 1`` slots, not requiring grad (the allocator writes it in
    place), of a dtype ``backend`` can copy (:func:`copyable_as`; the kernels then move it
    as :func:`bit_views` of it). Raises :class:`ConfigError`."""
    if isinstance(state_tensors, torch.Tensor) or not isinstance(state_tensors, (list, tuple)):
        raise ConfigError("state_tensors takes a list of tensors or (tensor, slot_dim) pairs, "
                          f"got {type(state_tensors).__name__}")
    if state_tensors and not n_slots:
        raise ConfigError("state_tensors need recurrent-state slots: build the config with "
                          "num_state_slots > 0")
    out = []
    want = torch.device(device)
    for i, entry in enumerate(state_tensors):
        try:
            t, dim = state_tensor_spec(entry)
        except TensorSpecError as exc:
            raise ConfigError(f"state_tensors[{i}]: {exc}") from None
        if t.shape[dim] != n_slots + 1:
            raise ConfigError(f"state_tensors[{i}] has {t.shape[dim]} slots on dimension "
                              f"{dim}; it needs num_state_slots + 1 = {n_slots + 1} (slot 0 "
                              "the sink)")
        if t.device.type != want.type or (want.index is not None
                                           and t.device.index != want.index):
            raise ConfigError(f"state_tensors[{i}] is on {t.device}, the allocator on {device}")
        if t.requires_grad:
            raise ConfigError(f"state_tensors[{i}] requires grad; the allocator copies slots in "
                              "place, outside autograd: register the state buffer itself "
                              "(detached, requires_grad=False)")
        if copyable_as(t, backend) is None:
            raise ConfigError(f"state_tensors[{i}] has dtype {t.dtype}, which the {backend} "
                              "backend cannot copy (it moves elements of 1, 2, 4 or 8 bytes; "
                              "no quantized dtypes). Register torch.view_as_real(t) for a "
                              "complex128 state, or build the allocator with backend='torch'")
        out.append((t, dim))
    return tuple(out)


def bit_views(pairs, backend: str) -> tuple:
    """The checked ``(tensor, slot_dim)`` pairs as the copies move them: each tensor viewed as
    the same-width integer (the same memory; a float8, a bool or a complex64 slot is copied
    bit for bit by kernels and twins that know only plain dtypes)."""
    out = []
    for t, dim in pairs:
        words = copyable_as(t, backend)
        out.append((t if words == t.dtype else t.view(words), dim))
    return tuple(out)


def _geometry(t: torch.Tensor, dim: int) -> tuple[int, int, int]:
    inner = math.prod(t.shape[dim + 1:])
    outer = math.prod(t.shape[:dim])
    return outer * inner, inner, t.shape[dim] * inner


def copy_state_rows(rows: torch.Tensor, tensors, n_programs: int = 1) -> None:
    """For every copy row of the state section ``rows`` and every state tensor of
    ``tensors`` (see :func:`state_tensor_spec`; ``n_slots + 1`` entries on the slot
    dimension, slot 0 the sink): destination slot = source slot. One launch per tensor:
    ``n_programs`` programs stride over the header's ``n_copy`` rows, up to 64 more share
    each slot's blocks. Returns before the device has finished."""
    for entry in tensors:
        t, dim = state_tensor_spec(entry)
        _check_section(rows, t)
        total, inner, stride = _geometry(t, dim)
        if not total:
            continue
        chunks = min(triton.cdiv(total, _COPY_BLOCK), _MAX_COPY_CHUNKS)
        _copy_kernel[(max(int(n_programs), 1), chunks)](rows, t, total, inner, stride,
                                                        BLOCK=_COPY_BLOCK)


def copy_state_rows_torch(rows: torch.Tensor, tensors, n_programs: int = 1) -> None:
    """Reference twin of :func:`copy_state_rows` (fixed shape: every row of the section
    copies, a non-copy row the sink slot 0 onto itself; sources gathered before any
    destination is written)."""
    for entry in tensors:
        t, dim = state_tensor_spec(entry)
        _check_section(rows, t)
        body = rows[1:].to(t.device, non_blocking=True)
        if not body.shape[0]:
            continue
        is_copy = body[:, ST_KIND] == ST_COPY
        src = torch.where(is_copy, body[:, ST_A], 0)
        dst = torch.where(is_copy, body[:, ST_B], 0)
        t.index_copy_(dim, dst, t.index_select(dim, src))
