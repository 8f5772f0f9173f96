"""graphalloc: a graph-captured, sync-free paged KV-cache allocator for hybrid
full-attention + sliding-window-attention models.

Layers, highest first (most users want the first):

* :class:`HybridAllocator` -- admit / extend / decode / evict / release, one step each,
  or :meth:`HybridAllocator.step` for a whole scheduler step;
* :class:`StepGraph` -- replays each step from a captured CUDA graph;
* ``graphalloc.planner`` / ``graphalloc.kernels`` -- the descriptor planner and the kernels.
"""

import importlib.util as _ilu
import os as _os
import sys as _sys


def _map_kernels() -> None:
    """``kernels/`` is installed as ``graphalloc.kernels`` (setuptools package-dir). Some
    editable installs (older setuptools, a source tree on sys.path) do not apply that
    mapping; then load the sibling ``kernels/`` directory under that name."""
    if "graphalloc.kernels" in _sys.modules:
        return
    here = _os.path.dirname(_os.path.abspath(__file__))
    if _os.path.isdir(_os.path.join(here, "kernels")):
        return  # an installed (non-editable) package: kernels/ sits inside
    try:
        if _ilu.find_spec("graphalloc.kernels") is not None:
            return
    except ImportError:
        pass
    root = _os.path.join(_os.path.dirname(here), "kernels")
    spec = _ilu.spec_from_file_location("graphalloc.kernels", _os.path.join(root, "__init__.py"),
                                        submodule_search_locations=[root])
    if spec is None or spec.loader is None:
        raise ImportError("graphalloc.kernels not found: reinstall with `pip install -e .`")
    module = _ilu.module_from_spec(spec)
    _sys.modules["graphalloc.kernels"] = module
    spec.loader.exec_module(module)


_map_kernels()

from .allocator import AllocResult, HybridAllocator, PlannedStep  # noqa: E402
from .config import AllocatorConfig  # noqa: E402
from .errors import *  # noqa: E402, F403
from .errors import __all__ as _errors_all  # noqa: E402
from .graph import StepGraph, capture_graph, describe_graph  # noqa: E402
from .replicas import ReplicatedAllocator  # noqa: E402

__all__ = [
    "HybridAllocator", "AllocatorConfig", "AllocResult", "PlannedStep", "StepGraph",
    "ReplicatedAllocator",
    "capture_graph", "describe_graph", *_errors_all,
]
