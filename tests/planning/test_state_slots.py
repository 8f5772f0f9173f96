"""Recurrent-state slots (issue 25) against the pure-Python model (tests/lib/model.py).

A hypothesis state machine extends the model-vs-allocator machine
(tests/planning/test_model_vs_allocator.py: admits, admits on handles, take_handle, drop_handle,
drop_handle_swa, extends, decodes with and without lookahead, commits, trims, releases,
window evictions, frontier advances, combined steps, free groups) with state slots and
rules of its own: combined Steps of every kind planned with ``plan()`` and run with
``run()`` (their ``PlannedStep.state_copies`` against the model's copies), the same Steps
through ``fits()`` / ``try_step()`` (a slot shortage is back-pressure, ``None`` / False)
and through ``scheduler_step()`` blocks, speculative round trips of one request. Planners:
numpy (ps1_numpy), the compiled twin (ps2_auto's "auto", and planner="compiled"); backends:
Torch, and Triton through the interpreter (a few short examples).

Two state tensors are registered (slots on dimension 0 and on dimension 1). The test
plays the network: after every step it writes a fresh marker into each slot the model
says the network writes (a plain admit's new slot, a plain decode's or extend's slot
updated in place, each speculative token's slot), so every logical state has a unique
value and the copies the allocator makes (a snapshot taken, a snapshot restored) are
checked end to end, right after the step and before the next writes.

After every operation: each live request's slot (``req_to_state``), each handle's
snapshot (``handle_to_state``), the newest speculative step's slots
(``spec_state[r, :1 + k]``), the free count and the free queue in order from its head,
what every slot 1..S of both tensors holds, ``audit()`` empty and ``check_integrity()``.
A refused operation must raise the model's typed error (and, for a state rule, its
refusal code) with the snapshot, the stats and both tensors unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_same_snapshot
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule, run_state_machine_as_test
from model import (
    BATCH,
    CAPACITY,
    STATE_ADMIT,
    STATE_READ,
    STATE_SHORT,
    STATE_SPEC,
    STATE_TAKE,
    STATE_TRIM,
    Model,
    Violation,
)
from test_model_vs_allocator import AllocatorMachine, FlakyExecutor, expected_error

from graphalloc import AllocatorConfig, HybridAllocator
from graphalloc import errors as E
from graphalloc.plan.refusals import RefusalCode

STATE_CODES = {STATE_ADMIT: RefusalCode.STATE_SHARE_NOT_AT_SNAPSHOT,
               STATE_TAKE: RefusalCode.STATE_TAKE_NOT_AT_COMMITTED,
               STATE_TRIM: RefusalCode.STATE_TRIM_BELOW_COMMITTED,
               STATE_SHORT: RefusalCode.STATE_SLOTS_SHORT,
               STATE_SPEC: RefusalCode.STATE_SPEC_OVER_SHAPE,
               STATE_READ: RefusalCode.STATE_COPY_SOURCE_BUSY}
# Kinds a step's refusal can have for lack of room (try_step -> None, fits -> False): in a
# Step, the model's CAPACITY is a page shortage, BATCH the frozen shape and STATE_SPEC the
# frozen max_spec_tokens.
SHORTAGE = frozenset({CAPACITY, BATCH, STATE_SHORT, STATE_SPEC, STATE_READ})

# Pool mode with handles, small pages, few slots (the queue runs short often), K small
# enough that the base machine's lookaheads (k <= 3) cross it. max_release_rows exceeds
# every page a free can give back: a free is never split over several steps here (splits:
# test_a_free_split_over_steps_writes_the_state_table).
CONFIGS = {
    "ps1_numpy": dict(page_size=1, num_full_pages=14, num_swa_pages=10, max_reqs=4,
                      max_context_len=12, sliding_window=3, index_dtype=torch.int64,
                      max_handles=3, num_state_slots=7, max_spec_tokens=3, fused_step=False,
                      planner="numpy", max_release_rows=64),
    "ps2_auto": dict(page_size=2, num_full_pages=12, num_swa_pages=8, max_reqs=3,
                     max_context_len=14, sliding_window=5, index_dtype=torch.int32,
                     max_alloc_rows=2, max_tokens_per_alloc_row=6, max_step_tokens=8,
                     max_release_rows=64, max_handles=2, num_state_slots=5, fused_step=True,
                     planner="auto"),
}

TRITON = dict(page_size=1, num_full_pages=8, num_swa_pages=6, max_reqs=3,
              max_context_len=8, sliding_window=2, index_dtype=torch.int32, max_handles=2,
              max_release_rows=64, num_state_slots=4, max_spec_tokens=3, fused_step=True,
              planner="numpy", backend="triton")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def build(config: dict, executor="eager"):
    """(cfg, allocator, state tensors) for a machine config: t0 ``[S + 1, 2]`` float32 with
    slots on dimension 0, t1 ``[3, S + 1]`` int64 with slots on dimension 1, on the config's
    device (the CUDA run of the core suite moves "cpu" configs to the GPU)."""
    config = dict(config)
    fused, planner = config.pop("fused_step"), config.pop("planner")
    cfg = AllocatorConfig(device="cpu", **{"backend": "torch", **config})
    n = cfg.num_state_slots + 1
    t0 = torch.zeros(n, 2, dtype=torch.float32, device=cfg.device)
    t1 = torch.zeros(3, n, dtype=torch.int64, device=cfg.device)
    alloc = HybridAllocator(cfg, fused_step=fused, planner=planner, executor=executor,
                            state_tensors=[t0, (t1, 1)])
    return cfg, alloc, (t0, t1)


def write_marker(tensors, slot: int, marker: int) -> None:
    t0, t1 = tensors
    t0[slot] = torch.tensor([marker, marker + 0.5], device=t0.device)
    t1[:, slot] = torch.tensor([marker, -marker, 7 * marker], device=t1.device)


def assert_contents(tensors, content: list) -> None:
    """Slots 1..S of both tensors hold the markers ``content`` says (0: never written)."""
    t0, t1 = (t.cpu() for t in tensors)
    c = torch.tensor(content[1:], dtype=torch.int64)
    want0 = torch.stack([c.float(), c.float() + 0.5 * (c != 0)], dim=1)
    want1 = torch.stack([c, -c, 7 * c])
    got = [round(float(x)) for x in t0[1:, 0]]
    assert torch.equal(t0[1:], want0), f"state tensor 0: slots hold {got}, model {content[1:]}"
    assert torch.equal(t1[:, 1:], want1), f"state tensor 1: {t1[0, 1:].tolist()} vs {content[1:]}"


def check_refusal(kinds, error) -> None:
    """A refusal of state kinds only carries one of their codes; one without state kinds
    carries no state code."""
    refusal = getattr(error, "refusal", None)
    if refusal is None:
        return
    codes = {STATE_CODES[k] for k in kinds if k in STATE_CODES}
    if codes and all(k in STATE_CODES for k in kinds):
        assert refusal[0] in codes, (refusal, sorted(kinds))
    elif not codes:
        assert refusal[0] not in STATE_CODES.values(), (refusal, sorted(kinds))


def assert_states(alloc, model: Model, tensors) -> None:
    """Every state view of the allocator equals the model's."""
    assert alloc.req_to_state.tolist() == model.req_to_state()
    assert alloc.handle_to_state.tolist() == model.handle_to_state()
    for r, q in model.reqs.items():
        if q.spec_slots:
            newest = q.spec_slots[-1]
            assert alloc.spec_state[r, :len(newest)].tolist() == newest, (r, q.spec_slots)
    assert alloc.n_free("state") == len(model.state_q)
    ring, states = alloc.ledger.state_ring, alloc.ledger.states
    assert int(states.n_free) == len(model.state_q)
    head = int(states.head)
    assert [int(ring[(head + i) % len(ring)]) for i in range(len(model.state_q))] == list(
        model.state_q)
    assert_contents(tensors, model.state_content)


class StateMachine(AllocatorMachine):
    """The model-vs-allocator machine with state slots, markers and state rules."""

    CONFIG: dict = {}

    def __init__(self):
        super(AllocatorMachine, self).__init__()  # RuleBasedStateMachine's
        self.executor = FlakyExecutor()  # the base machine's launch_fails rule sets it
        self.cfg, self.alloc, self.tensors = build(self.CONFIG, self.executor)
        self.model = Model.from_config(self.cfg)
        assert self.model.n_state == self.cfg.num_state_slots
        assert self.model.max_spec == self.cfg.max_spec_tokens
        self.ps = self.cfg.page_size
        self.prev_frontier: dict[int, int] = {}
        self.marker = 0

    # ---- the network's writes --------------------------------------------------------------
    def write_markers(self) -> None:
        """Write a fresh marker into every slot the network writes after the steps run."""
        for slot in self.model.state_writes:
            self.marker += 1
            write_marker(self.tensors, slot, self.marker)
            self.model.write_state(slot, self.marker)
        self.model.state_writes = []

    def apply(self, model_op, alloc_op):
        before = self.alloc.snapshot()
        stats_before = self.alloc.stats()
        tensors_before = [t.clone() for t in self.tensors]
        try:
            expected = model_op(self.model)
        except Violation as v:
            with pytest.raises(expected_error(v.kinds)) as info:
                alloc_op(self.alloc)
            check_refusal(v.kinds, info.value)
            assert_same_snapshot(before, self.alloc.snapshot())
            assert self.alloc.stats() == stats_before
            for t, old in zip(self.tensors, tensors_before, strict=True):
                assert torch.equal(t, old), "a refused step wrote a state tensor"
            return None, None
        got = alloc_op(self.alloc)
        assert_contents(self.tensors, self.model.state_content)  # the copies, before writes
        self.write_markers()
        return expected, got

    def handle_tokens(self, row, h_code) -> int:
        """Mostly the committed length (the only length a state snapshot exists at), else
        the base machine's lengths (whole pages, off a boundary, 0, past the end)."""
        q = self.model.reqs.get(row) if isinstance(row, int) else None
        if q is not None and h_code[0] == 0 and h_code[1] % 3:
            return q.committed
        return super().handle_tokens(row, h_code)

    # ---- one combined Step, drawn ----------------------------------------------------------
    def draw_step(self, data, conflict: bool = False) -> dict:
        """A Step of every kind, mostly valid, aimed at the state rules: a take at the
        committed length (sometimes a page off), the release or commit of the taken row, a
        commit of any accepted count, a trim into the speculative tail (sometimes below C),
        handle drops and tombstones, plain admits, admits on a handle (sometimes short of
        its length), decodes with a lookahead (one k, or one per row, -1 plain), extends.
        ``conflict``: mostly a take whose row the step then releases or commits, and an
        admit on another handle (code 45 when its slot is the one the take reads)."""
        m, ps, draw = self.model, self.ps, data.draw
        live = sorted(m.reqs)
        kw: dict = {}
        pick = lambda rows: draw(st.sampled_from(rows))  # noqa: E731
        chance = lambda p: draw(st.integers(0, 99)) < (100 if conflict and p >= 30 else p)  # noqa: E731
        free_h = [h for h in range(m.max_handles) if h not in m.handles]
        whole = [r for r in live if m.reqs[r].committed and not m.reqs[r].committed % ps]
        taken = []
        if free_h and live and (whole or chance(10)) and chance(40):
            r = pick(whole or live)
            off = draw(st.sampled_from([0] * (12 if conflict else 4) + [-ps, ps]))
            kw["take"] = ([free_h[0]], [r], [m.reqs[r].committed + off])
            taken = [r]
        if taken and m.reqs[taken[0]].spec and chance(30 if conflict else 0):
            kw["commit"] = (taken, [draw(st.integers(1, m.reqs[taken[0]].spec[0]))])
        release = [] if "commit" in kw else (
            taken if taken and chance(30) else [pick(live)] if live and chance(20) else [])
        if release:
            kw["release"] = release
        rest = [r for r in live if r not in release]
        spec = [r for r in rest if m.reqs[r].spec and r not in taken]
        commit_rows = []
        if "commit" in kw:
            commit_rows = taken
        elif spec and chance(50):
            commit_rows = draw(st.lists(st.sampled_from(spec), min_size=1, max_size=2,
                                        unique=True))
            n = [draw(st.integers(0, m.reqs[r].spec[0] + (1 if chance(5) else 0)))
                 for r in commit_rows]
            kw["commit"] = (commit_rows, n)
        trim_rows = [r for r in spec if r not in commit_rows]
        if trim_rows and chance(30):
            r = pick(trim_rows)
            q = m.reqs[r]
            target = q.committed + draw(st.integers(0, sum(q.spec)))
            kw["trim"] = ([r], [q.committed - 1 if chance(20) else target])
        if chance(15):
            kw["evict_all"] = True
        dropped = []
        if m.handles and chance(25) and not conflict:
            h = pick(sorted(m.handles))
            kw["drop_swa" if chance(30) else "drop"] = [h]
            dropped = [h]
        free_rows = [r for r in range(self.cfg.max_reqs) if r not in m.reqs]
        n_plain = draw(st.integers(0, min(2, len(free_rows))))
        if conflict and taken and free_rows:  # the admit on a handle pops the pushed slot
            n_plain = max(0, min(len(m.state_q) - 1, len(free_rows) - 1))
        plain, free_rows = free_rows[:n_plain], free_rows[n_plain:]
        if plain:
            kw["admit"] = plain
        handles = [h for h in sorted(m.handles) if h not in dropped]
        admitted_on = []
        if handles and free_rows and (chance(60) or conflict):
            h = pick(handles)
            n = None if chance(80) else m.handles[h].n_tokens - ps
            admitted_on = free_rows[:1]
            kw["admit_on"] = (admitted_on, [h], [-1 if n is None else n])
        allocating = rest + (plain if chance(50) else [])
        decode = draw(st.lists(st.sampled_from(allocating), unique=True, max_size=3)) \
            if allocating else []
        if decode:
            kw["decode"] = decode
            look = draw(st.sampled_from(["plain", "k", "rows", "rows"]))
            if look == "k":
                kw["lookahead"] = draw(st.integers(0, 3))
            elif look == "rows":
                kw["lookahead"] = [draw(st.integers(-1, 3)) for _ in decode]
        ext = [r for r in allocating + admitted_on if r not in decode]
        if ext and chance(40):
            rows = draw(st.lists(st.sampled_from(ext), min_size=1, max_size=2, unique=True))
            kw["extend"] = (rows, [draw(st.integers(0, 2 * ps)) for _ in rows])
        return kw

    @staticmethod
    def model_kwargs(kw: dict) -> dict:
        """The model's ``step()`` keywords of a Step's (its names differ for two kinds)."""
        out = dict(kw)
        if "admit_on" in out:
            rows, hs, n = out["admit_on"]
            out["admit_on"] = (rows, hs, [None if x == -1 else x for x in n])
        return out

    # ---- rules -----------------------------------------------------------------------------
    @rule(data=st.data(), n_steps=st.integers(1, 3))
    def planned_step(self, data, n_steps):
        """plan() then run(): the step's copies (takes' first, then admits on handles);
        a few steps in a row, every state view checked between them."""
        for i in range(n_steps):
            if i:
                self.check_all()
            self.run_planned(self.draw_step(data))

    @rule(data=st.data())
    def planned_conflict(self, data):
        """A take, the release or commit of its row, an admit on another handle: first a
        step that frees a row (a release) or takes a handle where none is, then that step
        (code 45 when the admit's slot is the one the take reads)."""
        m, ps = self.model, self.ps
        whole = [r for r in sorted(m.reqs) if m.reqs[r].committed
                 and not m.reqs[r].committed % ps]
        if not whole:
            return
        if not m.handles and len(m.handles) < m.max_handles:
            r = data.draw(st.sampled_from(whole))
            self.run_planned({"take": ([0], [r], [m.reqs[r].committed])})
        free_rows = [r for r in range(self.cfg.max_reqs) if r not in m.reqs]
        if not free_rows and len(m.reqs) > 1:
            self.run_planned({"release": [data.draw(st.sampled_from(sorted(m.reqs)))]})
        self.check_all()
        self.run_planned(self.draw_step(data, conflict=True))

    @rule(data=st.data(), n_steps=st.integers(1, 3))
    def planned_step_again(self, data, n_steps):  # (rules are drawn uniformly: weight)
        self.planned_step(data, n_steps)

    @rule(data=st.data())
    def planned_speculation(self, data):
        """One request's speculative round trip, a step each: a decode with lookahead k
        (1 + k slots), maybe a second one in flight, then a commit of any accepted count,
        a trim into the tail (or below C), or the release."""
        m, draw = self.model, data.draw
        rows = [r for r in sorted(m.reqs) if len(m.reqs[r].spec) < 2]
        if not rows:
            return
        r = draw(st.sampled_from(rows))
        ks = [draw(st.integers(0, self.cfg.max_spec_tokens - 1))
              for _ in range(draw(st.integers(1, 2 - len(m.reqs[r].spec))))]
        for k in ks:
            self.run_planned({"decode": [r], "lookahead": k})
            self.check_all()
        q = m.reqs.get(r)
        if q is None or not q.spec:
            return
        end = draw(st.sampled_from(["commit", "commit", "trim", "release"]))
        if end == "commit":
            self.run_planned({"commit": ([r], [draw(st.integers(0, q.spec[0]))])})
        elif end == "trim":
            target = q.committed + draw(st.integers(-1, sum(q.spec)))
            self.run_planned({"trim": ([r], [target])})
        else:
            self.run_planned({"release": [r]})

    def run_planned(self, kw: dict) -> None:
        planned = []

        def run(a):
            p = a.plan(**kw)
            planned.append(p)
            return a.run(p)
        self.compare_result(*self.apply(lambda m: m.step(**self.model_kwargs(kw)), run))
        if planned and planned[0].submitted:
            copies = planned[0].state_copies
            got = [] if copies is None else copies.tolist()
            if copies is not None:
                assert copies.dtype == np.int64 and copies.shape == (len(got), 2), copies
            assert got == [list(c) for c in self.model.step_copies], kw

    @rule(data=st.data(), conflict=st.booleans())
    def try_step_and_fits(self, data, conflict):
        """fits() is a dry run; try_step() returns None for lack of room (pages, slots, a
        copy reading its destination, the frozen shape), nothing changed; other refusals
        raise as step() would."""
        kw = self.draw_step(data, conflict)
        model_step = lambda m: m.step(**self.model_kwargs(kw))  # noqa: E731
        try:
            self.model.clone().step(**self.model_kwargs(kw))
            kinds = None
        except Violation as v:
            kinds = v.kinds
        if kinds is not None and kinds.isdisjoint(SHORTAGE):  # not for lack of room: raise
            self.apply(model_step, lambda a: a.fits(**kw))
            self.apply(model_step, lambda a: a.try_step(**kw))
            return
        before = self.alloc.snapshot()
        if kinds is None:
            assert self.alloc.fits(**kw) is True
            assert_same_snapshot(before, self.alloc.snapshot())
            self.compare_result(*self.apply(model_step, lambda a: a.try_step(**kw)))
            return
        for call in (self.alloc.fits, self.alloc.try_step):
            try:
                answer = call(**kw)
            except expected_error(kinds) as exc:  # a shortage, or another rule of the set
                assert not kinds <= SHORTAGE, (kinds, exc)
            else:
                assert answer in (False, None), (call, kinds)
            assert_same_snapshot(before, self.alloc.snapshot())

    @rule(data=st.data(), conflict=st.booleans())
    def scheduler_block_states(self, data, conflict):
        """The same Step recorded in a scheduler_step() block, one call per kind, in an
        order of their own (the block runs them in the step's order)."""
        kw = self.draw_step(data, conflict)
        calls = []
        if "take" in kw:
            calls.append(lambda it: it.take_handle(kw["take"][1][0], kw["take"][2][0]))
        for kind in ("release", "commit", "trim"):
            if kind in kw:
                calls.append(lambda it, kind=kind: getattr(it, kind)(*(
                    (kw[kind],) if kind == "release" else kw[kind])))
        if kw.get("evict_all"):
            calls.append(lambda it: it.evict_all())
        for kind in ("drop", "drop_swa"):
            if kind in kw:
                calls.append(lambda it, kind=kind: getattr(it, f"{kind}_handle"
                                                          if kind == "drop" else
                                                          "drop_handle_swa")(kw[kind][0]))
        if "decode" in kw:
            calls.append(lambda it: it.decode(kw["decode"], lookahead=kw.get("lookahead")))
        if "extend" in kw:
            calls.append(lambda it: it.extend(*kw["extend"]))
        order = data.draw(st.permutations(range(len(calls))))
        admits = [None] * len(kw.get("admit", ()))
        if "admit_on" in kw:
            _, hs, n = kw["admit_on"]
            admits.append((hs[0], None if n[0] == -1 else n[0]))

        def block(a):
            with a.scheduler_step() as it:
                for i in order:
                    calls[i](it)
                for adm in admits:  # the rows reserved are the Step's, in this order
                    it.admit() if adm is None else it.admit(handle=adm[0], n_tokens=adm[1])
        self.apply(lambda m: m.step(**self.model_kwargs(kw)), block)

    def check_all(self) -> None:
        """Both invariants, between the steps of one rule."""
        self.matches_model()
        self.states_match()

    @invariant()
    def states_match(self):
        assert_states(self.alloc, self.model, self.tensors)
        assert self.alloc.audit() == []
        self.write_markers()  # after a base rule that stepped outside apply()


def _make(name: str, config: dict, examples: int, steps: int):
    machine = type(f"StateMachine_{name}", (StateMachine,), {"CONFIG": config})
    case = machine.TestCase
    case.settings = settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                             suppress_health_check=list(HealthCheck), database=None,
                             derandomize=True)
    return case


for _name, _config in CONFIGS.items():
    globals()[f"TestStateSlots_{_name}"] = _make(_name, _config, 100, 30)
TestStateSlots_triton = _make("triton", TRITON, 4, 15)


def test_compiled_planner_with_states():
    """The machine with planner="compiled": the C twin plans every step, state slots
    included (ps2_auto's "auto" picks it too; ps1_numpy is the numpy reference). Skipped
    where the extension was not built (ConfigError)."""
    config = dict(CONFIGS["ps1_numpy"], planner="compiled")
    try:
        cfg, a, tensors = build(config)
    except E.ConfigError as exc:
        pytest.skip(f"the compiled planner is not available: {exc}")
    r = a.admit()
    a.alloc_extend([r], [2])
    a.alloc_decode([r], lookahead=1)
    a.admit(handle=a.take_handle(r, 2))
    assert a.pipeline.compiled.n_planned == a.pipeline.n_planned == 5  # no numpy fallback
    machine = type("StateMachine_compiled", (StateMachine,), {"CONFIG": config})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=60, stateful_step_count=30, deadline=None, database=None,
        suppress_health_check=list(HealthCheck), derandomize=True))


# ---- directed -------------------------------------------------------------------------------
class Scripted(StateMachine):
    """The machine driven by a fixed script (model against allocator, every check)."""

    CONFIG = CONFIGS["ps1_numpy"]


def test_model_and_allocator_agree_on_a_copy_clash():
    """Scripted through the machine: a take of r1 (reads slot 2, pops 7, the last free
    slot), the release of r1 (pushes 2) and an admit on h0 in one step: the admit's slot
    would be 2, which the take reads -> refused (45) by both; without the admit the step
    runs, and the admit runs in the next step, copying h0's snapshot (slot 3) into slot 2."""
    m = Scripted()
    m.run_planned({"admit": [0, 1]})  # slots 1, 2
    m.run_planned({"extend": ([0, 1], [2, 3])})
    m.run_planned({"take": ([0], [0], [2])})  # h0: slot 3, a copy of slot 1
    m.run_planned({"decode": [0], "lookahead": 2})  # slots 4, 5, 6; 7 is free
    m.check_all()
    clash = {"take": ([1], [1], [3]), "release": [1], "admit_on": ([2], [0], [-1])}
    with pytest.raises(Violation) as info:
        m.model.clone().step(**m.model_kwargs(clash))
    assert info.value.kinds == {STATE_READ}
    m.run_planned(clash)  # refused by both, nothing changed
    m.check_all()
    m.run_planned({"take": ([1], [1], [3]), "release": [1]})
    m.run_planned({"admit_on": ([1], [0], [-1])})
    assert m.model.step_copies == [(3, 2)] and m.alloc.req_to_state[1] == 2
    m.check_all()


def small(**over):
    config = dict(page_size=1, num_full_pages=16, num_swa_pages=16, max_reqs=4,
                  max_context_len=12, sliding_window=4, max_handles=3, num_state_slots=4,
                  max_spec_tokens=3, fused_step=False, planner="numpy")
    config.update(over)
    return build(config)


def free_queue(alloc) -> list[int]:
    ring, states = alloc.ledger.state_ring, alloc.ledger.states
    return [int(ring[(int(states.head) + i) % len(ring)]) for i in range(int(states.n_free))]


def test_a_copy_into_a_slot_the_step_reads_is_refused_then_runs_next_step():
    """take h1 of r1 (reads slot 2, pops 4), release r1 (pushes 2), admit on h0: the only
    free slot is 2, which the take reads -> code 45, a shortage; next step slot 2 is free
    and the admit runs."""
    cfg, a, tensors = small()
    r0, r1 = a.admit(), a.admit()
    a.alloc_extend([r0, r1], [2, 3])
    write_marker(tensors, 1, 11)
    write_marker(tensors, 2, 22)
    h0 = a.take_handle(r0, 2)
    assert (a.req_to_state.tolist()[:2], a.handle_to_state.tolist()) == ([1, 2], [3, 0, 0])
    step = dict(take=([1], [r1], [3]), release=[r1], admit_on=([2], [h0], None))
    before = a.snapshot()
    with pytest.raises(E.CapacityError) as info:
        a.step(**step)
    assert info.value.refusal.code is RefusalCode.STATE_COPY_SOURCE_BUSY
    assert a.fits(**step) is False and a.try_step(**step) is None
    assert_same_snapshot(before, a.snapshot())
    a.step(take=([1], [r1], [3]), release=[r1])
    assert a.handle_to_state.tolist() == [3, 4, 0] and free_queue(a) == [2]
    r2 = a.admit(handle=h0)
    assert a.req_to_state.tolist()[r2] == 2
    assert_contents(tensors, [0, 11, 11, 11, 22])  # slot 2 now holds h0's snapshot of r0
    assert a.audit() == []


def test_a_take_reads_the_state_as_the_step_began():
    """take and commit of one request in one step: the snapshot is the state after the
    committed tokens when the step began (slot 1), not the accepted token's (slot 2)."""
    cfg, a, tensors = small(num_state_slots=6)
    r = a.admit()  # slot 1
    a.alloc_extend([r], [2])
    a.alloc_decode([r], lookahead=1)  # slots 2, 3
    for slot, marker in ((1, 10), (2, 20), (3, 30)):
        write_marker(tensors, slot, marker)
    p = a.plan(take=([0], [r], [2]), commit=([r], [1]))
    assert p.state_copies.tolist() == [[1, 4]]
    a.run(p)
    assert (a.req_to_state[r], a.handle_to_state[0]) == (2, 4)
    assert free_queue(a) == [5, 6, 1, 3]
    assert_contents(tensors, [0, 10, 20, 30, 10, 0, 0])
    assert a.audit() == []


def test_admit_on_a_handle_taken_in_the_same_step_is_refused():
    """The rule 'an admit on a handle taken in the same step copies from the take's source'
    is unreachable: the page rules refuse using a handle written in the step (code 6)."""
    cfg, a, tensors = small()
    r0 = a.admit()
    a.alloc_extend([r0], [2])
    before = a.snapshot()
    with pytest.raises(E.OverlapError) as info:
        a.step(take=([0], [r0], [2]), admit_on=([1], [0], None))
    assert info.value.refusal[0] == RefusalCode.HANDLE_WRITTEN_THIS_STEP
    assert_same_snapshot(before, a.snapshot())


def test_commit_keeps_the_accepted_tokens_state_and_pushes_the_rest_in_order():
    cfg, a, tensors = small(num_state_slots=6)
    r = a.admit()  # slot 1
    a.alloc_extend([r], [2])
    a.alloc_decode([r], lookahead=2)  # slots 2, 3, 4
    assert a.spec_state[r, :3].tolist() == [2, 3, 4] and free_queue(a) == [5, 6]
    for slot, marker in ((2, 20), (3, 30), (4, 40)):
        write_marker(tensors, slot, marker)
    p = a.plan(commit=([r], [2]))
    assert p.state_copies is None or p.state_copies.tolist() == []
    a.run(p)
    assert a.req_to_state[r] == 3 and free_queue(a) == [5, 6, 1, 2, 4]
    a.alloc_decode([r], lookahead=1)  # slots 5, 6
    a.commit([r], [0])  # all rejected: the request keeps slot 3
    assert a.req_to_state[r] == 3 and free_queue(a) == [1, 2, 4, 5, 6]
    a.alloc_decode([r], lookahead=1)  # slots 1, 2
    a.alloc_decode([r], lookahead=0)  # slot 4: two steps in flight
    assert a.spec_state[r, :1].tolist() == [4]
    a.trim([r], [a.committed_len(r) + 1])  # keeps the first token of the older step
    assert free_queue(a) == [5, 6, 2, 4]
    a.release([r])  # its slot, then the speculative slot left
    assert free_queue(a) == [5, 6, 2, 4, 3, 1] and a.n_free("state") == 6
    assert a.audit() == []


@pytest.mark.parametrize("case", ["admit_short_of_handle", "take_off_committed",
                                  "trim_below_committed", "spec_too_long", "no_free_slot"])
def test_state_refusals_change_nothing(case):
    cfg, a, tensors = small(num_state_slots=8)
    r0 = a.admit()
    a.alloc_extend([r0], [3])
    h = a.take_handle(r0, 3)
    a.alloc_decode([r0], lookahead=1)
    code, step = {
        "admit_short_of_handle": (RefusalCode.STATE_SHARE_NOT_AT_SNAPSHOT,
                                  dict(admit_on=([1], [h], [2]))),
        "take_off_committed": (RefusalCode.STATE_TAKE_NOT_AT_COMMITTED,
                               dict(take=([1], [r0], [2]))),
        "trim_below_committed": (RefusalCode.STATE_TRIM_BELOW_COMMITTED, dict(trim=([r0], [2]))),
        "spec_too_long": (RefusalCode.STATE_SPEC_OVER_SHAPE,
                          dict(commit=([r0], [1]), decode=[r0], lookahead=3)),
        # slots 1 (r0), 2 (h), 3 and 4 (spec) held; the admits pop 5, 6; 7, 8 left
        "no_free_slot": (RefusalCode.STATE_SLOTS_SHORT,
                         dict(admit=[1, 2], decode=[r0], lookahead=2)),
    }[case]
    before, t_before = a.snapshot(), [t.clone() for t in tensors]
    with pytest.raises(E.ContractError) as info:
        a.step(**step)
    assert info.value.refusal[0] == code
    assert_same_snapshot(before, a.snapshot())
    assert all(torch.equal(t, b) for t, b in zip(tensors, t_before, strict=True))
    if code.shortage:  # a shortage (a pool, the frozen max_spec_tokens): back-pressure
        assert a.try_step(**step) is None and a.fits(**step) is False
    else:
        with pytest.raises(type(info.value)):
            a.try_step(**step)
    assert_same_snapshot(before, a.snapshot())


def test_triton_backend_copies_snapshots_end_to_end():
    """The Triton kernels (through the interpreter) copy a snapshot out and back in, in both
    registered tensors."""
    cfg, a, tensors = build(dict(TRITON))
    r0 = a.admit()
    a.alloc_extend([r0], [2])
    write_marker(tensors, 1, 5)
    h = a.take_handle(r0, 2)
    write_marker(tensors, 1, 6)  # the request moves on; the snapshot keeps 5
    r1 = a.admit(handle=h)
    assert (a.req_to_state.tolist(), a.handle_to_state.tolist()) == ([1, 3, 0], [2, 0])
    assert_contents(tensors, [0, 6, 5, 5, 0])
    del r1
    assert a.audit() == []
    a.check_integrity()


def test_markers_are_distinct_per_slot():
    """The marker encoding tells every slot apart in both tensors (the checks rely on it)."""
    cfg, a, tensors = small()
    for slot in range(1, 5):
        write_marker(tensors, slot, slot * 3)
    assert_contents(tensors, [0, 3, 6, 9, 12])
    with pytest.raises(AssertionError):
        assert_contents(tensors, [0, 3, 6, 12, 9])
    assert np.unique(tensors[1][0, 1:].numpy()).size == 4


def test_trim_of_the_newest_speculative_step_updates_spec_state():
    """Rule: spec_state[r, :1 + k] shows the newest speculative step in flight. Two steps of
    one token each (slots 2, then 3), a trim to C + 1 cuts the newer one: the older step
    (slot 2) is the newest now."""
    cfg, a, tensors = small()
    r = a.admit()  # slot 1
    a.alloc_decode([r], lookahead=0)  # slot 2
    a.alloc_decode([r], lookahead=0)  # slot 3
    a.trim([r], [1])  # slot 3 back
    assert free_queue(a) == [4, 3]
    assert a.audit() == []
    assert a.spec_state[r, :1].tolist() == [2]


@pytest.mark.parametrize("what", ["release", "drop_handle"])
def test_a_free_split_over_steps_writes_the_state_table(what):
    """Three requests of 3 pages (ps 1, max_pages_per_row 2: two release rows each): their
    release, or the drop of three handles on them, needs 6 rows, max_release_rows is 5."""
    cfg, a, tensors = small(num_state_slots=6, max_reqs=3, max_context_len=8,
                            sliding_window=8, max_release_rows=5, max_pages_per_row=2)
    rows = [a.admit() for _ in range(3)]  # slots 1, 2, 3
    a.alloc_extend(rows, [3, 3, 3])
    if what == "drop_handle":
        hs = [a.take_handle(r, 3) for r in rows]  # slots 4, 5, 6
        a.release(rows)  # the handles keep the pages: no release rows
        assert a.audit() == []
        with a.free_group():
            for h in hs:
                a.drop_handle(h)
        assert a.handle_to_state.tolist() == [0, 0, 0]
    else:
        a.release(rows)
    assert a.req_to_state.tolist() == [0, 0, 0] and a.n_free("state") == 6
    assert a.audit() == []
