"""The descriptor layout (graphalloc/device/layout.py): its sections tile the buffer, and it is
the only place that computes a section's offset.

* For every configuration the planner tests use (tests/planning/test_compiled_planner.py:
  with and without page tables and state slots, no window, chunked, ring; the model's
  configurations in tests/planning/test_model_vs_allocator.py: two and three window pools)
  plus the combinations they leave out (further window pools beside state slots and page
  tables), the allocator's ring has the sizes the config gives, section after section, no
  gap, no overlap, and every view of the ring is exactly its section (rows numbered in the
  buffer read back through the views).
* A static check of the source: no descriptor offset arithmetic (a section's first row from
  the frozen shapes, the old fields that held them) outside the layout module, in Python or in
  the compiled twin's C. The check is run on known offending lines first, so it can fail.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re

import numpy as np
import pytest

import graphalloc as ga
from graphalloc.attention.spec import PageTableSpec
from graphalloc.device.layout import DescriptorLayout, Section
from graphalloc.plan import compiled
from graphalloc.pools import ChunkedLocal, FullAttention, RecurrentState, SlidingWindow

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(relative: str, name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_PLANNER = _load("tests/planning/test_compiled_planner.py", "_layout_planner_configs")
_MODEL = _load("tests/planning/test_model_vs_allocator.py", "_layout_model_configs")


def _cases() -> dict:
    """name -> (AllocatorConfig kwargs, page-table spec kwargs or None)."""
    cases = {}
    for name in {**_PLANNER.CONFIGS, **_PLANNER.LAYER_CONFIGS, **_PLANNER.STATE_CONFIGS}:
        cases[f"planner-{name}"] = name  # (built by the planner test's own make_config)
    for name, kwargs in _MODEL.CONFIGS.items():
        kwargs = {k: v for k, v in kwargs.items() if k != "fused_step"}
        cases[f"model-{name}"] = (kwargs, None)
    base = dict(page_size=4, max_reqs=4, max_context_len=64, max_handles=3)
    for tables in (None, dict(max_batch=3)):
        for extra in ((SlidingWindow(17, 24),), (ChunkedLocal(8, 20), SlidingWindow(5, 16))):
            for states in ((), (RecurrentState(12, 3),)):
                layers = (FullAttention(48), SlidingWindow(8, 20), *extra, *states)
                name = (f"extras{len(extra)}-{'states' if states else 'nostates'}-"
                        f"{'tables' if tables else 'notables'}")
                cases[name] = (dict(base, layers=layers), tables)
    return cases


CASES = _cases()


def _build(case):
    if isinstance(case, str):
        config, spec = _PLANNER.make_config(case)
    else:
        kwargs, tables = case
        config = ga.AllocatorConfig(**dict(kwargs, backend="torch", device="cpu"))
        spec = None if tables is None else PageTableSpec(**tables)
    return ga.HybridAllocator(config, planner="numpy", page_tables=spec), spec


def _expected(config, spec) -> list[tuple[str, int]]:
    """The sections the config gives, from its sizes (written here from the docs' table)."""
    r, a = config.max_release_rows, config.max_alloc_rows
    out = [("release", r), ("allocation", a)]
    if spec is not None:
        out.append(("lanes", spec.max_batch))
    if config.num_state_slots:
        out.append(("states", config.max_state_rows + 1))
    for p in range(1, len(config.pools.extras) + 1):
        out += [(f"window{p}_release", r), (f"window{p}_allocation", a)]
    return out


def test_the_cases_cover_tables_states_and_further_window_pools():
    kinds = set()
    for case in CASES.values():
        alloc, spec = _build(case)
        names = {s.name for s in alloc.ring.layout.sections}
        kinds.add(("lanes" in names, "states" in names, "window1_release" in names,
                   "window2_release" in names))
    assert {(True, False, False, False), (False, True, False, False), (True, True, False, False),
            (False, False, False, False), (False, False, True, False),
            (True, True, True, True)} <= kinds


@pytest.mark.parametrize("name", sorted(CASES))
def test_sections_tile_the_buffer(name):
    alloc, spec = _build(CASES[name])
    ring, layout = alloc.ring, alloc.ring.layout
    assert [(s.name, s.n_rows) for s in layout.sections] == _expected(alloc.config, spec)
    first = 0
    for section in layout.sections:  # in order: no gap, no overlap, none empty
        assert section.first_row == first and section.n_rows > 0
        first = section.end_row
    assert first == layout.n_rows == ring.bufs[0].shape[0]
    # every view of the ring is exactly its section: number the rows, read them back
    for i, buf in enumerate(ring.np_bufs):
        buf[:, 0] = np.arange(len(buf)) + 1000 * i
        views = {"release": ring.release_rows(i), "allocation": ring.alloc_rows(i),
                 "lanes": ring.lane_rows(i), "states": ring.state_rows(i)}
        for p, (rel, al) in enumerate(ring._window_views[i], 1):  # noqa: SLF001 (the views)
            views[f"window{p}_release"], views[f"window{p}_allocation"] = rel, al
        seen = []
        for section in layout.sections:
            rows = views.pop(section.name)[:, 0].numpy()
            np.testing.assert_array_equal(rows, np.arange(section.first_row, section.end_row)
                                          + 1000 * i)
            seen.append(rows)
        assert all(len(v) == 0 for v in views.values())  # absent sections: empty views
        np.testing.assert_array_equal(np.concatenate(seen), buf[:, 0])
    # the device mirror's views (staging reads them) are the same sections
    dev, _, mirror_views = ring.mirror(0)
    for name_, view in zip(("release", "allocation", "lanes", "states"), mirror_views,
                           strict=True):
        want = layout.rows(name_)
        assert view.shape[0] == want.stop - want.start
        if view.shape[0]:
            assert view.data_ptr() == dev[want.start:].data_ptr()


def test_the_layout_refuses_overlapping_names_and_negative_rows():
    with pytest.raises(ValueError, match="named twice"):
        DescriptorLayout([("release", 2), ("release", 3)])
    with pytest.raises(ValueError, match="-1 rows"):
        DescriptorLayout([("release", -1)])
    layout = DescriptorLayout([("release", 2), ("lanes", 0), ("allocation", 3)])
    assert layout.sections == (Section("release", 0, 2), Section("allocation", 2, 3))
    assert "lanes" not in layout and layout.rows("lanes") == slice(5, 5)
    assert layout.first_row("lanes") == -1 and layout.rows("allocation", 2) == slice(2, 4)


# ---- the static check ------------------------------------------------------------------------
LAYOUT_MODULE = ROOT / "graphalloc" / "device" / "layout.py"
PY_OFFSETS = (
    # the main sections' end (where lanes, states or a window section begin)
    re.compile(r"(max|n)_release_rows\s*\+\s*[\w.]*(max|n)_alloc_rows"),
    # a buffer sliced at the frozen release rows (the allocation section's first row)
    re.compile(r"\[\s*[\w.]*(max|n)_release_rows\s*:"),
    # the fields that held offsets and section sizes before the layout
    re.compile(r"\b(n_lane_rows|n_state_rows|n_window_sections|_state_base|_lane_base|"
               r"_alloc_base|_window_bases)\b"),
    # the state section's size (header row included), outside the state pool that gives it
    re.compile(r"max_state_rows\s*\+\s*1"),
)
PY_ALLOWED = {(3, "graphalloc/pools/state.py")}  # (pattern, file): the pool declares its size
C_OFFSETS = (
    re.compile(r"max_rel\s*\+\s*P->max_al"),  # the main sections' end
    re.compile(r"desc\s*\+[^;]*\b(max_rel|max_al|B)\b"),  # a pointer into a buffer by shapes
    re.compile(r"st_base\s*=[^;]*\bmax_"),  # the state section's first row by shapes
)


def _code(text: str, suffix: str) -> list[str]:
    """Code lines (numbered from 1), docstrings and comments blanked."""
    if suffix == ".py":
        text = re.sub(r'"""(.|\n)*?"""', lambda m: "\n" * m.group(0).count("\n"), text)
        strip = re.compile(r"#.*$")
    else:
        text = re.sub(r"/\*(.|\n)*?\*/", lambda m: "\n" * m.group(0).count("\n"), text)
        strip = re.compile(r"//.*$")
    return [strip.sub("", line) for line in text.splitlines()]


def offset_arithmetic(path: pathlib.Path, text: str | None = None) -> list[str]:
    """``"file:line: code"`` of each line of ``path`` that computes a descriptor offset."""
    rel = path.relative_to(ROOT).as_posix() if path.is_absolute() else path.as_posix()
    text = path.read_text() if text is None else text
    patterns = PY_OFFSETS if path.suffix == ".py" else C_OFFSETS
    out = []
    for number, line in enumerate(_code(text, path.suffix), 1):
        for k, pattern in enumerate(patterns):
            if pattern.search(line) and not (path.suffix == ".py" and (k, rel) in PY_ALLOWED):
                out.append(f"{rel}:{number}: {line.strip()}")
    return out


def _sources() -> list[pathlib.Path]:
    base = ROOT / "graphalloc"
    files = [p for p in sorted(base.rglob("*.py")) if p != LAYOUT_MODULE
             and "kernels" not in p.relative_to(base).parts]
    return files + sorted((base / "plan").glob("_cplan*.[ch]"))


# lines the layout replaced (the tree before it): each must be flagged
OFFENDING = (
    ("graphalloc/plan/compiled.py", "self._lane_base = cfg.max_release_rows + cfg.max_alloc_rows"),
    ("graphalloc/device/restore.py", "al_rows = ring.np_bufs[last][cfg.max_release_rows:n]"),
    ("graphalloc/footprint.py", "x = 64 * (cfg.max_release_rows + cfg.max_alloc_rows)"),
    ("graphalloc/allocator.py", "n_state_rows=config.max_state_rows + 1 if config.has_states"),
    ("graphalloc/device/backend.py", "(r + a + ring.n_lane_rows, ring.n_state_rows)"),
    ("graphalloc/plan/_cplan.c", "P->st_base = P->max_rel + P->max_al + P->B;"),
    ("graphalloc/plan/_cplan_alloc.c", "int64_t *out = S->buf->desc + (P->max_rel + 1) * 8;"),
    ("graphalloc/plan/_cplan_core.c", "S.al = S.buf->desc + P->max_rel * ROW_WIDTH;"),
)
FINE = (
    ("graphalloc/device/graph.py", "self._release_slot = [0] * (pol.max_release_rows + 1)"),
    ("graphalloc/pools/state.py", "return ((STATES, config.max_state_rows + 1),)"),
    ("graphalloc/plan/_cplan.c", "P->saved_rel = zalloc((size_t)P->max_rel * ROW_WIDTH, 8, &f);"),
    ("graphalloc/plan/_cplan_alloc.c", "int64_t *out = S->buf->desc + P->lane_row * ROW_WIDTH;"),
)


def test_the_static_check_flags_offset_arithmetic():
    for rel, line in OFFENDING:
        assert offset_arithmetic(pathlib.Path(rel), line + "\n"), rel
    for rel, line in FINE:
        assert not offset_arithmetic(pathlib.Path(rel), line + "\n"), rel


def test_no_descriptor_offset_arithmetic_outside_the_layout():
    found = [hit for path in _sources() for hit in offset_arithmetic(path)]
    assert not found, ("descriptor offsets computed outside graphalloc/device/layout.py (ask "
                       "the layout for the section by name):\n" + "\n".join(found))


# ---- the compiled twin takes its sections from the layout ------------------------------------
class _Shifted(DescriptorLayout):
    """A layout whose sections the twin is told start elsewhere (``first``: name -> row)."""

    __slots__ = ("first",)

    def first_row(self, name: str) -> int:
        return self.first.get(name, super().first_row(name))


@pytest.mark.skipif(not compiled.AVAILABLE, reason=compiled.UNAVAILABLE_REASON)
@pytest.mark.parametrize("first, message", [({"lanes": -1}, "missing"),
                                            ({"states": 3}, "overlap"),
                                            ({"allocation": 1}, "overlap")])
def test_the_compiled_twin_refuses_sections_missing_or_overlapping(first, message):
    alloc, _ = _build("states-ps4-k3")  # page tables and state slots
    layout = alloc.ring.layout
    shifted = _Shifted([(s.name, s.n_rows) for s in layout.sections])
    shifted.first = first
    alloc.ring.layout = shifted
    with pytest.raises(ValueError, match=message):
        compiled.CompiledPlanner(alloc.parts)
    alloc.ring.layout = layout
    compiled.CompiledPlanner(alloc.parts)  # (the real layout binds)
