"""The decode-loop example attending through the page tables, at tiny sizes.

``examples/model_loops/decode_loop.py --attention tables`` (the default): the allocator is built
with
``page_tables=PageTableSpec(max_batch, forms=("csr",), model_window=W)``, so each decode
step's own launch writes the FULL and SWA CSR page tables of its batch (its decode rows)
after its allocations, and every attention layer reads K/V only through those tables (the
Torch twin of the paged kernel on a CPU; one run with the Triton kernels through the
interpreter). Every token must equal transformers' for page
sizes 1 and 16 with a window smaller than the prompts, and both negative controls must
change tokens: an allocator window one token too small (it frees a position the SWA layers
read; the tables then start at the frontier, clipped) and a table/attention window one
token too small (the SWA tables and the mask drop a position the model reads).

On a CPU everything runs eagerly (the suite's tests); on a GPU the same tests run eagerly
on CUDA, and the ``cuda`` test captures each step (allocator step with its page tables +
model + argmax) as one CUDA graph per descriptor buffer under
``set_sync_debug_mode("error")``.
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

import decode_loop  # noqa: E402

TINY = ["--requests", "10", "--max-batch", "5", "--prompt-len", "3", "30", "--output-len", "6",
        "36", "--window", "8", "--vocab", "128", "--no-progress", "--out", ""]
SMALL = [*TINY, "--requests", "4", "--page-sizes", "1"]


@pytest.fixture(scope="module", autouse=True)
def transformers_available():
    pytest.importorskip("transformers")


def test_tables_decode_loop_matches_transformers(tmp_path):
    out = decode_loop.main([*TINY, "--attention", "tables", "--page-sizes", "1", "16",
                            "--out", str(tmp_path)])
    assert out["ok"]
    assert [r["page_size"] for r in out["runs"]] == [1, 16]
    for run in out["runs"]:
        c, s = run["comparison"], run["summary"]
        assert run["attention"] == "tables" and run["attention_window"] == 8
        # the paged Triton kernel on a GPU, its Torch twin on a CPU
        assert run["attention_backend"] == ("triton" if torch.cuda.is_available() else "torch")
        assert c["tokens_equal"] and c["requests_differing"] == 0, c["first_difference"]
        assert c["tokens_compared"] == sum(len(t) for t in run["tokens"].values())
        assert c["max_logit_diff"] < 1e-3
        assert s["swa_clipped_lanes"] == 0  # the SWA tables always reach back to L - W
        # the loop exercised what it claims: evictions, releases, admissions mid-loop
        assert s["steps_with_evictions"] > (0.8 if run["page_size"] == 1 else 0.15) * s["steps"]
        assert s["requests_released"] == 10
        lanes = s["series"]["decode_lanes"]
        assert max(lanes) == 5 and lanes.index(5) < len(lanes) - 1
        assert s["pages_allocated"] == s["pages_freed"]
    md = (tmp_path / "decode_loop.md").read_text()
    assert "attention=tables" in md


def test_tables_fail_with_an_allocator_window_one_token_too_small():
    """The allocator frees position L - W while the model reads it: the SWA tables start at
    the frontier (clipped lanes), the key is missing, tokens change."""
    out = decode_loop.main([*SMALL, "--alloc-window", "6"])
    assert not out["ok"]
    run = out["runs"][0]
    assert run["summary"]["swa_clipped_lanes"] > 0
    assert not run["comparison"]["tokens_equal"]
    assert run["comparison"]["max_logit_diff"] > 1e-2


def test_tables_fail_with_a_table_window_one_token_too_small():
    """The allocator keeps everything, but the SWA tables and the attention mask use W - 1:
    position L - W is dropped, tokens change."""
    out = decode_loop.main([*SMALL, "--attention-window", "7"])
    assert not out["ok"]
    run = out["runs"][0]
    assert run["attention_window"] == 7 and run["summary"]["swa_clipped_lanes"] == 0
    assert not run["comparison"]["tokens_equal"]


def test_gather_mode_still_matches():
    out = decode_loop.main([*SMALL, "--attention", "gather"])
    assert out["ok"] and out["runs"][0]["attention"] == "gather"
    assert out["runs"][0]["summary"]["swa_clipped_lanes"] is None


def test_tables_with_triton_kernels_through_the_interpreter():
    """The GPU path's kernels (allocator step, page tables, paged attention) all in Triton,
    run by the interpreter: tokens still equal transformers'."""
    out = decode_loop.main(["--requests", "3", "--max-batch", "2", "--prompt-len", "3", "20",
                            "--output-len", "4", "10", "--window", "8", "--vocab", "64",
                            "--hidden", "32", "--page-sizes", "16", "--backend", "triton",
                            "--attention-backend", "triton", "--no-progress", "--out", ""])
    assert out["ok"]
    run = out["runs"][0]
    assert run["attention_backend"] == "triton" and run["comparison"]["tokens_equal"]


@pytest.mark.cuda
def test_tables_in_one_graph_per_step_on_cuda_without_syncs():
    out = decode_loop.main([*TINY, "--device", "cuda", "--graph", "--sync-debug",
                            "--page-sizes", "1", "16"])
    assert out["ok"]
    for run in out["runs"]:
        assert run["attention"] == "tables" and run["attention_backend"] == "triton"
        assert run["host_syncs_in_loop"] == 0
        assert run["comparison"]["tokens_equal"], run["comparison"]["first_difference"]
        assert run["summary"]["swa_clipped_lanes"] == 0
        nodes = run["summary"]["graph_nodes"]
        assert nodes.get("host", 0) == 0, nodes  # ("error" only where nodes can't be read)


def test_table_modes_need_an_allocator_that_writes_the_tables():
    """``attention="tables"`` reads ``alloc.tables``: an allocator built without
    ``page_tables=`` (or with another batch size) is refused before anything runs."""
    from hybrid_model import ModelConfig, TinyHybridLM, random_weights
    from paged_decode import DecodeLoop

    mcfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
                       num_heads=2, num_kv_heads=1, sliding_window=8)
    model = TinyHybridLM(mcfg, random_weights(mcfg, 0), "cpu")
    kw = dict(page_size=4, max_batch=3, max_prompt=8, max_total=16, alloc_window=7,
              device="cpu", backend="torch")
    for tables_window, batch, match in ((None, 3, "page_tables=decode_tables_spec"),
                                        (8, 4, "3 lanes, the loop 4")):
        alloc = decode_loop.build_allocator(**kw, tables_window=tables_window)
        with pytest.raises(ValueError, match=match):
            DecodeLoop(model, alloc, max_batch=batch, n_serials=2, max_out=4,
                       attention="tables")
