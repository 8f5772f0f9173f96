"""Parts wired once, never calling up: a static walk of the source (``ast``, nothing imported).

Rule (:mod:`graphalloc.parts`, docs/design.md "Rooms by stage"): the allocator composes its
parts and hands each layer below it only the narrow parts it uses. So

* no module below the allocator takes or stores the allocator: no parameter named
  ``alloc`` / ``allocator``, no ``self.alloc`` / ``self._alloc``, no ``HybridAllocator``;
* no module below the allocator imports one on the front-end floor (the allocator, its
  operations, the blocks, the prefix cache's client, the seams, the replicas), at the top
  or inside a function: a call up would have to go through one of those;
* a static walk of the calls from a seam (SGLang's ``prepare_for_decode``, vLLM's
  ``allocate_slots`` + ``run_step``) and from ``HybridAllocator.step`` reaches the kernels
  (a function of ``graphalloc/kernels/``): the parts are wired, not looked up.

The walk resolves a call by what the source says: ``self.m()`` to the enclosing class's
method (or a function stored on ``self``), ``f()`` to the module's own or imported
function, ``module.f()`` through the module's imports, ``x.m()`` / ``x.y.m()`` through the
classes assigned to a name ``x`` / ``y`` anywhere (``self.y = Cls(...)``, ``y = f(...)``
where ``f`` returns ``Cls(...)``, a parameter annotated ``Cls``), subclasses included.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The front-end floor: modules at or above allocator.py (they may hold the allocator).
FRONT = ("graphalloc.allocator", "graphalloc.operations", "graphalloc.plan.recorder",
         "graphalloc.plan.free_group", "graphalloc.sharing.prefix_cache",
         "graphalloc.integrations", "graphalloc.replicas", "graphalloc")
SEAMS = (("graphalloc.integrations.sglang", "SGLangAllocator", "prepare_for_decode"),
         ("graphalloc.integrations.vllm", "GraphallocKVCacheManager", "run_step"),
         ("graphalloc.allocator", "HybridAllocator", "step"))


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for base, prefix in ((ROOT / "graphalloc", "graphalloc"), (ROOT / "kernels",
                                                               "graphalloc.kernels")):
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            if "kernels" in rel.parts and base.name == "graphalloc":
                continue  # the link to kernels/, read from there
            name = ".".join((prefix, *rel.parts))
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def is_front(module: str) -> bool:
    return any(module == f or (f != "graphalloc" and module.startswith(f + "."))
               for f in FRONT)


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".")
    is_pkg = MODULES[module].name == "__init__.py"
    base = package[:len(package) - node.level + (1 if is_pkg else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> dict[str, str]:
    """Local name -> what it names: ``"pkg.mod"`` (a module) or ``"pkg.mod:f"``."""
    names = {}
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.ImportFrom):
            src = _absolute(module, node)
            for alias in node.names:
                full = f"{src}.{alias.name}"
                names[alias.asname or alias.name] = full if full in MODULES else (
                    f"{src}:{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.name
    return names


IMPORTS = {m: _imports(m) for m in MODULES}


# ---- definitions ---------------------------------------------------------------------------
FUNCS: dict[str, ast.AST] = {}  # "mod:f" and "mod:Cls.m"
CLASSES: dict[str, list[str]] = {}  # "mod:Cls" -> base names
CLASS_BY_NAME: dict[str, set[str]] = {}
for _m, _tree in TREES.items():
    for _node in _tree.body:
        if isinstance(_node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            FUNCS[f"{_m}:{_node.name}"] = _node
        elif isinstance(_node, ast.ClassDef):
            CLASSES[f"{_m}:{_node.name}"] = [ast.unparse(b).split(".")[-1] for b in _node.bases]
            CLASS_BY_NAME.setdefault(_node.name, set()).add(f"{_m}:{_node.name}")
            for _item in _node.body:
                if isinstance(_item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    FUNCS[f"{_m}:{_node.name}.{_item.name}"] = _item


def _subclasses(cls: str) -> set[str]:
    out, short = {cls}, cls.split(":")[1]
    for other, bases in CLASSES.items():
        if short in bases:
            out |= _subclasses(other)
    return out


def _resolve_name(module: str, name: str) -> str | None:
    """A module-level function or class a bare name means in ``module``."""
    if f"{module}:{name}" in FUNCS or f"{module}:{name}" in CLASSES:
        return f"{module}:{name}"
    target = IMPORTS[module].get(name)
    if target and ":" in target:
        src, attr = target.split(":")
        if src in MODULES:
            return _resolve_name(src, attr) if src != module else None
    return None


def _returned_classes(func: str) -> set[str]:
    module = func.split(":")[0]
    out = set()
    for node in ast.walk(FUNCS[func]):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Call):
            target = _resolve_name(module, ast.unparse(node.value.func).split(".")[-1])
            if target in CLASSES:
                out.add(target)
    return out


def _bindings() -> dict[str, set[str]]:
    """Name -> classes (or functions) assigned to it anywhere: the wiring, read off."""
    out: dict[str, set[str]] = {"alloc": set(CLASS_BY_NAME["HybridAllocator"])}
    for module, tree in TREES.items():
        for node in ast.walk(tree):
            pairs = []
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs += list(zip(target.elts, node.value.elts, strict=False))
                    else:
                        pairs.append((target, node.value))
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                pairs.append((node.target, node.value))
            elif isinstance(node, ast.arg) and node.annotation is not None:
                cls = _resolve_name(module, ast.unparse(node.annotation).split(".")[-1])
                if cls in CLASSES:
                    out.setdefault(node.arg, set()).add(cls)
            for target, value in pairs:
                name = (target.attr if isinstance(target, ast.Attribute) else
                        target.id if isinstance(target, ast.Name) else None)
                if name is None:
                    continue
                if isinstance(value, ast.IfExp):
                    values = [value.body, value.orelse]
                else:
                    values = [value]
                for v in values:
                    ref = v.func if isinstance(v, ast.Call) else v
                    found = _resolve_name(module, ast.unparse(ref).split(".")[-1]) if isinstance(
                        ref, (ast.Name, ast.Attribute)) else None
                    if found in CLASSES and isinstance(v, ast.Call):
                        out.setdefault(name, set()).add(found)
                    elif found in FUNCS and isinstance(v, ast.Call):
                        out.setdefault(name, set()).update(_returned_classes(found))
                    elif found in FUNCS:  # a function stored under this name
                        out.setdefault(name, set()).add(found)
    return out


BINDINGS = _bindings()


def _method(cls: str, name: str) -> set[str]:
    """``name`` on ``cls`` and on its subclasses that override it (inherited from a base of
    ``cls`` when ``cls`` lacks it)."""
    out = set()
    for sub in _subclasses(cls):
        if f"{sub}.{name}" in FUNCS:
            out.add(f"{sub}.{name}")
    base = cls
    while f"{base}.{name}" not in FUNCS and CLASSES.get(base):
        parents = [c for b in CLASSES[base] for c in CLASS_BY_NAME.get(b, ())]
        if not parents:
            break
        base = parents[0]
        if f"{base}.{name}" in FUNCS:
            out.add(f"{base}.{name}")
    return out


def _callees(func: str) -> set[str]:
    module, qual = func.split(":")
    cls = f"{module}:{qual.split('.')[0]}" if "." in qual else None
    out: set[str] = set()
    for node in ast.walk(FUNCS[func]):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name):
            target = _resolve_name(module, f.id)
            if target in FUNCS:
                out.add(target)
            elif target in CLASSES:
                out |= _method(target, "__init__")
            for bound in BINDINGS.get(f.id, ()):  # a part called: its __call__
                out |= {bound} if bound in FUNCS else _method(bound, "__call__")
        elif isinstance(f, ast.Attribute):
            recv = f.value
            if isinstance(recv, ast.Name) and recv.id == "self" and cls is not None:
                out |= _method(cls, f.attr)
                for bound in BINDINGS.get(f.attr, ()):
                    if bound in FUNCS:
                        out.add(bound)
                    else:
                        out |= _method(bound, "__call__")
                continue
            if isinstance(recv, ast.Name) and IMPORTS[module].get(recv.id) in MODULES:
                src = IMPORTS[module][recv.id]
                if f"{src}:{f.attr}" in FUNCS:
                    out.add(f"{src}:{f.attr}")
                continue
            name = recv.id if isinstance(recv, ast.Name) else (
                recv.attr if isinstance(recv, ast.Attribute) else None)
            for bound in BINDINGS.get(name, ()):
                if bound in CLASSES:
                    out |= _method(bound, f.attr)
    return out


def walk(start: str) -> dict[str, str]:
    """Every function reachable from ``start``, each with the function it was reached from."""
    seen, todo = {start: ""}, [start]
    while todo:
        func = todo.pop()
        for callee in _callees(func):
            if callee not in seen:
                seen[callee] = func
                todo.append(callee)
    return seen


def _route(seen: dict[str, str], end: str) -> list[str]:
    route = [end]
    while seen[route[-1]]:
        route.append(seen[route[-1]])
    return route[::-1]


# ---- the rules -----------------------------------------------------------------------------
def below() -> list[str]:
    return [m for m in MODULES if not is_front(m)]


def takes_or_stores_alloc(module: str) -> list[str]:
    found = []
    for node in ast.walk(TREES[module]):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.arg) and node.arg in ("alloc", "allocator"):
            found.append(f"{module}:{line}: parameter {node.arg!r}")
        elif (isinstance(node, ast.Attribute) and node.attr in ("alloc", "_alloc")
              and isinstance(node.value, ast.Name) and node.value.id == "self"):
            found.append(f"{module}:{line}: self.{node.attr}")
        elif isinstance(node, ast.Name) and node.id == "HybridAllocator":
            found.append(f"{module}:{line}: HybridAllocator")
    return found


def imports_up(module: str) -> list[str]:
    found = []
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.ImportFrom):
            src = _absolute(module, node)
            names = [f"{src}.{a.name}" if f"{src}.{a.name}" in MODULES else src
                     for a in node.names]
            found += [f"{module}:{node.lineno}: imports {n}" for n in names
                      if is_front(n) and n != "graphalloc"]
    return found


def test_nothing_below_the_allocator_takes_or_stores_it():
    found = [f for m in below() for f in takes_or_stores_alloc(m)]
    assert not found, "below the allocator, the allocator is taken or stored:\n" + "\n".join(
        found)


def test_nothing_below_the_allocator_imports_the_floor_above():
    found = [f for m in below() for f in imports_up(m)]
    assert not found, "below the allocator, a module imports the front-end floor:\n" + (
        "\n".join(found))


def test_a_seam_reaches_the_kernels():
    for module, cls, method in SEAMS:
        seen = walk(f"{module}:{cls}.{method}")
        kernels = sorted(f for f in seen if f.startswith("graphalloc.kernels."))
        assert kernels, f"{cls}.{method} reaches no kernel ({len(seen)} functions walked)"
        route = _route(seen, kernels[0])
        assert any(":StepPipeline." in f for f in route), route
        assert any(":StepKernels." in f for f in route), route


def test_the_checks_can_fail():
    """Each rule catches what it is for (a check that checks nothing is none)."""
    bad = ast.parse("from ..operations import step_of\n"
                    "class P:\n"
                    "    def __init__(self, alloc):\n"
                    "        self._alloc = alloc\n")
    TREES["graphalloc.plan._probe"] = bad
    MODULES["graphalloc.plan._probe"] = ROOT / "graphalloc" / "plan" / "_probe.py"
    try:
        assert len(takes_or_stores_alloc("graphalloc.plan._probe")) == 2
        assert imports_up("graphalloc.plan._probe")
    finally:
        del TREES["graphalloc.plan._probe"], MODULES["graphalloc.plan._probe"]
    # and the walk goes through the wiring: with the step kernels' binding cut, the step no
    # longer reaches a kernel
    cut = BINDINGS.pop("kernels")
    try:
        seen = walk("graphalloc.allocator:HybridAllocator.step")
        assert not [f for f in seen if f.startswith("graphalloc.kernels.")]
    finally:
        BINDINGS["kernels"] = cut


@pytest.mark.filterwarnings("ignore:executor='graph' on a CPU device")
def test_the_parts_satisfy_their_protocols():
    """What the allocator wires is what the protocols declare (each member present), for
    every executor kind and with the prefix cache's index as the reclaim policy."""
    import graphalloc as ga
    from graphalloc import parts as p

    cfg = ga.AllocatorConfig(page_size=4, num_full_pages=32, num_swa_pages=16, max_reqs=4,
                             max_context_len=64, model_window=8, max_handles=4)
    for executor in ("eager", "graph"):
        alloc = ga.HybridAllocator(cfg, executor=executor, prefix_cache=True,
                                   planner="numpy")
        parts, pipeline = alloc.parts, alloc.pipeline
        assert isinstance(parts, p.DeviceParts)
        assert isinstance(parts.ledger, p.LedgerPart)
        assert isinstance(parts.ring, p.RingPart)
        assert isinstance(parts.kernels, p.KernelsPart)
        assert isinstance(alloc.executor, p.ExecutorPart)
        assert alloc.executor.parts is parts and pipeline.parts is parts
        assert isinstance(pipeline, p.PipelinePart) and pipeline.masks is None
        with alloc.free_group():  # the open block is the pipeline's masks while it is open
            assert isinstance(pipeline.masks, p.GroupMasks) and pipeline.masks is alloc.group
        assert pipeline.masks is None
        assert pipeline.reclaim is alloc.prefix_cache.index
        assert isinstance(pipeline.reclaim, p.ReclaimPolicy)
        # the allocator is not a part: nothing below could be handed it by mistake
        assert not isinstance(alloc, p.DeviceParts)
    twin = ga.HybridAllocator(cfg, planner="auto").pipeline.compiled
    if twin is not None:
        assert isinstance(twin, p.PlannerPart)
    # and the check can fail: an object lacking a member is not the part
    assert not isinstance(object(), p.ReclaimPolicy)
