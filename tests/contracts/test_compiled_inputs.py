"""The conversion path's compiled half (``graphalloc._cinputs``) against its Python spec.

``normalize_fast`` (C) must give exactly what ``normalize`` (Python, the spec) gives for every
input it accepts, and hand everything else to Python (None) -- so the accepted inputs, the
arrays and the typed errors are the spec's. ``int64_list`` likewise against the Python loop
of ``graphalloc.inputs``. Random steps mix plain forms (ints, lists, tuples, ranges, int64
arrays) with garbage (bools, floats, None, nested lists, rows out of range, negative counts,
CPU tensors, malformed pairs). The plain forms must take the C path (a C half that always
said None would pass the equality tests and fail these).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphalloc import inputs
from graphalloc.errors import ContractError
from graphalloc.plan import step as step_module
from graphalloc.plan.step import KINDS, Step, StepArrays

pytestmark = pytest.mark.skipif(step_module.normalize_fast is None,
                                reason="graphalloc._cinputs was not built")

N_REQS = 8


def python_normalize(step: Step):
    """The spec: plan/step.py's normalize with the compiled half switched off."""
    fast, lst = step_module.normalize_fast, inputs._int64_list
    step_module.normalize_fast, inputs._int64_list = None, None
    try:
        class Config:
            max_reqs = N_REQS
        return step_module.normalize(step, Config)
    finally:
        step_module.normalize_fast, inputs._int64_list = fast, lst


def same(a: StepArrays, b: StepArrays) -> bool:
    for name, x, y in zip(StepArrays._fields, a, b, strict=True):
        if name == "evict_all":
            if type(x) is not int or x != y:
                return False
            continue
        if not (isinstance(x, np.ndarray) and x.dtype == np.int64 and x.ndim == 1):
            return False
        if not np.array_equal(x, y):
            return False
    return True


# ---- random values: plain forms and garbage ------------------------------------------------
ELEMENTS = (lambda v: v, np.int64, np.int32, lambda v: True, lambda v: 2.0, lambda v: None,
            lambda v: [v], lambda v: 2**63, lambda v: np.uint64(2**63 + 5),
            lambda v: np.bool_(True))
FORMS = (  # one field's value from a few ints: mostly plain, sometimes garbage
    lambda v: None, lambda v: v[0] if v else 3, lambda v: np.int64(v[0] if v else 1), list,
    tuple, lambda v: range(len(v)), lambda v: np.array(v, dtype=np.int64),
    lambda v: np.array(v, dtype=np.int64)[::-1], lambda v: np.array(v, dtype=np.int32),
    lambda v: np.array(v, dtype=np.float64), lambda v: torch.tensor(v, dtype=torch.int64),
    lambda v: True, lambda v: 1.5, lambda v: np.zeros((1, 2), dtype=np.int64),
    lambda v: np.int64(3).reshape(()))


@st.composite
def value(draw):
    ints = draw(st.lists(st.integers(-3, N_REQS + 2), max_size=5))
    if draw(st.integers(0, 7)) == 0:  # a list with odd elements
        return [ELEMENTS[draw(st.integers(0, len(ELEMENTS) - 1))](v) for v in ints]
    return FORMS[draw(st.integers(0, len(FORMS) - 1))](ints)


@st.composite
def pair(draw, n=2):
    form = draw(st.integers(0, 4))
    if form == 0:
        return None
    if form == 4:
        return draw(value())
    items = [draw(value()) for _ in range(n + (form == 3))]
    return list(items) if form == 2 else tuple(items)


@st.composite
def steps(draw):
    kw = {}
    for kind in KINDS:
        if not draw(st.booleans()):
            continue
        if kind == "evict_all":
            kw[kind] = draw(st.sampled_from([True, False, np.bool_(True), 1, None]))
        elif kind in ("take", "admit_on"):
            kw[kind] = draw(pair(3))
        elif kind in ("accept", "commit", "trim", "advance", "extend", "load_back"):
            kw[kind] = draw(pair(2))
        elif kind == "lookahead":
            kw[kind] = draw(st.one_of(st.none(), st.integers(-3, 70), value()))
        else:
            kw[kind] = draw(value())
    return kw


def element_lists():
    @st.composite
    def build(draw):
        ints = draw(st.lists(st.integers(-3, N_REQS + 2), max_size=6))
        return [ELEMENTS[draw(st.integers(0, len(ELEMENTS) - 1))](v) for v in ints]
    return build()


def _step(kw):
    try:
        return Step(**kw)
    except TypeError:
        return None


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(steps())
def test_fast_equals_the_spec_or_defers(kw):
    step = _step(kw)
    fast = step_module.normalize_fast(step, N_REQS)
    fast_kw = step_module.normalize_fast(dict(kw), N_REQS)
    try:
        spec = python_normalize(step)
    except ContractError:
        spec = None  # the spec refuses: the C half must have deferred
    if fast is not None:
        assert spec is not None, f"C accepted what the spec refuses: {kw}"
        assert same(fast, spec), kw
    if fast_kw is not None:  # the keywords dict: the same answer as the Step
        assert fast is not None and same(fast_kw, fast), kw


@pytest.mark.parametrize("kw", [
    {"decode": [0, 1, 2], "evict_all": True},
    {"decode": np.arange(5, dtype=np.int64), "lookahead": 3},
    {"decode": (1, 2), "lookahead": -1},
    {"release": 3, "extend": ([4, 5], 7), "admit": range(6, 8)},
    {"accept": ([1, 2], [0, 3]), "trim": (np.array([3]), [9]), "evict": [1, 2]},
    {"accept": (np.array([4], dtype=np.int64), np.array([2], dtype=np.int64))},
    {"advance": ([1], 16), "drop": [0, 2], "drop_swa": 5, "load_back": ([2], [32])},
    {"take": ([1], [2], [16]), "admit_on": ([3, 4], [1, 1], None)},
    {"decode": [np.int64(1), 2], "extend": [[3], np.array([40], dtype=np.int64)]},
    {"release": np.array([7, 0], dtype=np.int64)[::-1]},
])
def test_plain_forms_take_the_compiled_path(kw):
    fast = step_module.normalize_fast(Step(**kw), N_REQS)
    assert fast is not None, kw
    assert same(fast, python_normalize(Step(**kw)))
    assert same(step_module.normalize_fast(dict(kw), N_REQS), fast)


def test_an_int64_array_is_passed_on_as_it_is():
    rows = np.array([1, 2, 3], dtype=np.int64)
    out = step_module.normalize_fast({"decode": rows, "evict_all": True}, N_REQS)
    assert out.decode is rows and out.evict_all == 1
    assert not out.decode_n.flags.writeable  # the shared filled views are read-only


@pytest.mark.parametrize("kw", [
    {"decode": [0, N_REQS]}, {"decode": [True]}, {"release": [1.0]}, {"evict": True},
    {"extend": ([1], [-1])}, {"extend": ([1, 2], [1])}, {"extend": [1]},
    {"decode": torch.tensor([1])}, {"lookahead": 2}, {"decode": [1], "lookahead": 65},
    {"take": ([1, 2], [3], [4])}, {"admit_on": ([1], [2], [-2])}, {"evict_all": 1},
    {"unknown_kind": [1]}, {"commit": ([1], [2])},  # (deprecated: Python warns)
    {"accept": ([1], [-1])}, {"accept": ([1], [1]), "commit": ([1], [1])},
])
def test_what_the_c_half_defers(kw):
    """Inputs the spec refuses or converts itself: the C half answers None."""
    assert step_module.normalize_fast(kw, N_REQS) is None


@settings(max_examples=300, deadline=None)
@given(st.one_of(element_lists(), element_lists().map(tuple), st.integers(0, 50).map(range)))
def test_int64_list_equals_the_python_loop(values):
    fast = inputs._int64_list(values)
    saved = inputs._int64_list
    inputs._int64_list = None
    try:
        spec = inputs.as_int64(values, "rows", ContractError)
    except ContractError:
        spec = None
    finally:
        inputs._int64_list = saved
    if fast is None:
        return  # the Python loop decides (and names the culprit)
    assert spec is not None and fast.dtype == np.int64 and np.array_equal(fast, spec), values
    plain = all(type(v) is int or isinstance(v, np.integer) for v in values)
    assert plain


def test_int64_list_converts_plain_ints():
    out = inputs._int64_list([1, np.int64(-2), np.uint8(3), 2**63 - 1])
    assert out.dtype == np.int64 and out.tolist() == [1, -2, 3, 2**63 - 1]
    assert inputs._int64_list([1, True]) is None and inputs._int64_list([2**63]) is None
