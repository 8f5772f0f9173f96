"""The compiled planner: the C twin of the numpy reference planner (being rebuilt for the
Step arrays; until then every step is planned by the numpy reference).

``resolve_planner`` decides who plans: ``"auto"`` (the compiled twin when it was built;
``GRAPHALLOC_PLANNER=numpy`` forces numpy), ``"compiled"`` (refused with ``ConfigError``
when it was not built) or ``"numpy"``.
"""

from __future__ import annotations

import os

from ..errors import ConfigError

__all__ = ["AVAILABLE", "UNAVAILABLE_REASON", "CompiledPlanner", "PLANNERS", "resolve_planner"]

PLANNERS = ("auto", "compiled", "numpy")
AVAILABLE = False
UNAVAILABLE_REASON = "the compiled twin of the Step planner is not built yet"


def resolve_planner(planner) -> str:
    if not isinstance(planner, str) or planner not in PLANNERS:
        raise ConfigError(f"planner must be one of {PLANNERS}, got {planner!r}")
    if planner == "auto":
        wanted = os.environ.get("GRAPHALLOC_PLANNER", "auto")
        return "compiled" if AVAILABLE and wanted != "numpy" else "numpy"
    if planner == "compiled" and not AVAILABLE:
        raise ConfigError(f"planner='compiled', but the compiled planner is unavailable "
                          f"({UNAVAILABLE_REASON}); reinstall with a C compiler "
                          "(pip install -e .) or use planner='numpy'")
    return planner


class CompiledPlanner:
    @classmethod
    def for_allocator(cls, alloc, planner: str = "auto"):
        if resolve_planner(planner) != "compiled":
            return None
        return cls()
