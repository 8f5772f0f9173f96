"""The decode-loop example with FlashInfer as the attention, and in half precision, on a CPU.

``examples/model_loops/decode_loop.py --attention flashinfer`` runs FlashInfer's paged decode over
the
loop's page tables inside the step's CUDA graph; FlashInfer is CUDA-only and not a
dependency, so here:

* the command line refuses the mode with a clear message when FlashInfer does not import,
  in float32 (FlashInfer's decode has no float32 kernels), off CUDA, and for a head dim its
  kernels are not built for; ``DecodeLoop`` raises ImportError without FlashInfer;
* the loop's FlashInfer branch (``paged_decode.FlashInferAttention``: one FULL + SWA wrapper
  pair per descriptor buffer on ``alloc.tables``' own buffers, pair ``i`` planned from the
  host copies of the step planned into buffer ``i``, FULL layers ``window_left=-1``, SWA
  layers ``W - 1``) runs
  against a stand-in wrapper that implements FlashInfer's CUDA-graph-mode contract with the
  project's Torch twin: its tokens and logits must equal the tables mode's bit for bit (same
  kernel, same tables), and a stand-in whose window keeps one key less must change tokens;
* half precision: our model and transformers' in float16 (SDPA) on the CPU, through the
  page tables: the verdict is "tokens equal" or "equal up to near ties" (every difference
  at a reference top-2 margin within the tolerance, every token of ours transformers' argmax
  or within it), and both negative controls end "mismatch";
* the comparison's margins and the verdict rules on hand-made logits.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "examples" / "model_loops"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import decode_loop  # noqa: E402
import paged_decode  # noqa: E402
from hybrid_model import ModelConfig, TinyHybridLM, random_weights  # noqa: E402

from graphalloc.kernels import paged_decode_attention_torch  # noqa: E402

TINY = ["--requests", "10", "--max-batch", "5", "--prompt-len", "3", "30", "--output-len", "6",
        "36", "--window", "8", "--vocab", "128", "--no-progress", "--out", ""]


def _cli_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        decode_loop.parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


# ---- refusals ------------------------------------------------------------------------------
def test_cli_refuses_flashinfer_when_it_does_not_import(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import fails whatever is installed
    err = _cli_error(capsys, ["--attention", "flashinfer", "--dtype", "float16"])
    assert "--attention flashinfer" in err and "flashinfer not installed" in err
    assert "PYTHONPATH" in err


def test_cli_refuses_float32_cpu_and_unsupported_head_dims(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    err = _cli_error(capsys, ["--attention", "flashinfer"])  # --dtype float32 by default
    assert "float16 or bfloat16" in err and "no float32" in err
    err = _cli_error(capsys, ["--attention", "flashinfer", "--dtype", "float16", "--device",
                              "cpu"])
    assert "--device cuda" in err
    err = _cli_error(capsys, ["--attention", "flashinfer", "--dtype", "float16", "--device",
                              "cuda", "--hidden", "64", "--heads", "4"])
    assert "head dim" in err and "(64, 128, 256)" in err


def test_model_size_and_dtype_defaults():
    args = decode_loop.parse_args(["--attention", "tables", "--dtype", "float16"])
    assert (args.hidden, args.heads, args.kv_heads) == (64, 4, 2)
    assert args.atol == decode_loop.ATOL["float16"] and args.reference_attn == "sdpa"
    args = decode_loop.parse_args(["--hidden", "32", "--atol", "0.5", "--reference-attn",
                                   "sdpa"])
    assert args.hidden == 32 and args.atol == 0.5 and args.reference_attn == "sdpa"
    args = decode_loop.parse_args([])  # float32: as before
    assert args.atol == 2e-3 and args.reference_attn == "eager" and args.hidden == 64
    # FlashInfer's default model: head_dim 128, 8 query / 2 KV heads (the GPU-checked shapes)
    ns = argparse.Namespace(attention="flashinfer", dtype="bfloat16", hidden=None, heads=None,
                            kv_heads=None, atol=None, reference_attn="auto")
    decode_loop.resolve_model_args(ns)
    assert (ns.hidden, ns.heads, ns.kv_heads) == (1024, 8, 2)
    assert ns.atol == decode_loop.ATOL["bfloat16"] and ns.reference_attn == "sdpa"


def _loop_parts(ps=16, dtype=torch.float16, hidden=128, heads=2, kv_heads=1, window=8,
                device="cpu", tables=True):
    mcfg = ModelConfig(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_layers=4, num_heads=heads, num_kv_heads=kv_heads,
                       sliding_window=window, layer_pattern="sf")
    weights = random_weights(mcfg, 0)
    requests = decode_loop.make_requests(6, (3, 30), (6, 30), mcfg.vocab_size, 1)
    max_prompt = max(len(r.prompt) for r in requests)
    max_out = max(r.n_out for r in requests)
    alloc = decode_loop.build_allocator(page_size=ps, max_batch=3, max_prompt=max_prompt,
                                        max_total=max_prompt + max_out,
                                        alloc_window=window - 1, device=device,
                                        backend="torch",
                                        tables_window=window if tables else None)
    model = TinyHybridLM(mcfg, weights, device, dtype=dtype)
    return mcfg, requests, alloc, model, max_out


def test_decode_loop_raises_import_error_without_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    _, requests, alloc, model, max_out = _loop_parts()
    with pytest.raises(ImportError, match="flashinfer not installed"):
        paged_decode.DecodeLoop(model, alloc, max_batch=3, n_serials=len(requests),
                                max_out=max_out, attention="flashinfer")


def test_decode_loop_refuses_float32_and_head_dims_with_a_stand_in(stand_in):
    _, requests, alloc, model, max_out = _loop_parts(dtype=torch.float32)
    kw = dict(max_batch=3, n_serials=len(requests), max_out=max_out, attention="flashinfer",
              flashinfer=stand_in)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        paged_decode.DecodeLoop(model, alloc, **kw)
    _, requests, alloc, model, max_out = _loop_parts(hidden=64, heads=4, kv_heads=2)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode.DecodeLoop(model, alloc, **kw)


# ---- the FlashInfer branch against a stand-in ----------------------------------------------
class _StandInWrapper:
    """FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` in CUDA-graph mode as its docs
    describe it (fixed buffers; plan() copies indptr / last_page_len into them from host
    tensors; run() keeps list entries ``kv_idx >= kv_len - 1 - window_left``), computing
    with the project's Torch twin on the grid TableAttention uses (``max_pages``), so the
    result is the tables mode's bit for bit."""

    calls: list = []
    off_by_one = False
    max_pages = {}  # {"full": n, "swa": n}: set by the test from the tables' spec

    def __init__(self, workspace, layout, use_cuda_graph=False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):
        assert layout == "NHD" and use_cuda_graph
        assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
        self.bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                     paged_kv_last_page_len_buffer)
        self.window_left = None
        self.planned_host = None

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *, window_left=-1, q_data_type=None, kv_data_type=None):
        indptr_buf, indices_buf, last_buf = self.bufs
        assert len(last_page_len) == len(last_buf)  # the batch size is frozen
        assert indptr.device.type == "cpu" and last_page_len.device.type == "cpu"
        assert indptr.dtype == torch.int32 and last_page_len.dtype == torch.int32
        assert indices.untyped_storage().data_ptr() == indices_buf.untyped_storage().data_ptr()
        assert indices.storage_offset() == 0 and len(indices) == int(indptr[-1])
        assert q_data_type == kv_data_type == torch.float16
        indptr_buf.copy_(indptr)
        last_buf.copy_(last_page_len)
        self.window_left, self.page_size = window_left, page_size
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.planned_host = indptr.clone()
        self.calls.append(("plan", id(self), window_left))

    def run(self, q, paged_kv_cache, out=None, window_left=None, **kwargs):
        assert window_left is None or window_left == self.window_left
        k, v = paged_kv_cache
        assert k.shape[1:] == (self.page_size, self.heads[1], self.heads[2])
        assert q.shape[1:] == (self.heads[0], self.heads[2]) and out.dtype == q.dtype
        # the device buffers hold what the tables' kernel wrote: the plan's indptr
        assert torch.equal(self.bufs[0].cpu(), self.planned_host.to(self.bufs[0].dtype))
        keys = 0 if self.window_left < 0 else self.window_left + 1 - self.off_by_one
        grid = self.max_pages.get("full" if self.window_left < 0 else "swa")
        paged_decode_attention_torch(q, k, v, *self.bufs, sliding_window=keys,
                                     max_pages=grid, out=out)
        self.calls.append(("run", id(self), self.window_left))
        return out


@pytest.fixture
def stand_in(monkeypatch):
    _StandInWrapper.calls = []
    monkeypatch.setattr(_StandInWrapper, "off_by_one", False)
    monkeypatch.setattr(_StandInWrapper, "max_pages", {})
    return types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_StandInWrapper)


def _run_loop(attention, ps, flashinfer=None):
    _, requests, alloc, model, max_out = _loop_parts(ps=ps)
    loop = paged_decode.DecodeLoop(model, alloc, max_batch=3, n_serials=len(requests),
                                   max_out=max_out, attention=attention,
                                   attention_backend="torch", flashinfer=flashinfer)
    if flashinfer is not None:
        _StandInWrapper.max_pages = {"full": loop.tables.spec.max_pages_per_req,
                                     "swa": paged_decode.swa_max_pages(loop.tables)}
    return loop, loop.run(requests), alloc


@pytest.mark.parametrize("ps", [16, 1])
def test_flashinfer_branch_equals_the_tables_mode_bit_for_bit(ps, stand_in):
    loop, res, alloc = _run_loop("flashinfer", ps, stand_in)
    fi = loop.flashinfer_attention
    assert loop.attention_backend == "flashinfer" and loop.table_attention is None
    pairs = fi.decode.pairs
    assert len(pairs) == len(alloc.ring)  # one FULL + SWA pair per descriptor buffer
    t = alloc.tables  # the allocator's buffers, written inside each step
    assert loop.tables is t
    for full, swa in pairs:
        assert full.bufs == (t.full_kv_indptr_buf, t.full_kv_indices_buf,
                             t.full_kv_last_page_len_buf)
        assert swa.bufs == (t.swa_kv_indptr_buf, t.swa_kv_indices_buf,
                            t.swa_kv_last_page_len_buf)
    calls = _StandInWrapper.calls
    assert {w for kind, _, w in calls if kind == "plan"} == {-1, 8 - 1}  # SWA: W - 1
    n_plans = sum(kind == "plan" for kind, _, _ in calls)
    assert n_plans == 2 * len(res.steps)  # a FULL and an SWA plan in every decode step
    # two FULL and two SWA layers: each step runs its pair's wrappers twice
    assert sum(kind == "run" for kind, _, _ in calls) == 2 * n_plans
    assert {i for kind, i, _ in calls if kind == "run"} == {id(w) for p in pairs for w in p}
    # a run always uses the pair planned last before it (the step's own)
    last_planned = {}
    for kind, i, w in calls:
        if kind == "plan":
            last_planned[w] = i
        else:
            assert last_planned[w] == i
    _, ref, _ = _run_loop("tables", ps)
    assert res.tokens == ref.tokens
    for s in ref.logits:
        assert np.array_equal(res.logits[s], ref.logits[s])
    alloc.check_integrity()


def test_flashinfer_branch_with_a_window_one_key_short_changes_tokens(stand_in, monkeypatch):
    monkeypatch.setattr(_StandInWrapper, "off_by_one", True)  # keeps window_left keys
    _, res, _ = _run_loop("flashinfer", 16, stand_in)
    _, ref, _ = _run_loop("tables", 16)
    assert res.tokens != ref.tokens


# ---- half precision against transformers ----------------------------------------------------
@pytest.fixture(scope="module")
def transformers_available():
    pytest.importorskip("transformers")


def test_float16_tables_against_transformers_with_controls(transformers_available, tmp_path):
    out = decode_loop.main([*TINY, "--dtype", "float16", "--page-sizes", "1", "16",
                            "--negative-control", "--out", str(tmp_path)])
    assert out["config"]["dtype"] == "float16" and out["config"]["reference_attn"] == "sdpa"
    assert out["config"]["reference_device"] == "cpu"
    atol = out["config"]["atol"]
    for run in out["runs"]:
        c, tf = run["comparison"], run["teacher_forced"]
        assert run["verdict"] in ("tokens equal", "equal up to near ties"), c["differences"]
        assert c["max_logit_diff"] <= atol and c["logits_within_atol"]
        for d in c["differences"]:  # any difference is a near tie of transformers' own
            assert d["transformers_margin_over_ours"] <= atol
        assert tf["ok"] and tf["beyond_tolerance"] == 0 and tf["tokens_checked"] == sum(
            len(t) for t in run["tokens"].values())
        assert tf["argmax_equal"] >= 0.95 * tf["tokens_checked"]
        assert run["summary"]["kv_bytes_at_peak"]["all_full"] > 0
    assert out["ok"] and out["controls_ok"]
    controls = out["controls"]
    assert len(controls) == 4  # (attention window W - 1, allocator window W - 2) x 2 ps
    for c in controls:
        assert c["detected"] and c["verdict"] == "mismatch"
        assert c["teacher_forced"]["beyond_tolerance"] > 0  # far beyond any near tie
        assert c["teacher_forced"]["max_logit_diff"] > 10 * atol
    md = (tmp_path / "decode_loop.md").read_text()
    assert "dtype=float16" in md and "Negative controls" in md and "Teacher-forced" in md


def test_reference_in_float16_keeps_rotary_frequencies_in_float32(transformers_available):
    from hybrid_model import to_transformers
    mcfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64)
    hf = to_transformers(mcfg, random_weights(mcfg, 0), dtype=torch.float16,
                         attn_implementation="sdpa")
    assert {p.dtype for p in hf.parameters()} == {torch.float16}
    assert hf.model.rotary_emb.inv_freq.dtype == torch.float32
    assert hf.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="attn_implementation"):
        to_transformers(mcfg, random_weights(mcfg, 0), attn_implementation="flash")


def test_float32_model_math_is_unchanged_by_the_dtype_support():
    """In float32 every cast of the half-precision path is a no-op: the prefill logits equal
    a plain float32 implementation of the same forward bit for bit."""
    mcfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64)
    w = random_weights(mcfg, 0)
    m = TinyHybridLM(mcfg, w, "cpu")
    assert m.dtype == torch.float32 and m.cos.dtype == torch.float32
    x = torch.randn(3, 5, 32)
    import hybrid_model as hm
    ref = w["model.norm.weight"] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.equal(hm._rms_norm(x, w["model.norm.weight"], 1e-6), ref)
    q, k, v = torch.randn(2, 4, 4, 8), torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
    mask = torch.rand(2, 4, 6) > 0.3
    qg = q.view(2, 4, 2, 2, 8)
    s = torch.einsum("bqgrd,bkgd->bgrqk", qg, k) * 8 ** -0.5
    s = torch.where(mask[:, None, None], s, torch.finfo(s.dtype).min)
    o = torch.einsum("bgrqk,bkgd->bqgrd", torch.softmax(s, -1), v).reshape(2, 4, 32)
    assert torch.equal(hm._attend(q, k, v, mask, 2), o)


def test_half_model_follows_transformers_norm_and_rotary_casts():
    mcfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64)
    m = TinyHybridLM(mcfg, random_weights(mcfg, 0), "cpu", dtype=torch.float16)
    assert m.cos.dtype == torch.float16 and m.w["lm_head.weight"].dtype == torch.float16
    import hybrid_model as hm
    x = (torch.randn(2, 3, 32) * 40).half()
    wt = m.w["model.norm.weight"]
    h = x.float()
    ref = wt * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).half()
    assert torch.equal(hm._rms_norm(x, wt, 1e-6), ref)  # Qwen2RMSNorm's order of casts
    with pytest.raises(ValueError, match="dtype"):
        TinyHybridLM(mcfg, random_weights(mcfg, 0), "cpu", dtype=torch.float64)


# ---- the comparison's margins and the verdict -----------------------------------------------
def _result(tokens, logits):
    return paged_decode.LoopResult(tokens, logits, [], 1.0, [], [], 0.0, 0)


def test_compare_records_margins_and_the_verdict_rules():
    ref_logits = {0: np.array([[0.0, 1.0, 0.99], [2.0, 0.0, 0.0]], dtype=np.float32),
                  1: np.array([[3.0, 0.0, 0.0]], dtype=np.float32)}
    ref_tokens = {0: [1, 0], 1: [0]}
    ours_logits = {0: np.array([[0.0, 0.98, 0.995], [0.0, 0.0, 2.0]], dtype=np.float32),
                   1: np.array([[3.0, 0.0, 0.0]], dtype=np.float32)}
    res = _result({0: [2, 2], 1: [0]}, ours_logits)
    c = decode_loop.compare(res, ref_tokens, ref_logits, atol=0.05)
    assert not c["tokens_equal"] and c["requests_differing"] == 1
    (d,) = c["differences"]
    assert d["request"] == 0 and d["index"] == 0 and (d["ours"], d["transformers"]) == (2, 1)
    assert d["transformers_top2_gap"] == pytest.approx(0.01)
    assert d["transformers_margin_over_ours"] == pytest.approx(0.01)
    assert d["our_margin_over_transformers"] == pytest.approx(0.015)
    assert c["max_logit_diff"] == pytest.approx(0.02)  # up to the first difference only
    assert c["min_top2_gap"] == {"gap": pytest.approx(0.01), "request": 0, "index": 0}
    tf_ok = {"ok": True}
    run = {"comparison": c, "teacher_forced": tf_ok}
    assert decode_loop.run_verdict(run, "float16") == "equal up to near ties"
    assert decode_loop.run_verdict(run, "float32") == "mismatch"  # float32 stays strict
    assert decode_loop.run_verdict({"comparison": c, "teacher_forced": {"ok": False}},
                                   "float16") == "mismatch"
    tight = decode_loop.compare(res, ref_tokens, ref_logits, atol=0.005)
    assert decode_loop.run_verdict({"comparison": tight, "teacher_forced": tf_ok},
                                   "float16") == "mismatch"  # margin beyond the tolerance
    same = decode_loop.compare(_result(ref_tokens, ref_logits), ref_tokens, ref_logits, 0.0)
    assert same["tokens_equal"] and same["differences"] == []
    assert decode_loop.run_verdict({"comparison": same}, "float32") == "tokens equal"
    assert decode_loop.run_verdict({}, "float16") == "no reference"


def test_teacher_forced_counts_near_ties_and_beyond(transformers_available):
    """A fake transformers model returning fixed logits: our tokens are checked at every
    position against its argmax, a near tie within atol, a clear miss beyond it."""
    lg = torch.tensor([[[0.0, 0.0, 0.0], [1.0, 0.97, 0.0], [0.0, 0.0, 5.0], [0.0, 0.0, 0.0]]])

    class Fake:
        def __call__(self, ids, attention_mask=None):
            assert ids.shape == (1, 4)  # prompt 2 + our 3 tokens but the last
            return types.SimpleNamespace(logits=lg)

    req = paged_decode.Request(0, np.array([5, 6]), 3)
    ours = _result({0: [1, 0, 0]}, {0: lg[0, 1:].numpy()})
    tf = decode_loop.teacher_forced(Fake(), [req], ours, atol=0.05)
    assert tf["tokens_checked"] == 3 and tf["argmax_equal"] == 1
    assert tf["near_ties"] == 1 and tf["near_tie_list"][0]["margin"] == pytest.approx(0.03)
    assert tf["beyond_tolerance"] == 1 and tf["beyond_list"][0]["index"] == 1
    assert not tf["ok"] and tf["max_logit_diff"] == 0.0


def test_the_flashinfer_command_path_runs_with_a_stand_in(transformers_available, stand_in,
                                                          monkeypatch, tmp_path):
    """decode_loop's FlashInfer mode end to end on the CPU (eager steps), the stand-in in
    FlashInfer's place: the JIT stage falls back to plan()'s lazy compile, the run and
    both negative controls run (page size 16), the report names FlashInfer."""
    def check(ap, args):  # parse_args' FlashInfer checks, minus "needs CUDA"
        args.flashinfer_module = stand_in
    monkeypatch.setattr(decode_loop, "_check_flashinfer", check)
    out = decode_loop.main([*TINY, "--attention", "flashinfer", "--dtype", "float16",
                            "--hidden", "128", "--heads", "2", "--kv-heads", "1",
                            "--page-sizes", "16", "--negative-control", "--out", str(tmp_path)])
    assert out["config"]["flashinfer"]["jit"].startswith("lazy in plan()")
    assert out["runs_ok"] and out["controls_ok"] and out["ok"]
    for run in out["runs"]:
        assert run["attention"] == "flashinfer" and run["attention_backend"] == "flashinfer"
        assert run["attention_window"] == 8 and run["verdict"] != "mismatch"
    assert [c["detected"] for c in out["controls"]] == [True] * 2
    assert {w for kind, _, w in _StandInWrapper.calls if kind == "plan"} == {-1, 7, 6}
    md = (tmp_path / "decode_loop.md").read_text()
    assert "attention=flashinfer" in md and "FlashInfer" in md


@pytest.mark.cuda
def test_flashinfer_in_one_graph_per_step_on_cuda_without_syncs(transformers_available):
    """The GPU command at tiny sizes: FlashInfer (installed) in every step's graph, under
    sync debug 'error', float16 against transformers' float16 SDPA on the GPU."""
    pytest.importorskip("flashinfer")
    out = decode_loop.main([*TINY, "--device", "cuda", "--graph", "--sync-debug",
                            "--attention", "flashinfer", "--dtype", "float16",
                            "--page-sizes", "1", "16", "--negative-control"])
    assert out["ok"], (out["verdicts"], [r["comparison"]["differences"] for r in out["runs"]])
    for run in out["runs"]:
        assert run["attention_backend"] == "flashinfer" and run["host_syncs_in_loop"] == 0
        assert run["summary"]["swa_clipped_lanes"] == 0
        assert run["summary"]["graph_nodes"].get("host", 0) == 0
    assert out["config"]["reference_device"] == "cuda"
