"""Named refusals: one enum, the C's names emitted from it, no number written by hand.

The compiled twin refuses with the names of ``_cplan_refusals.h``, which is emitted from
:mod:`graphalloc.plan.refusals`; these tests keep the committed header equal to the emitted
one, check that the built extension carries the same table (what the import check
compares), that every code is raised somewhere (a code no planner raises is a dead entry),
and that no planner writes a refusal as a bare number.
"""

from __future__ import annotations

import pathlib
import re

import pytest

import graphalloc.plan.compiled as compiled
from graphalloc import errors as E
from graphalloc.plan.refusals import Kind, Refusal, RefusalCode, RefusalInfo, c_header, to_error

ROOT = pathlib.Path(__file__).resolve().parents[2]
PLAN = ROOT / "graphalloc" / "plan"
PYTHON_SOURCES = sorted((ROOT / "graphalloc").rglob("*.py"))
C_SOURCES = sorted(PLAN.glob("_cplan*.c"))


def test_the_committed_header_is_the_emitted_one():
    assert (PLAN / "_cplan_refusals.h").read_text() == c_header(), (
        "regenerate: python -m graphalloc.plan.refusals > graphalloc/plan/_cplan_refusals.h")


@pytest.mark.skipif(not compiled.AVAILABLE, reason="the compiled planner is not built")
def test_the_extension_carries_the_enums_names():
    names = dict(compiled._cplan.REFUSALS)
    assert {k: v for k, v in names.items() if k.startswith("R_")} == {
        f"R_{code.name}": int(code) for code in RefusalCode}
    assert {k: v for k, v in names.items() if k.startswith("K_")} == {
        f"K_{kind.name}": int(kind) for kind in Kind}


def test_every_code_is_raised_somewhere():
    python = "\n".join(p.read_text() for p in PYTHON_SOURCES if p.name != "refusals.py")
    c = "\n".join(p.read_text() for p in C_SOURCES)
    dead = [code.name for code in RefusalCode
            if f"RefusalCode.{code.name}" not in python and f"R_{code.name}" not in c]
    assert not dead, f"codes nothing raises: {dead}"


def test_no_refusal_is_a_bare_number():
    bare = []
    for path in PYTHON_SOURCES:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"Refusal\(\s*\d", line):
                bare.append(f"{path.relative_to(ROOT)}:{i}")
    for path in C_SOURCES:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"refuse\(\s*\w+\s*,\s*\(?\s*\d", line):
                bare.append(f"{path.relative_to(ROOT)}:{i}")
    assert not bare, bare


def test_a_refusal_becomes_its_typed_error_carrying_the_refusal():
    refusal = Refusal(RefusalCode.PAGES_SHORT, Kind.EXTEND, 0, 5, 2)
    error = to_error(refusal)
    assert type(error) is E.CapacityError and isinstance(error, E.ContractError)
    assert "needs 5 more FULL pages; 2 are free" in str(error)
    assert isinstance(error.refusal, RefusalInfo)
    assert error.refusal == (RefusalCode.PAGES_SHORT, Kind.EXTEND, 0, 5, 2)
    assert error.refusal.code.shortage and error.refusal.code.room


def test_shortage_and_room_are_attributes_of_the_code():
    # the frozen shape: a shortage (not now) but not of room (frees do not help)
    assert RefusalCode.STEP_OVER_SHAPE.shortage and not RefusalCode.STEP_OVER_SHAPE.room
    # a broken rule: neither
    assert not RefusalCode.ROW_NOT_LIVE.shortage and not RefusalCode.ROW_NOT_LIVE.room
    for code in RefusalCode:
        assert not code.room or code.shortage, code  # short of room is always "not now"


def test_an_error_raised_before_planning_carries_no_refusal():
    assert E.ContractError("x").refusal is None


def test_no_free_row_is_a_named_shortage():
    import graphalloc as ga
    cfg = ga.AllocatorConfig(page_size=2, num_full_pages=8, num_swa_pages=8, max_reqs=1,
                             max_context_len=8, model_window=3)
    alloc = ga.HybridAllocator(cfg)
    alloc.admit()
    with pytest.raises(E.CapacityError) as info:
        alloc.free_row()
    assert info.value.refusal.code is RefusalCode.NO_FREE_ROW and info.value.refusal.code.shortage
