"""Build of the compiled parts: the optional compiled twin of the step planner,
``graphalloc.plan._cplan`` (C, every ``_cplan*.c`` under graphalloc/plan/: the kinds and
one file per pool), the page keys' ``graphalloc.sharing._ckeys`` (C, one file) and the
compiled half of the input conversion path, ``graphalloc._cinputs`` (graphalloc/_cinputs.c).

Everything else is in pyproject.toml. Every extension is optional: without a C compiler
(or Python headers) the build goes on without them and prints one line each;
``graphalloc.plan.compiled`` then warns once at import and every step runs the numpy
planner (the reference), ``graphalloc.sharing.page_keys`` warns once and hashes pages
with its pure-Python twin (the same keys, hundreds of times slower), and the inputs are
converted by ``graphalloc.inputs`` in Python (the same arrays and errors, at a cost per
element).
"""

import glob
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that never fails the install: a failed compile leaves the numpy planner."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # no compiler at all (a platform error before any compile)
            self._skip(exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # a compile or link error
            self._skip(exc)

    @staticmethod
    def _skip(exc):
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        print(f"graphalloc: a compiled part was not built ({reason}); its Python twin will "
              "be used", file=sys.stderr)


setup(
    ext_modules=[Extension("graphalloc.plan._cplan",
                           # every _cplan*.c: the kinds and each pool's own file
                           sources=sorted(glob.glob("graphalloc/plan/_cplan*.c")),
                           depends=["graphalloc/plan/_cplan.h",
                                    "graphalloc/plan/_cplan_refusals.h"],
                           extra_compile_args=["-O3", "-fwrapv"], optional=True),
                 Extension("graphalloc.sharing._ckeys",
                           sources=["graphalloc/sharing/_ckeys.c"],
                           extra_compile_args=["-O3"], optional=True),
                 Extension("graphalloc._cinputs", sources=["graphalloc/_cinputs.c"],
                           extra_compile_args=["-O3"], optional=True)],
    cmdclass={"build_ext": OptionalBuildExt},
)
