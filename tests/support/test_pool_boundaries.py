"""The pools' boundary: the planner's kinds ask the pools, they never branch on a pool.

What a pool decides (the window pool's policy -- pooled, ring or none -- and rule, whether
there are recurrent-state slots) lives in ``graphalloc/pools/`` and the pools' C files
(``_cplan_window.c``, ``_cplan_chunked.c``, ``_cplan_states.c``). The planning code of
the step kinds, in Python and in C, must not ask "is this the ring policy?" or "are there
state slots?": a new pool would then touch every kind again (the state slots once touched
36 of 76 runtime files). Construction and binding (the config, the compiled planner's
constructor) may read the pools' sizes.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PLAN = ROOT / "graphalloc" / "plan"
# the step kinds' planning code, both planners
KIND_MODULES = ("frees.py", "allocation.py", "reference.py", "context.py", "lanes.py",
                "release_rows.py", "free_group.py", "recorder.py", "pipeline.py")
KIND_C_FILES = ("_cplan_core.c", "_cplan_frees.c", "_cplan_alloc.c")
POOL_BRANCH = re.compile(r"ring_mode|has_states|swa_ring_pages|num_state_slots|win_policy"
                         r"|\bWP_(NONE|POOLED|RING)\b|\bsliding_window\b")


def _code_lines(path: pathlib.Path):
    """(number, line) of code, docstrings and comments left out."""
    text = path.read_text()
    if path.suffix == ".py":  # blank out triple-quoted strings, keep line numbers
        text = re.sub(r'"""(.|\n)*?"""', lambda m: "\n" * m.group(0).count("\n"), text)
        strip = re.compile(r"#.*$")
    else:
        text = re.sub(r"/\*(.|\n)*?\*/", lambda m: "\n" * m.group(0).count("\n"), text)
        strip = re.compile(r"//.*$")
    for i, line in enumerate(text.splitlines(), 1):
        yield i, strip.sub("", line)


def test_the_kinds_ask_the_pools():
    found = []
    for name in KIND_MODULES + KIND_C_FILES:
        path = PLAN / name
        for i, line in _code_lines(path):
            if POOL_BRANCH.search(line):
                found.append(f"plan/{name}:{i}: {line.strip()}")
    assert not found, "pool branches in the kinds' planning code:\n" + "\n".join(found)


def test_the_check_can_fail():
    """The pattern catches the branches it is for (a check that checks nothing is none)."""
    for line in ("if cfg.ring_mode:", "if (P->has_states)", "if P->win_policy == WP_RING",
                 "need_swa = 0 if cfg.ring_mode else need"):
        assert POOL_BRANCH.search(line), line
