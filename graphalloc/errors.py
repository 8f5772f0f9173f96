"""graphalloc's exception hierarchy and device fault codes.

The classes are defined in :mod:`graphalloc.kernels.errors` (the kernels' launchers
raise them too, and ``kernels/`` imports nothing from the runtime); this module is
where users import them from.
"""

from .kernels.errors import *  # noqa: F403
from .kernels.errors import __all__  # noqa: F401
