"""Contract round 4 (issue 35, items 6 and 7): one regression test per defect, each written
from the rule it broke, each failing before its fix.

Item 6, inputs refused with their typed error before anything changes:
 * ``evict=`` rows beside ``evict_all=True`` are checked as without it;
 * malformed ``state_tensors`` entries are ``ConfigError``s, not raw Python errors;
 * state tensors' dtypes are checked at the constructor against what the backend copies
   (and every dtype a backend accepts is copied bit for bit).

Item 7, the docs and the behaviour agree:
 * an admit on a handle taken in the same step is refused (``OverlapError``);
 * ``try_step`` / ``fits``: ``None`` / ``False`` for every frozen-shape shortage;
 * a 0-token extend row has no attention lane, and later lanes move up;
 * ``handle_info`` inside a free group: committed holdings, frees added to the block's;
 * ``spec_state[r, :1 + k]`` is the newest in-flight step's slots;
 * ``drop_handle`` takes one handle id, as ``admit(handle=)`` does;
 * ``Step(foo=1)`` is a ``ContractError``; absurd sizes are ``ConfigError``s.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import assert_same_snapshot

import graphalloc as ga
from graphalloc import errors as E
from graphalloc.attention.spec import PageTableSpec
from graphalloc.plan import compiled

PLANNERS = ["numpy", pytest.param("compiled", marks=pytest.mark.skipif(
    not compiled.AVAILABLE, reason="the compiled planner is not built"))]

CFG = dict(page_size=4, num_full_pages=32, num_swa_pages=32, max_reqs=4, max_context_len=64,
           model_window=7, max_handles=2)


def config(**kw) -> ga.AllocatorConfig:
    return ga.AllocatorConfig(**{**CFG, **kw})


def refused_unchanged(alloc, call, error):
    before = alloc.snapshot()
    with pytest.raises(error) as info:
        call()
    assert_same_snapshot(before, alloc.snapshot())
    return info.value


# ---- item 6 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("planner", PLANNERS)
@pytest.mark.parametrize("case", ["never_admitted", "released", "duplicate", "released_here"])
def test_evict_rows_beside_evict_all_are_checked_as_alone(planner, case):
    """Rule: ``evict=[row]`` alone refuses a row that is not live or named twice; with
    ``evict_all=True`` beside it the same row is refused the same way, nothing changed."""
    a = ga.HybridAllocator(config(), planner=planner)
    r, s = a.admit(), a.admit()
    a.alloc_extend([r, s], [20, 20])
    gone = a.admit()
    a.release([gone])
    kw = {"never_admitted": dict(evict=[3]), "released": dict(evict=[gone]),
          "duplicate": dict(evict=[r, r]),
          "released_here": dict(release=[s], evict=[s])}[case]
    alone = refused_unchanged(a, lambda: a.step(**kw), E.ContractError)
    both = refused_unchanged(a, lambda: a.step(**kw, evict_all=True), E.ContractError)
    assert type(both) is type(alone) and type(alone) in (E.UnknownRequestError,
                                                          E.OverlapError)
    assert str(both) == str(alone)
    a.step(evict=[r], evict_all=True)  # a live row named beside evict_all: fine
    assert a.audit() == []


MALFORMED = [None, "x", 3, (), (None, 0), ("x", 0), [0, 0]]


@pytest.mark.parametrize("entry", [[e] for e in MALFORMED]
                         + [[(torch.zeros(4, 2),)], [(torch.zeros(4, 2), 0, 1)],
                            [(torch.zeros(4, 2), 0.0)], [(torch.zeros(4, 2), "0")],
                            [{0: torch.zeros(4, 2)}]],
                         ids=lambda e: type(e[0]).__name__ if e else "empty")
def test_malformed_state_tensor_entries_are_config_errors(entry):
    """Rule: a state_tensors entry is a tensor or a (tensor, slot_dim) pair; anything else is
    a ConfigError naming the entry (it raised TypeError / ValueError from unpacking)."""
    with pytest.raises(E.ConfigError, match=r"state_tensors\[0\]"):
        ga.HybridAllocator(config(num_state_slots=3), state_tensors=entry)


def _config(backend):
    return config(num_state_slots=3, max_spec_tokens=2, backend=backend)


def _build(backend, t):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return ga.HybridAllocator(_config(backend), state_tensors=[t])


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8,
          torch.uint8, torch.int64, torch.bool, torch.complex64, torch.complex128,
          torch.float8_e4m3fn, torch.uint16]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_state_dtypes_are_checked_at_the_constructor_and_copied_bit_for_bit(backend, dtype):
    """Rule: the constructor refuses (ConfigError) a state tensor the backend cannot copy;
    every dtype it accepts is copied exactly by a snapshot and its restore (complex64 with
    the Triton backend failed at every state copy mid-serving: LaunchError(KeyError))."""
    t = torch.zeros(4, 3, dtype=dtype, device=_config(backend).device)
    wide = t.element_size() > 8
    if backend == "triton" and wide:
        with pytest.raises(E.ConfigError, match="cannot copy"):
            _build(backend, t)
        return
    a = _build(backend, t)
    r = a.admit()
    a.alloc_extend([r], [4])
    src = int(a.req_to_state[r])
    pattern = (torch.arange(1, 3 * t.element_size() + 1, dtype=torch.uint8) * 37).to(t.device)
    t.view(torch.uint8)[src] = pattern if dtype != torch.bool else pattern % 2
    h = a.take_handle(r, 4)
    r2 = a.admit(handle=h)
    dst = int(a.req_to_state[r2])
    assert len({src, int(a.handle_to_state[h]), dst}) == 3
    assert torch.equal(t.view(torch.uint8)[dst], t.view(torch.uint8)[src])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_quantized_and_grad_state_tensors_are_refused(backend):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized tensors are deprecated
        q = torch.quantize_per_tensor(torch.zeros(4, 2), 1.0, 0, torch.quint8)
    with pytest.raises(E.ConfigError, match="cannot copy"):
        _build(backend, q)
    with pytest.raises(E.ConfigError, match="requires grad"):
        _build(backend, torch.zeros(4, 2, requires_grad=True))


# ---- item 7 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("planner", PLANNERS)
def test_an_admit_on_a_handle_taken_in_the_same_step_is_refused(planner):
    """Rule (state_slots.md, sharing.md): a handle taken in a step is used from the next
    step on; an admit on it in the same step is an OverlapError, nothing changed."""
    cfg = config(num_state_slots=8, max_spec_tokens=2)
    a = ga.HybridAllocator(cfg, planner=planner,
                           state_tensors=[torch.zeros(9, 2, device=cfg.device)])
    r = a.admit()
    a.alloc_extend([r], [8])
    refused_unchanged(a, lambda: a.step(take=([0], [r], [8]), admit_on=([1], [0], [-1])),
                      E.OverlapError)
    a.step(take=([0], [r], [8]))
    a.step(admit_on=([1], [0], [-1]))  # the next step: fine
    assert a.seq_len(1) == 8 and a.audit() == []


def _shape_shortages(a, r, rows):
    return {
        "max_spec_tokens": dict(decode=[r], lookahead=5),  # 6 slots, max_spec_tokens 2
        "max_batch": dict(extend=(rows[:3], [1] * 3)),  # 3 lanes, max_batch 2
        "max_tokens_per_alloc_row": dict(extend=([r], [13])),
        "max_alloc_rows": dict(decode=rows),  # 4 rows, max_alloc_rows 3
    }


@pytest.mark.parametrize("planner", PLANNERS)
def test_every_frozen_shape_shortage_is_back_pressure(planner):
    """Rule (errors.md, api.md): try_step returns None and fits False for every limit of
    the frozen step shape, nothing changed (a speculative step over max_spec_tokens raised
    from both while a batch over max_batch returned None)."""
    a = ga.HybridAllocator(config(num_state_slots=8, max_spec_tokens=2, max_alloc_rows=3,
                                  max_tokens_per_alloc_row=12, max_step_tokens=16),
                           planner=planner, page_tables=PageTableSpec(max_batch=2))
    rows = [a.admit() for _ in range(4)]
    for pair in (rows[:2], rows[2:]):
        a.alloc_extend(pair, [5, 5])
    for name, kw in _shape_shortages(a, rows[0], rows).items():
        before = a.snapshot()
        assert a.fits(**kw) is False, name
        assert a.try_step(**kw) is None, name
        assert_same_snapshot(before, a.snapshot())
        with pytest.raises(E.BatchTooLargeError):
            a.step(**kw)
    assert a.try_step(decode=[rows[0]], lookahead=1) is not None  # within the shape


@pytest.mark.parametrize("planner", PLANNERS)
def test_a_zero_token_extend_row_has_no_lane(planner):
    """Rule (page_tables.md): lanes are the decode rows, then the extend rows, in the order
    given; an extend row of 0 tokens has no lane and the later lanes move up."""
    a = ga.HybridAllocator(config(), planner=planner, page_tables=PageTableSpec(max_batch=4))
    x, y, c = a.admit(), a.admit(), a.admit()
    a.alloc_extend([x, y, c], [5, 6, 7])
    p = a.plan(decode=[c], extend=([x, y], [0, 3]))
    assert p.tables.n_lanes == 2
    assert p.tables.seq_lens_host.tolist()[:3] == [8, 9, 0]  # lane 0 = c, lane 1 = y
    a.run(p)
    assert a.tables.seq_lens_buf.tolist()[:3] == [8, 9, 0]
    indptr = a.tables.full_kv_indptr_buf.tolist()
    pages = a.tables.full_kv_indices_buf.tolist()
    assert pages[indptr[1]:indptr[2]] == (a.req_to_token[y, :9:4] // 4).tolist()


def test_handle_info_in_a_free_group_counts_what_dropping_adds_to_the_block():
    """Rule (HandleInfo): inside an open free group the holdings are the committed ones and
    frees_* what dropping the handle would add to the block's frees -- measured here by
    running the block with and without the drop."""
    def setup():
        a = ga.HybridAllocator(config())
        r = a.admit()
        a.alloc_extend([r], [16])
        h = a.take_handle(r, 8)
        return a, r, h
    a, r, h = setup()
    outside = a.handle_info(h)
    assert (outside.frees_full, outside.frees_swa) == (0, 0)  # r holds its pages too
    with a.free_group():
        a.release([r])
        inside = a.handle_info(h)
    assert (inside.n_tokens, inside.n_full_pages) == (outside.n_tokens, outside.n_full_pages)
    free_without = (a.n_free("full"), a.n_free("swa"))
    b, r, h = setup()
    with b.free_group():
        b.release([r])
        b.drop_handle(h)
    free_with = (b.n_free("full"), b.n_free("swa"))
    assert (inside.frees_full, inside.frees_swa) == (free_with[0] - free_without[0],
                                                     free_with[1] - free_without[1])
    assert inside.frees_full > 0


@pytest.mark.parametrize("planner", PLANNERS)
def test_spec_state_names_the_newest_in_flight_steps_slots(planner):
    """Rule (state_slots.md): spec_state[r, :1 + k] is the slots of r's newest speculative
    step while it is in flight, after a second step and after the oldest is committed."""
    a = ga.HybridAllocator(config(num_state_slots=12, max_spec_tokens=3), planner=planner)
    r = a.admit()
    a.alloc_extend([r], [4])
    led = a.ledger
    a.alloc_decode([r], lookahead=[2])
    assert a.spec_state[r, :3].tolist() == led.spec_state[r, 0, :3].tolist()
    first = led.spec_state[r, 0, :3].tolist()
    a.alloc_decode([r], lookahead=[1])  # a second step in flight: the newest shows
    second = led.spec_state[r, 1, :2].tolist()
    assert a.spec_state[r, :2].tolist() == second and set(first).isdisjoint(second)
    a.accept([r], [0])  # the oldest resolved; the second, now the only one, still shows
    assert a.spec_state[r, :2].tolist() == second == led.spec_state[r, 0, :2].tolist()
    assert a.audit() == []


@pytest.mark.parametrize("call", ["drop_handle", "drop_handle_swa", "group", "recorder"])
def test_drop_handle_takes_one_handle_as_admit_does(call):
    """Rule: a single operation on a handle takes one id; drop_handle([h]) is refused as
    admit(handle=[h]) is (UnknownHandleError), nothing changed."""
    a = ga.HybridAllocator(config())
    r = a.admit()
    a.alloc_extend([r], [8])
    h = a.take_handle(r, 8)
    refused_unchanged(a, lambda: a.admit(handle=[h]), E.UnknownHandleError)

    def go():
        if call == "group":
            with a.free_group():
                a.drop_handle([h])
        elif call == "recorder":
            with a.scheduler_step() as it:
                it.drop_handle([h])
        else:
            getattr(a, call)([h])
    refused_unchanged(a, go, E.UnknownHandleError)
    a.drop_handle(h)  # one id: fine
    assert h not in a.live_handles()


def test_step_with_an_unknown_kind_is_a_contract_error():
    """Rule: bad input gets a typed graphalloc error; Step(foo=1) raised Python's TypeError."""
    with pytest.raises(E.ContractError, match="not a kind of Step"):
        ga.Step(foo=1)
    with pytest.raises(E.ContractError, match="keywords only"):
        ga.Step([1])
    a = ga.HybridAllocator(config())
    with pytest.raises(E.ContractError, match="not a kind of Step"):
        a.step(foo=1)


@pytest.mark.parametrize("sizes", [dict(num_full_pages=10**12), dict(max_reqs=10**9),
                                   dict(max_context_len=10**10, num_full_pages=64),
                                   dict(num_state_slots=10**12), dict(max_handles=10**9)],
                         ids=lambda d: next(iter(d)))
def test_absurd_sizes_are_config_errors_before_anything_is_allocated(sizes):
    """Rule: a config whose tables cannot fit is a ConfigError naming the tables (it raised
    numpy's MemoryError or torch's RuntimeError half-way through the constructor)."""
    with pytest.raises(E.ConfigError, match="GiB"):
        ga.HybridAllocator(config(**sizes))


def test_an_allocation_failing_anyway_is_a_config_error(monkeypatch):
    """The memory was there when checked but is gone when the tables are allocated."""
    import graphalloc.allocator as allocator

    def out_of_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate")
    monkeypatch.setattr(allocator, "Ledger", out_of_memory)
    with pytest.raises(E.ConfigError, match="failed") as info:
        ga.HybridAllocator(config())
    assert isinstance(info.value.__cause__, MemoryError)


def test_numpy_rows_of_evict_all_in_a_scheduler_block_are_checked():
    """it.evict(rows) and it.evict_all() together: the rows are checked (one step)."""
    a = ga.HybridAllocator(config())
    r = a.admit()
    a.alloc_extend([r], [20])
    with pytest.raises(E.UnknownRequestError), a.scheduler_step() as it:
        it.evict(np.array([2]))
        it.evict_all()
    assert a.audit() == []
