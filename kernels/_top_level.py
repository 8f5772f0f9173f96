"""What happens when this folder is imported under a name other than ``graphalloc.kernels``.

The repository keeps its device code in a top-level ``kernels/`` folder, installed as
``graphalloc.kernels``. A Python started in the repository root puts the root on
``sys.path``, so ``import kernels`` would find the folder before an installed package of
that name (Hugging Face's ``kernels``, a dependency of transformers 5.25 and newer) and
shadow it. :func:`hand_over` runs instead of the folder's body whenever it is imported
as anything but ``graphalloc.kernels``: the name goes to the installed package found on
the rest of ``sys.path``; with none installed it becomes what an empty namespace package
is (no ``__file__``, no ``__version__``, nothing to import from it: ``from kernels import
x`` raises ``ImportError``). Not an error there, because a library asking whether the
package exists finds the folder first (``importlib.util.find_spec``) and then imports it:
transformers does, and takes a module without ``__file__`` or version for "not
installed", where an exception from the import would break every model it loads.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types

__all__ = ["hand_over"]


def hand_over(name: str, init_file: str) -> None:
    """Replace the module being imported as ``name`` by the installed package of that name
    (looked up on ``sys.path`` without the folder that holds this one), or by an empty
    namespace package when none is installed. Python's import keeps the module found
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
    if spec is None or spec.loader is None:  # none installed: an empty namespace package
        module = types.ModuleType(name, "(the repository's folder is graphalloc.kernels; no "
                                        f"package {name!r} is installed)")
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        sys.modules[name] = module
        sys.modules.pop(f"{name}._top_level", None)
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
