"""The recurrent-state decode loop (``examples/model_loops/recurrent_decode.py``), on the CPU at
tiny sizes.

The tiny Mamba-2 + attention hybrid keeps its conv and SSM state in the allocator's state
slots (``state_tensors`` registered, ``req_to_state`` / ``spec_state`` read on the device).
Every request starts with a shared 22-token system prompt; at page size 3 the first request
prefills it in chunks, one ending at its page-aligned end (21), and inserts it into the
prefix cache there; the others are admitted on the cached handle in a decode step, which
copies the snapshot into their fresh slot (two in one step, here). Checked here:

* plain decode steps and speculative rounds (k = 3, drafts wrong 30% of the time, so rounds
  accept 0, 1, 2 and 3 drafts): every request's tokens equal transformers'
  ``BambaForCausalLM`` greedy tokens on its full prompt, logits within 1e-3;
* the cache served every later request (hits counted), each admit planned exactly one state
  copy, from the snapshot's slot; ``audit()`` is empty with the cache held and after it is
  dropped, when every page and state slot is back;
* no host read of a device value inside a step body or a prefill forward (a CPU stand-in
  for sync debug "error": Tensor.item, tolist, int(), bool(), nonzero ... raise there);
* negative controls: a sharer's slot zeroed instead of restored, and a verify reading the
  slot from before its round's commit, change the tokens.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "examples" / "model_loops"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import recurrent_decode  # noqa: E402
from recurrent_loop import RecurrentLoop, chunk_ends  # noqa: E402
from recurrent_model import RecurrentConfig, RecurrentState, TinyRecurrentLM  # noqa: E402

import graphalloc as ga  # noqa: E402

TINY = ["--requests", "5", "--max-batch", "3", "--page-sizes", "3", "--shared-prompt", "22",
        "--user-len", "3", "10", "--output-len", "8", "16", "--chunk-tokens", "8",
        "--lookahead", "3", "--no-progress", "--out", ""]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small ops on a contended pool of threads are 100x slower on a loaded machine."""
    pytest.importorskip("transformers")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def result():
    return recurrent_decode.main([*TINY, "--negative-control"])


def test_every_mode_matches_transformers(result):
    assert result["ok"] and result["runs_ok"]
    assert [(r["mode"], r["page_size"]) for r in result["runs"]] == [("plain", 3), ("spec", 3)]
    for run in result["runs"]:
        c = run["comparison"]
        assert c["tokens_equal"] and c["requests_differing"] == 0, c["differences"]
        assert c["tokens_compared"] == sum(len(t) for t in run["tokens"].values())
        assert c["max_logit_diff"] < 1e-3
        assert run["healthy"] and not run["audit_end"] and run["all_back"]


def test_speculative_rollback_at_every_depth(result):
    spec = next(r for r in result["runs"] if r["mode"] == "spec")
    s = spec["summary"]
    assert s["lookahead"] == 3
    # rounds kept 1 (every draft rejected), 2, 3 and 4 tokens (every draft accepted)
    assert all(v > 0 for v in s["accepted_histogram"].values()), s["accepted_histogram"]
    assert 0.3 < s["acceptance_rate"] < 0.9
    assert s["rounds_with_commit"] > 0
    plain = next(r for r in result["runs"] if r["mode"] == "plain")
    assert s["steps"] < plain["summary"]["steps"]


def test_shared_prompt_served_from_the_snapshot(result):
    for run in result["runs"]:
        sh = run["sharing"]
        assert sh["prefix_tokens"] == 22 and sh["cached_prefix_tokens"] == 21  # 7 pages of 3
        assert sh["requests_carrying"] == 5 and sh["requests_sharing"] == 4
        assert sh["cache_hits"] == 4 and sh["prefill_tokens_saved"] == 4 * 21
        snapshot = [s for s in sh["snapshot_slots"] if s]
        assert len(snapshot) == 1  # one handle, one snapshot slot
        assert len(sh["restores"]) == 4
        for r in sh["restores"]:  # admit_on planned exactly one copy, snapshot -> new slot
            assert r["cached_tokens"] == 21 and r["state_recompute_tokens"] == 0
            assert r["step_state_copies"] == r["step_restores"]
            assert r["state_copies"] == [[snapshot[0], r["slot"]]] and r["slot"] != 0
        # the decode steps carried the restores: one with two of them
        assert max(r["step_restores"] for r in sh["restores"]) >= 2
        assert sh["restores_ok"] and not sh["audit_with_cache"]


def test_negative_controls_change_tokens(result):
    assert result["controls_ok"]
    got = {(c["stale_state"], c["mode"]) for c in result["controls"]}
    assert got == {("restore", "plain"), ("restore", "spec"), ("commit", "spec")}
    for c in result["controls"]:
        assert c["detected"] and not c["comparison"]["tokens_equal"]
        if c["stale_state"] == "restore":  # only the sharers read a restored state
            differing = {d["request"] for d in c["comparison"]["differences"]}
            assert differing == {1, 2, 3, 4}
        assert c["healthy"]  # the allocator itself stays consistent


# Tensor methods that read a value on the host: on CUDA each one synchronises
DEVICE_READS = ("item", "tolist", "__bool__", "__int__", "__index__", "__float__", "cpu",
                "numpy", "nonzero")


def test_step_body_and_prefill_never_read_the_device(monkeypatch):
    """A CPU stand-in for sync debug "error": every step body (but the allocator's own launch,
    Triton kernels on CUDA, checked by the library's CUDA suite) and every prefill forward,
    in both modes and under both controls, runs with the host reads of tensor values
    raising."""
    import recurrent_loop

    armed, hits = [False], []

    def tripwire(name, original):
        def read(self, *args, **kwargs):
            if armed[0]:
                hits.append(name)
                raise AssertionError(f"a host read of a device value: Tensor.{name}")
            return original(self, *args, **kwargs)
        return read

    for name in DEVICE_READS:
        monkeypatch.setattr(torch.Tensor, name, tripwire(name, getattr(torch.Tensor, name)))
    body, forward = RecurrentLoop._body, RecurrentLoop._forward

    def armed_body(self, i):
        launch = self.alloc.launch

        def unarmed_launch(*args, **kwargs):
            armed[0] = False
            try:
                return launch(*args, **kwargs)
            finally:
                armed[0] = True
        self.alloc.launch = unarmed_launch
        armed[0] = True
        try:
            body(self, i)
        finally:
            armed[0] = False
            del self.alloc.launch

    def armed_forward(self, *args):
        armed[0] = True
        try:
            return forward(self, *args)
        finally:
            armed[0] = False

    monkeypatch.setattr(recurrent_loop.RecurrentLoop, "_body", armed_body)
    monkeypatch.setattr(recurrent_loop.RecurrentLoop, "_forward", armed_forward)
    out = recurrent_decode.main([*TINY, "--requests", "3", "--no-reference",
                                 "--negative-control"])
    assert not hits
    assert len(out["runs"]) == 2 and len(out["controls"]) == 3
    assert all(r["healthy"] for r in out["runs"] + out["controls"])


def test_chunk_ends_align_with_the_cached_prefix():
    assert chunk_ends(0, 30, 8, 20) == [8, 16, 20, 28, 30]
    assert chunk_ends(0, 30, 0, 21) == [21, 30]
    assert chunk_ends(21, 30, 8) == [29, 30]
    assert chunk_ends(0, 7, 8, None) == [7]
    assert chunk_ends(0, 20, 8, 20) == [8, 16, 20]  # the boundary at the end: no extra cut


def test_loop_refuses_an_allocator_without_the_state():
    cfg = RecurrentConfig()
    state = RecurrentState.zeros(cfg, 4, "cpu")
    acfg = ga.AllocatorConfig(page_size=4, num_full_pages=16, num_swa_pages=16, max_reqs=2,
                              max_context_len=32, sliding_window=32, num_state_slots=4)
    model = TinyRecurrentLM(cfg, recurrent_decode.random_weights(cfg), "cpu")
    alloc = ga.HybridAllocator(acfg)  # slots, but the state tensors not registered
    with pytest.raises(ValueError, match="state_tensors"):
        RecurrentLoop(model, alloc, state, max_batch=1, n_serials=1, max_out=4)
    alloc = ga.HybridAllocator(acfg, state_tensors=[(state.conv, 1), (state.ssm, 1)])
    with pytest.raises(ValueError, match="max_spec_tokens"):
        RecurrentLoop(model, alloc, state, max_batch=1, n_serials=1, max_out=4, lookahead=8)
    with pytest.raises(ValueError, match="speculative"):
        RecurrentLoop(model, alloc, state, max_batch=1, n_serials=1, max_out=4,
                      stale_state="commit")


def test_help():
    script = ROOT / "examples" / "model_loops" / "recurrent_decode.py"
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                         text=True, timeout=120, check=True)
    assert "--stale-state" in out.stdout and "--negative-control" in out.stdout
