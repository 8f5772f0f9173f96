"""The examples and the decode-loop benchmark, run on the CPU at tiny sizes.

* ``examples/model_loops/decode_loop.py``: a hybrid SWA/full decoder paged through graphalloc
  generates token for token what transformers generates with its own cache, for
  page sizes 1 and 16, with window evictions, releases and admissions mid-loop;
  and the check can fail: an allocator window one token too small (it frees a
  position the SWA layers still read) must be caught.
* ``examples/replay_batched_frees.py``: the demo's summary is a conservation law
  (everything allocated is freed, every pool ends full) with zero device reads in
  the loop and integrity checks passing.
* ``benchmarks/bench_decode_loop.py``: runs (smoke test).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "examples" / "model_loops"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import decode_loop  # noqa: E402
import replay_batched_frees  # noqa: E402

TINY = ["--requests", "10", "--max-batch", "5", "--prompt-len", "3", "30", "--output-len", "6",
        "36", "--window", "8", "--vocab", "128", "--no-progress", "--out", ""]


@pytest.fixture(scope="module")
def transformers_available():
    pytest.importorskip("transformers")


def test_decode_loop_matches_transformers(transformers_available, tmp_path):
    out = decode_loop.main([*TINY, "--page-sizes", "1", "16", "--out", str(tmp_path)])
    assert out["ok"]
    assert [r["page_size"] for r in out["runs"]] == [1, 16]
    for run in out["runs"]:
        c, s = run["comparison"], run["summary"]
        assert c["tokens_equal"] and c["requests_differing"] == 0, c["first_difference"]
        assert c["tokens_compared"] == sum(len(t) for t in run["tokens"].values())
        assert c["max_logit_diff"] < 1e-3
        # the loop exercised what it claims: evictions, releases, admissions mid-loop
        assert s["steps_with_evictions"] > (0.8 if run["page_size"] == 1 else 0.15) * s["steps"]
        assert s["requests_released"] == 10
        lanes = s["series"]["decode_lanes"]
        assert max(lanes) == 5 and lanes.index(5) < len(lanes) - 1
        assert s["pages_allocated"] == s["pages_freed"]  # every request released
        assert s["memory_saved_at_peak"] > 0.1
    assert {p.name for p in tmp_path.iterdir()} <= {"decode_loop.json", "decode_loop.md",
                                                     "stamp.json",
                                                     "decode_loop.png"}


def test_decode_loop_comparison_can_fail(transformers_available):
    """One token less of allocator window frees position L - W + 1 while the SWA layers
    still read it: the logits (and tokens) must differ from transformers'."""
    args = [*TINY, "--requests", "4", "--page-sizes", "1", "--alloc-window", "6"]
    out = decode_loop.main(args)
    assert not out["ok"]
    c = out["runs"][0]["comparison"]
    assert c["max_logit_diff"] > 1e-2
    assert not c["tokens_equal"]


@pytest.mark.parametrize("ps,window", [(1, 32), (16, 64)])
def test_replay_batched_frees_summary_is_conserved(ps, window):
    s = replay_batched_frees.main([
        "--steps", "300", "--page-size", str(ps), "--window", str(window),
        "--concurrency", "12", "--prompt-median", "48", "--output-median", "40",
        "--max-prompt", "512", "--max-output", "256", "--chunk", "64", "--prefill-budget", "128",
        "--check-every", "100", "--no-progress"])
    assert s["steps"] == 301
    assert s["host_syncs_in_loop"] == 0
    assert s["invariant_checks_passed"] == 4  # steps 100, 200, 300 and the end
    assert s["requests_admitted"] == s["requests_released"] > 12
    # conservation: what was allocated was freed, and every pool ends full
    assert s["pages_allocated"] == {k: s["pages_freed"][k] for k in ("full", "swa")}
    assert s["free_pages_at_end"] == s["pool_pages"]
    assert 0 < s["pages_freed"]["swa_by_window"] < s["pages_freed"]["swa"]
    assert s["pages_allocated"]["full"] >= s["tokens_allocated"] / ps
    assert s["release_segments"] >= s["requests_released"]
    assert s["steps_with_evictions"] > (0.9 if ps == 1 else 0.3) * s["steps"]


def test_bench_decode_loop_smoke(tmp_path):
    import bench_decode_loop
    out = bench_decode_loop.main(["--device", "cpu", "--batch", "3", "--requests", "4",
                                  "--repeats", "1", "--prompt-len", "4", "12", "--output-len",
                                  "8", "16", "--hidden", "32", "--vocab", "64", "--window", "8",
                                  "--out", str(tmp_path)])
    (r,) = out["results"]
    assert r["variant"] == "eager" and r["steps"] > 0 and r["tokens_equal_across_variants"]
    assert len(list(tmp_path.iterdir())) <= 4


@pytest.mark.parametrize("module", [decode_loop, replay_batched_frees])
def test_help(module, capsys):
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0
    assert "usage" in capsys.readouterr().out
