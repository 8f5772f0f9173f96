"""Every script in ``examples/`` and ``benchmarks/`` answers ``--help`` (exit 0, a usage
and a description), and ``make demo``'s example finishes at a tiny size.

The scripts run in this process through :mod:`runpy` (each guards its work with
``if __name__ == "__main__"``, checked first), so torch and graphalloc are imported once,
not once per script: about a second for all of them. The seam examples
(``examples/integrate_*.py``) are left out while they are rewritten with
``graphalloc/integrations/``; their own tests run them.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DIRS = ("examples", "examples/model_loops", "benchmarks", "tools")
SCRIPTS = sorted(p.relative_to(ROOT).as_posix() for d in DIRS for p in (ROOT / d).glob("*.py")
                 if not p.name.startswith("integrate_"))


def run_script(script: str, argv: list[str]) -> int:
    """Run ``script`` as ``__main__`` with ``argv``, its folder and its sibling folder on
    ``sys.path`` as a command line would have them; the exit code (0 when it returns).
    ``sys.argv``, ``sys.path`` and the modules of examples/ and benchmarks/ it imported
    are put back afterwards."""
    saved_argv, saved_path, saved_modules = sys.argv[:], sys.path[:], set(sys.modules)
    sys.argv = [script, *argv]
    sys.path[:0] = [str(ROOT / d) for d in DIRS]
    try:
        runpy.run_path(str(ROOT / script), run_name="__main__")
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        for name in set(sys.modules) - saved_modules:
            path = getattr(sys.modules[name], "__file__", None) or ""
            if any(path.startswith(str(ROOT / d)) for d in DIRS):
                del sys.modules[name]


def test_scripts_found():
    assert "examples/first_steps.py" in SCRIPTS and "benchmarks/bench_scheduler.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script, capsys):
    source = (ROOT / script).read_text()
    assert 'if __name__ == "__main__":' in source, f"{script}: work not guarded by __main__"
    code = run_script(script, ["--help"])
    out = capsys.readouterr().out
    assert code == 0, f"{script} --help exited {code}"
    usage, _, rest = out.partition("\n")
    assert usage.startswith("usage:") and rest.strip(), f"{script} --help printed {out!r}"


def test_demo_example_runs(capsys):
    """``make demo``'s example, at a tiny size: every step, refusal and check of it."""
    assert run_script("examples/first_steps.py", ["--steps", "15", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "every page back" in out and "-> None" in out
