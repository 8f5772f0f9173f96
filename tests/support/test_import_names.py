"""Nothing in the repository is imported under a name an installed package owns.

A Python started in the repository root (``python -m pytest``, ``python -c``, a notebook, an
example run from the root) has the root on ``sys.path``; a script has its own folder there;
the suite puts ``tests/lib`` and ``tools`` there. Any module or package in those folders
whose name an installed distribution (or the standard library) also provides would shadow
it. The top-level ``kernels/`` folder (``graphalloc.kernels``) is the one such name by
design: imported as ``kernels`` it hands the name to the installed package
(``kernels/_top_level.py``), which these tests check in a fresh interpreter.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Folders an invocation puts on sys.path: the root (python -m / -c / a notebook), the
# suite's helper folders (tests/conftest.py), every folder holding scripts run by path.
ON_SYS_PATH = (".", "tests", "tests/lib", "tests/gpu", "tools", "benchmarks", "examples",
               "examples/model_loops")


def _run_in_root(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_kernels_resolves_to_the_installed_package_from_the_root():
    """``import kernels`` in the repository root gives the installed package (Hugging
    Face's, which transformers 5.25+ imports), never the repository's folder; with none
    installed it fails as it would anywhere else."""
    out = _run_in_root("import kernels, os; print(os.path.abspath(kernels.__file__))")
    folder = os.path.join(ROOT, "kernels")
    if _installed("kernels"):
        assert out.returncode == 0, out.stderr
        where = out.stdout.strip()
        assert not where.startswith(folder + os.sep), where
        assert "site-packages" in where or "dist-packages" in where, where
    else:
        assert out.returncode != 0 and "ModuleNotFoundError" in out.stderr, out.stderr


def test_transformers_hub_kernels_imports_from_the_root():
    """What failed on a fresh machine: transformers' hub-kernels integration imports
    ``kernels``; from the repository root it must get the installed one."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    out = _run_in_root("import transformers.integrations.hub_kernels as h; print(h.__name__)")
    assert out.returncode == 0, out.stderr[-3000:]


def test_graphalloc_kernels_is_still_the_device_code():
    out = _run_in_root("import graphalloc.kernels as k, sys\n"
                       "assert k.__name__ == 'graphalloc.kernels' and callable(k.release_pages)\n"
                       "mod = sys.modules.get('kernels')\n"
                       "assert mod is None or 'graphalloc' not in (mod.__file__ or '')\n")
    assert out.returncode == 0, out.stderr


def test_the_folder_under_another_name_is_refused():
    """Imported as a subpackage of the root's parent (``main.kernels``), the folder refuses
    with the name to use instead, rather than loading a second copy of the kernels."""
    parent, base = os.path.split(ROOT)
    if not base.isidentifier():
        pytest.skip(f"the checkout's folder name {base!r} is not importable anyway")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", f"import {base}.kernels"], cwd=parent, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "graphalloc.kernels" in out.stderr, out.stderr


def _importable_names(folder: str) -> set[str]:
    names = set()
    for entry in os.listdir(folder):
        path = os.path.join(folder, entry)
        if entry.endswith(".py"):
            names.add(entry[:-3])
        elif os.path.isfile(os.path.join(path, "__init__.py")):
            names.add(entry)
    return names


def test_no_folder_on_sys_path_shadows_an_installed_or_standard_name():
    owners = importlib.metadata.packages_distributions()
    owned = set(sys.stdlib_module_names) | {name for name, dists in owners.items()
                                            if set(dists) != {"graphalloc"}}
    clashes = {}
    for rel in ON_SYS_PATH:
        folder = os.path.join(ROOT, rel)
        mine = _importable_names(folder) - {"conftest", "setup"}
        if rel == ".":
            mine -= {"kernels"}  # hands its name over (the tests above)
        bad = sorted(mine & owned)
        if bad:
            clashes[rel] = bad
    assert not clashes, f"modules named like an installed or standard package: {clashes}"
