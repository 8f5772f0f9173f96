"""The allocator's surface equals the SGLang version it targets: every method SGLang's
allocation path calls, with SGLang's parameter names in SGLang's order (extra trailing
optional parameters allowed). The reference is the installed SGLang when it can be
imported (and then the committed list must equal it), else the committed list
``sglang_surface.json`` (rewritten by ``tools/engines/sglang_surface.py``)."""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from pathlib import Path

import pytest

from graphalloc.integrations.sglang_mamba import GraphallocMambaSlotAllocator
from graphalloc.integrations.sglang_pool import GraphallocTokenToKVPoolAllocator
from graphalloc.integrations.sglang_subclass import sglang_classes

HERE = Path(__file__).resolve().parent
TOOLS = HERE.parents[1] / "tools" / "engines"
COMMITTED = json.loads((HERE / "sglang_surface.json").read_text())


def parameters(func) -> list[str]:
    return [p.name for p in inspect.signature(func).parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def installed():
    """SGLang's surface read from the installed package, or None without SGLang."""
    if importlib.util.find_spec("sglang") is None:
        return None
    sys.path.insert(0, str(TOOLS))
    try:
        import sglang_import
        import sglang_surface
        sglang_import.import_sglang()
        return sglang_surface.read_installed()
    finally:
        sys.path.remove(str(TOOLS))


REFERENCE = installed()
KINDS = ["swa", "paged"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_method_sglang_calls_has_sglangs_parameters(kind):
    ref = (REFERENCE or COMMITTED)[kind]
    for method, names in ref.items():
        if method == "__init__":
            continue
        ours = getattr(GraphallocTokenToKVPoolAllocator, method, None)
        assert ours is not None, f"{method} is missing"
        assert parameters(ours)[:len(names)] == names, (method, parameters(ours), names)
        extra = list(inspect.signature(ours).parameters.values())[len(names) + 1:]
        assert all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                   for p in extra), (method, "extra parameters must be optional")


def test_the_mamba_slot_allocator_has_sglangs_surface():
    ref = (REFERENCE or COMMITTED)["mamba"]
    for method, names in ref.items():
        ours = getattr(GraphallocMambaSlotAllocator, method, None)
        assert ours is not None, f"{method} is missing"
        assert parameters(ours) == names, (method, parameters(ours), names)


def test_the_core_constructor_takes_every_sglang_argument_by_name():
    ours = set(parameters(GraphallocTokenToKVPoolAllocator.__init__))
    for kind in KINDS:
        assert set((REFERENCE or COMMITTED)[kind]["__init__"]) <= ours, kind


@pytest.mark.skipif(REFERENCE is None, reason="SGLang is not installed")
def test_the_committed_surface_is_the_installed_sglangs():
    import sglang
    assert COMMITTED["sglang"] == sglang.__version__
    assert {k: COMMITTED[k] for k in (*KINDS, "mamba")} == REFERENCE


@pytest.mark.skipif(REFERENCE is None, reason="SGLang is not installed")
@pytest.mark.parametrize("kind", KINDS)
def test_the_sglang_subclasses_keep_sglangs_constructor(kind):
    cls = sglang_classes()[kind]
    assert parameters(cls.__init__) == REFERENCE[kind]["__init__"]
