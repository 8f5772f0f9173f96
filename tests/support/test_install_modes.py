"""Every install mode imports the same package: ``kernels/`` (top level in the source tree)
is ``graphalloc.kernels`` in an editable install, a regular install and a wheel, with
nothing patched into ``sys.modules``. Every mode builds the compiled planner
(``graphalloc.plan._cplan``) where a C compiler is present, and an install without one still
succeeds: the package then warns once at import and plans with numpy.

The editable install is the one the suite itself runs on (``make test``); the other two
are built here into temporary directories and imported from a directory outside the
source tree, so the source tree cannot be found by accident.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = (
    # The source tree's editable finder would resolve a submodule missing from the copy
    # under test (graphalloc.plan._cplan) from the tree: take it out first.
    "import sys\n"
    "sys.meta_path[:] = [f for f in sys.meta_path\n"
    "                    if '__editable__' not in getattr(f, '__module__', '')]\n"
    "import graphalloc, graphalloc.kernels as k, graphalloc.kernels.abi as abi\n"
    "from graphalloc import HybridAllocator, AllocatorConfig\n"
    "cfg = AllocatorConfig(page_size=2, num_full_pages=8, num_swa_pages=8, max_reqs=2,\n"
    "                      max_context_len=8, sliding_window=2)\n"
    "import graphalloc.plan.compiled as fp\n"
    "a = HybridAllocator(cfg); r = a.admit(); a.alloc_extend([r], [5]); a.release([r])\n"
    "a.check_integrity()\n"
    "assert (a.pipeline.compiled is not None) == fp.AVAILABLE\n"
    "import os\n"
    "here = os.path.dirname(graphalloc.__file__)\n"
    "assert not fp.AVAILABLE or fp._cplan.__file__.startswith(here), fp._cplan.__file__\n"
    "print('compiled planner', fp.AVAILABLE)\n"
    "assert k.__name__ == 'graphalloc.kernels' and abi.ROW_WIDTH == 8\n"
    "assert 'kernels' not in sys.modules, 'a top-level kernels module was imported'\n"
    "print(graphalloc.__file__)\n"
)


def _pip(*args, cwd=ROOT, env=None):
    return subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env=env)


def _probe(site: str, cwd: str, compiled: bool = True) -> str:
    # PYTHONPATH entries come before the editable install's finder, so the copy in ``site``
    # is the one imported (the probe asserts where it came from).
    env = dict(os.environ, PYTHONPATH=site)
    env.pop("GRAPHALLOC_PLANNER", None)
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[-2] == f"compiled planner {compiled}", out.stdout + out.stderr
    warned = [line for line in out.stderr.splitlines()
              if "graphalloc: compiled planner unavailable (" in line]
    assert len(warned) == (0 if compiled else 1), out.stderr
    return lines[-1]


def test_editable_install_is_what_the_suite_runs():
    import graphalloc
    import graphalloc.kernels

    assert graphalloc.kernels.__name__ == "graphalloc.kernels"
    assert os.path.realpath(graphalloc.kernels.__file__).startswith(os.path.join(ROOT,
                                                                                 "kernels"))
    if shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc"):  # built in place
        import graphalloc.plan.compiled as fp
        assert fp.AVAILABLE, fp.UNAVAILABLE_REASON
        assert os.path.realpath(fp._cplan.__file__).startswith(os.path.join(ROOT, "graphalloc"))
    # (In-process, a third-party package may probe a top-level ``kernels`` on the source
    # tree's sys.path; the probes below check from outside the tree that graphalloc itself
    # never imports one.)


@pytest.mark.parametrize("mode", ["wheel", "regular"])
def test_wheel_and_regular_install_import_outside_the_tree(mode, tmp_path):
    site = str(tmp_path / "site")
    if mode == "wheel":
        built = _pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                     str(tmp_path / "dist"), ".")
        assert built.returncode == 0, built.stdout + built.stderr
        (wheel,) = (tmp_path / "dist").glob("graphalloc-*.whl")
        names = zipfile.ZipFile(wheel).namelist()
        assert "graphalloc/kernels/abi.py" in names and not any(
            n.startswith("kernels/") for n in names), names
        assert any(n.startswith("graphalloc/plan/_cplan") and n.endswith(".so")
                   for n in names), names
        done = _pip("install", "--no-deps", "-q", "--target", site, str(wheel))
    else:
        done = _pip("install", "--no-deps", "--no-build-isolation", "-q", "--target", site, ".")
    assert done.returncode == 0, done.stdout + done.stderr
    where = _probe(site, cwd=str(tmp_path))
    assert where.startswith(site), where  # the installed copy, not the source tree


def test_install_without_a_compiler_falls_back_to_the_numpy_planner(tmp_path):
    """No C compiler: the install succeeds without the extension (one line says so), and
    the package imports with one warning and plans every step with numpy."""
    site, src = str(tmp_path / "site"), tmp_path / "src"
    # A clean copy of the tree: no build/ directory or in-place extension to reuse.
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "*.so", "__pycache__", ".hypothesis",
        ".pytest_cache", ".ruff_cache", "results"))
    env = dict(os.environ, CC="/bin/false", CXX="/bin/false", LDSHARED="/bin/false")
    done = _pip("install", "--no-deps", "--no-build-isolation", "-q", "--target", site, ".",
                cwd=str(src), env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not list((tmp_path / "site" / "graphalloc").rglob("_cplan*.so")), "built anyway"
    where = _probe(site, cwd=str(tmp_path), compiled=False)
    assert where.startswith(site), where
