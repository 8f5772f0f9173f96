"""The one conversion path for what callers pass in: request rows, counts and positions.

Every public entry point turns its arguments into int64 numpy arrays here, and
nowhere else, so every operation accepts the same inputs and refuses the same
garbage with the same typed error, before anything changes:

=====================  ===========================================================
accepted               Python ints, numpy integer scalars, 1-D sequences of them,
                       1-D numpy integer arrays, 1-D (or 0-d) integer CPU tensors
refused, typed         bools (``True`` is not row 1), floats (even ``2.0``),
                       strings, ``None`` inside a sequence, nested sequences,
                       2-D arrays and tensors, NaN/inf, ints outside int64, bool,
                       float or complex CPU tensors: ``UnknownRequestError`` for
                       rows, ``PositionError`` for counts and positions (the
                       class the argument's rule names)
refused, typed         a tensor on any device but the CPU (CUDA, or a ``meta``
                       tensor standing in for one): reading it would synchronise
                       with the GPU, so it is ``TensorSpecError`` whatever the
                       argument (rows, counts, positions): pass the host copy,
                       e.g. SGLang's ``req_pool_indices_cpu``
=====================  ===========================================================

Checked first, before the values: the device of a tensor, then its dtype, then the shape;
so a CUDA tensor of floats is a ``TensorSpecError``, not a ``PositionError``. ``None`` as
the whole argument means "this kind is absent" inside a :class:`~graphalloc.plan.step.Step`;
the single operations refuse it where they act on rows (see
:mod:`graphalloc.operations`). Ranges (a row below ``max_reqs``, a count below a limit) are
the callers' rules (:func:`as_rows`, :func:`as_counts`).

Cost: O(n) numpy, no copy when the input is already a 1-D int64 array; a list, tuple or
range of ints is converted and checked element by element in C (``graphalloc._cinputs``, the
compiled half of this path: no Python frame per element), and only when an element is not a
plain int (or that extension was not built) does Python look at each element, to name it in
the error. The caller's array is never written to.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from .errors import (
    ContractError,
    PositionError,
    TensorSpecError,
    UnknownHandleError,
    UnknownRequestError,
)

__all__ = ["as_rows", "as_counts", "as_positions", "as_index", "as_int64", "is_empty",
           "one_handle", "compiled_half"]

_INT64_MAX = np.iinfo(np.int64).max


def _load_compiled_half():
    """``graphalloc._cinputs`` bound to numpy's types, or None when it was not built."""
    try:
        from . import _cinputs
    except ImportError:
        return None
    _cinputs.bind(np.ndarray, np.integer, np.empty, np.int64, None, None, None)
    return _cinputs


compiled_half = _load_compiled_half()  # graphalloc._cinputs (plan.step binds its normaliser)
_int64_list = None if compiled_half is None else compiled_half.int64_list


def _as_int64(values, what: str, error: type[ContractError]) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.dtype == np.int64 and values.ndim == 1:
        return values  # the fast path: the planner's own dtype
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise TensorSpecError(
                f"{what} is a tensor on {values.device}: reading it on the host would "
                "synchronise with the device. Pass the host copy (a CPU tensor, a numpy array "
                "or a list), e.g. the scheduler's CPU-side request indices")
        if values.dtype == torch.bool or values.is_floating_point() or values.is_complex():
            raise error(f"{what} must be integers, got a {values.dtype} tensor")
        values = values.numpy()
    if isinstance(values, (bool, np.bool_)):
        raise error(f"{what} must be integers, got the bool {values!r} (True is not 1)")
    if isinstance(values, numbers.Integral):
        if not -_INT64_MAX - 1 <= int(values) <= _INT64_MAX:
            raise error(f"{what} {values} does not fit int64")
        return np.array([int(values)], dtype=np.int64)
    if isinstance(values, np.ndarray):
        arr = values
    elif isinstance(values, (list, tuple, range)):
        arr = None if _int64_list is None else _int64_list(values)  # C: no frame per element
        if arr is not None:
            return arr
        for v in values:  # not all plain ints (or no compiled half): find and name the culprit
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
                raise error(f"{what} must be integers, got {v!r} ({type(v).__name__}) in "
                            f"{_short(values)}")
            if not -_INT64_MAX - 1 <= int(v) <= _INT64_MAX:
                raise error(f"{what}: {v} does not fit int64")
        arr = np.asarray(values, dtype=np.int64) if len(values) else np.zeros(0, np.int64)
    else:
        raise error(f"{what} must be an int, a 1-D sequence or array of ints, or a CPU "
                    f"tensor; got {type(values).__name__}")
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise error(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise error(f"{what} must be integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.max() > _INT64_MAX:
        raise error(f"{what}: {arr.max()} does not fit int64")
    return arr.astype(np.int64, copy=False)


def as_int64(values, what: str, error: type[ContractError]) -> np.ndarray:
    """``values`` as a 1-D int64 array, refused with ``error`` (the class the caller's
    rule names) for anything but integers. No range check."""
    return _as_int64(values, what, error)


def _short(values) -> str:
    text = repr(values)
    return text if len(text) < 60 else text[:57] + "..."


def as_rows(rows, n_reqs: int, what: str = "request rows") -> np.ndarray:
    """Request rows as int64, each in ``[0, n_reqs)``; ``UnknownRequestError`` otherwise."""
    arr = _as_int64(rows, what, UnknownRequestError)
    if len(arr) and (arr.min() < 0 or arr.max() >= n_reqs):
        bad = int(arr[(arr < 0) | (arr >= n_reqs)][0])
        raise UnknownRequestError(f"{what}: request row {bad} is outside [0, {n_reqs}) "
                                  f"(max_reqs={n_reqs})")
    return arr


def _per_row(values, n: int, what: str) -> np.ndarray:
    """One int64 per row: a single int is broadcast to ``n`` rows, a sequence must have n."""
    arr = _as_int64(values, what, PositionError)
    if len(arr) == 1 and n != 1 and not isinstance(values, (list, tuple, np.ndarray,
                                                            torch.Tensor)):
        arr = np.full(n, arr[0], dtype=np.int64)
    if len(arr) != n:
        raise PositionError(f"{what}: {n} rows but {len(arr)} values")
    return arr


def as_counts(counts, n: int, what: str, limit: int | None = None) -> np.ndarray:
    """Non-negative int64 counts, one per row (a single int is broadcast to ``n`` rows);
    ``PositionError`` for anything else or a count past ``limit``."""
    arr = _per_row(counts, n, what)
    if n and (min(arr.tolist()) if n <= 16 else arr.min()) < 0:
        raise PositionError(f"{what} must be >= 0, got {int(arr.min())}")
    if limit is not None and n and arr.max() > limit:
        raise PositionError(f"{what}: {int(arr.max())} exceeds {limit}")
    return arr


def as_positions(positions, n: int, what: str, limit: int | None = None) -> np.ndarray:
    """Integer positions, one per row (``PositionError`` for non-integers, a wrong count, or
    a value past ``limit``); the range below is the caller's rule to check (a negative
    frontier target is a backward move, a ``FrontierError``)."""
    arr = _per_row(positions, n, what)
    if limit is not None and n and arr.max() > limit:
        raise PositionError(f"{what}: {int(arr.max())} exceeds {limit}")
    return arr


def as_index(value, what: str, limit: int) -> int:
    """One int in ``[0, limit)`` (a row, a buffer index, a handle); refuses bools, floats and
    negative values (``-1`` never means "the last one" here)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise PositionError(f"{what} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if not 0 <= value < limit:
        raise PositionError(f"{what} {value} is outside [0, {limit})")
    return value


def one_handle(value, what: str) -> None:
    """A single operation on a handle names ONE handle id (an int), as ``admit(handle=)``
    and ``take_handle`` do: a list is refused (``UnknownHandleError``; several handles go in
    one step with ``step(drop=[...])``). The planner checks its range and liveness."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise UnknownHandleError(f"{what} takes one handle id (an int), got {value!r} "
                                 f"({type(value).__name__}); drop several handles in one "
                                 "step with step(drop=[...]) / step(drop_swa=[...])")


def is_empty(rows) -> bool:
    """True for ``None`` and for empty sequences, arrays and tensors."""
    if rows is None:
        return True
    if isinstance(rows, (np.ndarray, torch.Tensor)):
        return rows.numel() == 0 if isinstance(rows, torch.Tensor) else rows.size == 0
    if isinstance(rows, (list, tuple, range)):
        return len(rows) == 0
    return False
