"""The speculative-decoding example, run on the CPU at tiny sizes.

``examples/model_loops/speculative_decode.py``: a draft (the target with perturbed weights)
proposes k
tokens per round, the target verifies 1 + k in one forward, the host reads the accepted
counts once per round and commits them in the next round's single allocator step
(``commit=``, ``evict=``, ``decode=..., lookahead=k``). Every request's accepted tokens must
equal transformers' plain greedy tokens for page sizes 1 and 16, with a window smaller
than the prompts, requests finishing and being replaced mid-loop, drafts both rejected and
accepted, and ``alloc.audit()`` empty at midpoints and at the end. Every attention reads
K/V through the block tables the round's own step writes (``alloc.tables``). The check can
fail: an allocator window one token too small, SWA block tables one token short, and a
commit of one token more than was accepted, must all change tokens. The key table built
from block-table rows (``spec_loop.table_key_table``) is checked against the model's
full-range key table over ``req_to_token`` / ``full_to_swa``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "examples" / "model_loops"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import speculative_decode  # noqa: E402
from hybrid_model import ModelConfig, TinyHybridLM, random_weights  # noqa: E402
from spec_loop import table_key_table  # noqa: E402

TINY = ["--requests", "8", "--max-batch", "4", "--prompt-len", "9", "24", "--output-len", "6",
        "24", "--window", "8", "--vocab", "128", "--lookahead", "3", "--no-progress",
        "--out", ""]
CONTROL = [*TINY, "--requests", "4", "--page-sizes", "1", "--audit-every", "0"]


@pytest.fixture(scope="module", autouse=True)
def transformers_available():
    pytest.importorskip("transformers")


def test_speculative_decode_matches_transformers(tmp_path):
    out = speculative_decode.main([*TINY, "--page-sizes", "1", "16", "--audit-every", "4",
                                   "--out", str(tmp_path)])
    assert out["ok"]
    assert [r["page_size"] for r in out["runs"]] == [1, 16]
    for run in out["runs"]:
        c, s = run["comparison"], run["summary"]
        assert c["tokens_equal"] and c["requests_differing"] == 0, c["first_difference"]
        assert c["tokens_compared"] == sum(len(t) for t in run["tokens"].values())
        assert c["max_logit_diff"] < 1e-3
        # the draft is wrong often and right often: rejections, partial and full acceptance
        assert 0.3 < s["acceptance_rate"] < 0.9
        hist = s["accepted_histogram"]
        assert hist["1"] > 0 and hist["2"] + hist["3"] > 0 and hist["4"] > 0
        assert 1.5 < s["tokens_per_round"] < 4
        # every request's tokens came from rounds whose counts were committed
        assert s["rounds_with_commit"] >= s["rounds"] - 2
        # continuous batching: the batch fills, requests finish and are replaced mid-loop
        lanes = s["series"]["lanes"]
        assert max(lanes) == 4 and lanes.index(4) < len(lanes) - 1
        assert s["requests_released"] == 8
        assert s["swa_pages_evicted"] > 0  # the window is smaller than the prompts
        # no page leaked: audits at midpoints (with live requests) and after every release
        assert len(run["audits_mid"]) >= 2 and all(a["live_requests"] > 0
                                                    for a in run["audits_mid"][:1])
        assert all(a["findings"] == [] for a in run["audits_mid"])
        assert run["audit_findings"] == [] and run["pages_back"]
        assert s["pages_allocated"] == s["pages_freed"]  # prefill + rounds, all given back
    assert {p.name for p in tmp_path.iterdir()} == {"speculative_decode.json",
                                                     "speculative_decode.md", "stamp.json"}


def test_lookahead_zero_is_plain_decoding():
    out = speculative_decode.main([*CONTROL, "--lookahead", "0"])
    assert out["ok"]
    s = out["runs"][0]["summary"]
    assert s["tokens_per_round"] == 1.0 and s["acceptance_rate"] is None


def test_allocator_window_one_too_small_is_caught():
    """W - 2: the step frees the SWA position p + 1 - W that the verify's first query
    (at the committed length) still reads."""
    out = speculative_decode.main([*CONTROL, "--alloc-window", "6"])
    assert not out["ok"]
    c = out["runs"][0]["comparison"]
    assert not c["tokens_equal"] and c["max_logit_diff"] > 1e-2


def test_block_tables_one_token_short_are_caught():
    """The allocator keeps every key, but the step's SWA block tables are planned for
    W - 1: the first verify query's oldest key (position C + 1 - W) is outside them."""
    out = speculative_decode.main([*CONTROL, "--table-window", "7"])
    assert not out["ok"]
    run = out["runs"][0]
    assert run["table_window"] == 7 and not run["comparison"]["tokens_equal"]


def test_committing_one_token_too_many_is_caught():
    """The allocator told one token more than was accepted: its committed length and the
    next round's output lanes run one position ahead of the K/V, so the next round reads
    the (poisoned) K/V of a rejected position through req_to_token."""
    out = speculative_decode.main([*CONTROL, "--commit-extra", "1"])
    assert not out["ok"]
    c = out["runs"][0]["comparison"]
    assert not c["tokens_equal"] and c["max_logit_diff"] > 1e-2


@pytest.mark.parametrize("n_q,ps", [(1, 1), (2, 3), (5, 4)])
def test_block_table_keys_equal_the_full_range_mask(n_q, ps):
    """Keys from block-table rows give every query the same visible slots as the model's
    full-range key table over page-dense ``req_to_token`` / ``full_to_swa``: FULL keys
    ``<= q``, SWA keys ``(q - W, q]`` with evicted pages (SWA page 0) masked."""
    W, ctx, B = 6, 40, 4
    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
                      num_heads=2, num_kv_heads=1, sliding_window=W)
    model = TinyHybridLM(cfg, random_weights(cfg, 0), "cpu")
    g = torch.Generator().manual_seed(n_q)
    width = -(-ctx // ps)
    full_page = (torch.randperm(B * width, generator=g) + 1).view(B, width)  # page 0: sink
    swa_page = (torch.randperm(B * width, generator=g) + 1).view(B, width)
    q0 = torch.tensor([0, 3, 17, ctx - n_q])
    q_pos = q0[:, None] + torch.arange(n_q)[None]
    cols = torch.arange(width)[None, :]
    first = (q0 - W + 1).clamp(min=0) // ps  # each lane's window page: evicted below it
    evicted = cols < (first - torch.tensor([0, 1, 0, 1])).clamp(min=0)[:, None]
    swa_page = torch.where(evicted, 0, swa_page)
    pos = torch.arange(width * ps)
    r2t = full_page[:, pos // ps] * ps + pos % ps  # page-dense rows
    f2s = torch.zeros((B * width + 1) * ps, dtype=torch.int64)
    f2s[r2t.reshape(-1)] = torch.where(swa_page[:, pos // ps] > 0,
                                       swa_page[:, pos // ps] * ps + pos % ps, 0).reshape(-1)
    ours = table_key_table(model, full_page, swa_page, ps, q_pos, ctx)
    full = model.key_table(r2t, f2s, q_pos, ctx, swa_window_keys=False)
    assert ours.swa_slot.shape == (B, W + n_q - 1)
    for b in range(B):
        for q in range(n_q):
            for kind in ("full", "swa"):
                got = getattr(ours, f"{kind}_slot")[b][getattr(ours, f"{kind}_mask")[b, q]]
                ref = getattr(full, f"{kind}_slot")[b][getattr(full, f"{kind}_mask")[b, q]]
                assert sorted(got.tolist()) == sorted(ref.tolist()), (b, q, kind)
            assert int(ours.swa_mask[b, q].sum()) <= W


@pytest.mark.cuda
def test_speculative_rounds_in_one_graph_on_cuda_without_syncs():
    """Allocator step + draft steps + verify + acceptance captured as one CUDA graph per
    descriptor buffer, the loop under set_sync_debug_mode("error") but for the round's one
    read of the accepted counts (and the audits, which read on purpose)."""
    out = speculative_decode.main([*TINY, "--device", "cuda", "--graph", "--sync-debug",
                                   "--page-sizes", "1", "16", "--audit-every", "4"])
    assert out["ok"]
    for run in out["runs"]:
        c, s = run["comparison"], run["summary"]
        assert c["tokens_equal"], c["first_difference"]
        assert 0.3 < s["acceptance_rate"] < 0.9
        assert run["audit_findings"] == [] and run["pages_back"]
        nodes = s["graph_nodes"]
        assert nodes.get("host", 0) == 0, nodes


def test_help(capsys):
    with pytest.raises(SystemExit) as exc:
        speculative_decode.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage" in out and "--table-window" in out
