"""Every install mode imports the same package: ``kernels/`` (top level in the source tree)
is ``graphalloc.kernels`` in an editable install, a regular install and a wheel, with
nothing patched into ``sys.modules``.

The editable install is the one the suite itself runs on (``make test``); the other two
are built here into temporary directories and imported from a directory outside the
source tree, so the source tree cannot be found by accident.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = (
    "import sys, graphalloc, graphalloc.kernels as k, graphalloc.kernels.abi as abi\n"
    "from graphalloc import HybridAllocator, AllocatorConfig\n"
    "cfg = AllocatorConfig(page_size=2, num_full_pages=8, num_swa_pages=8, max_reqs=2,\n"
    "                      max_context_len=8, sliding_window=2)\n"
    "a = HybridAllocator(cfg); r = a.admit(); a.alloc_extend([r], [5]); a.release([r])\n"
    "a.check_integrity()\n"
    "assert k.__name__ == 'graphalloc.kernels' and abi.ROW_WIDTH == 8\n"
    "assert 'kernels' not in sys.modules, 'a top-level kernels module was imported'\n"
    "print(graphalloc.__file__)\n"
)


def _pip(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def _probe(site: str, cwd: str) -> str:
    # PYTHONPATH entries come before the editable install's finder, so the copy in ``site``
    # is the one imported (the probe asserts where it came from).
    env = dict(os.environ, PYTHONPATH=site)
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_editable_install_is_what_the_suite_runs():
    import graphalloc
    import graphalloc.kernels

    assert graphalloc.kernels.__name__ == "graphalloc.kernels"
    assert os.path.realpath(graphalloc.kernels.__file__).startswith(os.path.join(ROOT,
                                                                                 "kernels"))
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
        done = _pip("install", "--no-deps", "-q", "--target", site, str(wheel))
    else:
        done = _pip("install", "--no-deps", "--no-build-isolation", "-q", "--target", site, ".")
    assert done.returncode == 0, done.stdout + done.stderr
    where = _probe(site, cwd=str(tmp_path))
    assert where.startswith(site), where  # the installed copy, not the source tree
