"""vLLM's own manager behaviours, checked on graphalloc's plug-in inside vLLM's real scheduler.

Skipped without vLLM (``make engines`` installs it in an environment of its own). Ported in
our own words from what vLLM's tests/v1/core checks for its manager: prefix-cache hits stop
one token short of the prompt and at whole blocks; cache salts isolate tenants; a reset is
refused while requests hold blocks and forgets every entry after; a sliding-window group
drops (null-block) the blocks below the window; a Mamba group holds one live block a
request and names its state slot; the free-block count (usage) follows vLLM's
at every step; a short pool answers ``None`` and changes nothing. Each runs the same
requests through vLLM's own manager and compares.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

pytest.importorskip("vllm")

_HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "vllm_engine_harness", os.path.join(_HERE, "..", "..", "engines", "vllm", "harness.py"))
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)


def _w(requests, **kw):
    w = {"block_size": 16, "max_model_len": 1024, "max_num_seqs": 8,
         "max_num_batched_tokens": 64, "num_blocks": 101, "caching": True,
         "requests": requests}
    w.update(kw)
    return w


PROMPT = list(range(10, 50))  # 40 tokens: 2 whole blocks and 8 more


def _both(w):
    return harness.run(w, "vllm"), harness.run(w, "graphalloc")


def test_hit_is_whole_blocks_one_token_short_of_the_prompt():
    reqs = [{"id": "a", "prompt": PROMPT, "max_tokens": 3, "arrive": 0},
            {"id": "b", "prompt": PROMPT, "max_tokens": 3, "arrive": 6},
            {"id": "c", "prompt": PROMPT[:32], "max_tokens": 3, "arrive": 12}]
    ours, theirs = _both(_w(reqs))
    hits = {r: n for st in theirs["steps"] for r, n in st["hits"]}
    assert hits == {"a": 0, "b": 32, "c": 16}  # c: 32 tokens, a hit stops at 31 -> 1 block
    assert ours["steps"] == theirs["steps"] and ours["outputs"] == theirs["outputs"]


def test_cache_salt_isolates_tenants():
    reqs = [{"id": "a", "prompt": PROMPT, "max_tokens": 3, "arrive": 0, "salt": "x"},
            {"id": "b", "prompt": PROMPT, "max_tokens": 3, "arrive": 6, "salt": "y"},
            {"id": "c", "prompt": PROMPT, "max_tokens": 3, "arrive": 12, "salt": "x"}]
    ours, theirs = _both(_w(reqs))
    hits = {r: n for st in theirs["steps"] for r, n in st["hits"]}
    assert hits == {"a": 0, "b": 0, "c": 32}
    assert ours["steps"] == theirs["steps"]


def _drive(s, n_steps):
    for _ in range(n_steps):
        so = s.schedule()
        s.update_from_output(so, harness.fake_output(s, so))


def test_reset_is_refused_while_blocks_are_held_and_forgets_entries_after():
    w = _w([{"id": "a", "prompt": PROMPT, "max_tokens": 3, "arrive": 0}])
    for manager in ("vllm", "graphalloc"):
        s = harness.build(w, manager)
        reqs = dict((r.request_id, r) for _, r in harness.make_requests(w))
        s.add_request(reqs["a"])
        _drive(s, 1)
        assert s.kv_cache_manager.reset_prefix_cache() is False
        _drive(s, 6)
        assert not s.has_unfinished_requests()
        assert s.kv_cache_manager.reset_prefix_cache() is True
        again = harness.make_requests(_w([{"id": "b", "prompt": PROMPT, "max_tokens": 3}]))
        s.add_request(again[0][1])
        so = s.schedule()
        assert so.scheduled_new_reqs[0].num_computed_tokens == 0, manager


def test_sliding_window_blocks_below_the_window_are_null():
    rng_prompt = [(7 * i) % 800 + 3 for i in range(200)]
    w = _w([{"id": "a", "prompt": rng_prompt, "max_tokens": 4, "arrive": 0}], caching=False,
           sliding_window=32)
    s = harness.build(w, "graphalloc")
    s.add_request(harness.make_requests(w)[0][1])
    _drive(s, 4)  # 4 chunks of 64: the prompt is computed
    req = s.requests["a"]
    full, swa = s.kv_cache_manager.get_block_ids("a")
    skipped = max(0, req.num_computed_tokens - 64 - 32 + 1) // 16  # vLLM frees at the next
    assert skipped > 0 and all(b == 0 for b in swa[:skipped])  # allocation, one chunk behind
    assert all(b > 0 for b in full) and len(set(full)) == len(full)
    assert all(b > 0 for b in swa[-2:])


def test_usage_follows_vllms_at_every_step():
    reqs = [{"id": f"r{i}", "prompt": [(i * 31 + j) % 800 + 3 for j in range(30 + 17 * i)],
             "max_tokens": 20 + i, "arrive": i} for i in range(10)]
    for extra in ({"caching": False}, {"caching": False, "sliding_window": 32},
                  {"caching": False, "mamba": True}):
        w = _w(reqs, num_blocks=41, **extra)
        a, b = harness.build(w, "vllm"), harness.build(w, "graphalloc")
        arrivals = harness.make_requests(w)
        arrivals_b = harness.make_requests(w)
        for step in range(150):
            for (t, ra), (_, rb) in zip(arrivals, arrivals_b, strict=True):
                if t == step:
                    a.add_request(ra)
                    b.add_request(rb)
            if not a.has_unfinished_requests() and step > 10:
                break
            sa, sb = a.schedule(), b.schedule()
            assert dict(sa.num_scheduled_tokens) == dict(sb.num_scheduled_tokens)
            assert a.kv_cache_manager.usage == pytest.approx(b.kv_cache_manager.usage), step
            a.update_from_output(sa, harness.fake_output(a, sa))
            b.update_from_output(sb, harness.fake_output(b, sb))
        b.kv_cache_manager.alloc.check_integrity()


def test_short_pool_answers_none_and_changes_nothing():
    w = _w([{"id": "a", "prompt": list(range(3, 200)), "max_tokens": 2, "arrive": 0}],
           caching=False, num_blocks=6)
    s = harness.build(w, "graphalloc")
    req = harness.make_requests(w)[0][1]
    s.add_request(req)
    m = s.kv_cache_manager
    before = m.usage
    assert m.allocate_slots(req, 197) is None  # 13 blocks, 5 free
    assert m.usage == before and not m.alloc.ledger.live.any()
    blocks = m.allocate_slots(req, 64)
    assert blocks is not None and len(blocks) == 4
    ids = blocks.get_block_ids()
    assert ids[0] == m.alloc.ledger.refs.page_of[m._row["a"], :4].tolist()  # noqa: SLF001


def test_mamba_group_names_one_state_slot_per_request():
    reqs = [{"id": f"r{i}", "prompt": [(5 * i + j) % 800 + 3 for j in range(70)],
             "max_tokens": 5, "arrive": 0} for i in range(3)]
    w = _w(reqs, caching=False, mamba=True)
    s = harness.build(w, "graphalloc")
    for _, r in harness.make_requests(w):
        s.add_request(r)
    _drive(s, 4)
    m = s.kv_cache_manager
    slots = []
    for rid in ("r0", "r1", "r2"):
        full, mamba = m.get_block_ids(rid)
        live = [b for b in mamba if b]
        assert len(full) == len(mamba) and live and len(set(live)) == 1, (full, mamba)
        slots.append(live[0])
    assert len(set(slots)) == 3  # a slot per request, no two requests share one
    m.alloc.check_integrity()

