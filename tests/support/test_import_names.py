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
    installed it is an empty namespace package (below)."""
    out = _run_in_root("import kernels, os; print(os.path.abspath(kernels.__file__))")
    folder = os.path.join(ROOT, "kernels")
    if _installed("kernels"):
        assert out.returncode == 0, out.stderr
        where = out.stdout.strip()
        assert not where.startswith(folder + os.sep), where
        assert "site-packages" in where or "dist-packages" in where, where
    else:
        assert out.returncode != 0 and "__file__" in out.stderr, out.stderr


# A Python in the repository root where no package named kernels is installed (the GPU
# machine's environment): the installed package's lookup is made to find nothing.
_NONE_INSTALLED = """
import importlib.machinery as m
_find = m.PathFinder.find_spec.__func__
def find_spec(cls, name, path=None, target=None):
    return None if name == "kernels" and path is not None else _find(cls, name, path, target)
m.PathFinder.find_spec = classmethod(find_spec)
"""


def test_with_none_installed_the_name_is_an_empty_namespace_package():
    """No installed ``kernels``: ``import kernels`` from the root gives a module without a
    file, a version or contents (``from kernels import x`` raises ImportError), and
    transformers' check for the package, which finds the folder and imports it, says it is
    not installed instead of raising."""
    out = _run_in_root(_NONE_INSTALLED + (
        "import kernels\n"
        "assert getattr(kernels, '__file__', None) is None, kernels.__file__\n"
        "assert not hasattr(kernels, '__version__') and list(kernels.__path__) == []\n"
        "try:\n"
        "    from kernels import get_kernel\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('imported a name from the placeholder')\n"
        "print('ok')\n"))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
    if importlib.util.find_spec("transformers") is None:
        return
    out = _run_in_root(_NONE_INSTALLED + (
        "import importlib.metadata as md\n"
        "_version = md.version\n"
        "def version(name):\n"
        "    if name == 'kernels':\n"
        "        raise md.PackageNotFoundError(name)\n"
        "    return _version(name)\n"
        "md.version = version\n"
        "from transformers.utils import import_utils as iu\n"
        "assert iu.is_kernels_available() is False\n"
        "import transformers.integrations.hub_kernels\n"
        "print('ok')\n"))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


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
