"""What happens when this folder is imported under a name other than ``graphalloc.kernels``.

The repository keeps its device code in a top-level ``kernels/`` folder, installed as
``graphalloc.kernels``. A Python started in the repository root puts the root on
``sys.path``, so ``import kernels`` would find the folder before an installed package of
that name (Hugging Face's ``kernels``, a dependency of transformers 5.25 and newer) and
shadow it. :func:`hand_over` runs instead of the folder's body whenever it is imported
as anything but ``graphalloc.kernels``: the name goes to the installed package found on
the rest of ``sys.path``, or the import fails as it would without this repository.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

__all__ = ["hand_over"]


def hand_over(name: str, init_file: str) -> None:
    """Replace the module being imported as ``name`` by the installed package of that name
    (looked up on ``sys.path`` without the folder that holds this one), or raise
    ``ModuleNotFoundError`` when none is installed. Python's import keeps the module found
    in ``sys.modules[name]`` after the body ran, which is what makes the replacement the
    result of ``import kernels``."""
    here = os.path.dirname(os.path.abspath(init_file))
    root = os.path.dirname(here)
    if name != os.path.basename(here):  # e.g. imported as a subpackage of the root folder
        raise ImportError(f"graphalloc's device code is the package graphalloc.kernels; "
                          f"import that instead of {name!r}")
    search = [entry for entry in sys.path
              if os.path.abspath(entry or os.getcwd()) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, search)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r} (the repository's {name}/ folder "
                                  f"is graphalloc.{name}, not a top-level package)", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
