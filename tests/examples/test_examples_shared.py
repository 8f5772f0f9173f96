"""The decode-loop example with a shared system prompt served from the prefix cache.

``examples/model_loops/decode_loop.py --shared-prompt N``: every prompt starts with the same N
tokens;
the first request prefills them and inserts them into ``alloc.prefix_cache``, every later
one is admitted on the cached handle and prefills only the rest of its prompt, attending
over the shared KV through ``req_to_token`` / ``full_to_swa``. Every token must still equal
transformers' (page sizes 1 and 16, a window smaller than the prompts), prefill tokens and
KV pages must be saved, and ``alloc.audit()`` must be empty with the cache held and after
``prefix_cache.drop_all()``.
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

TINY = ["--requests", "10", "--max-batch", "5", "--prompt-len", "3", "30", "--output-len", "6",
        "36", "--window", "8", "--vocab", "128", "--no-progress", "--out", ""]


@pytest.fixture(scope="module", autouse=True)
def transformers_available():
    pytest.importorskip("transformers")


def test_shared_prompt_from_prefix_cache_matches_transformers(tmp_path):
    n_prefix = 20  # one whole page at page size 16, 20 pages at page size 1
    out = decode_loop.main([*TINY, "--page-sizes", "1", "16", "--shared-prompt", str(n_prefix),
                            "--out", str(tmp_path)])
    assert out["ok"]
    assert [r["page_size"] for r in out["runs"]] == [1, 16]
    for run in out["runs"]:
        ps, c, sh = run["page_size"], run["comparison"], run["sharing"]
        assert c["tokens_equal"] and c["requests_differing"] == 0, c["first_difference"]
        assert c["max_logit_diff"] < 1e-3
        cached = n_prefix // ps * ps
        assert sh["cached_prefix_tokens"] == cached
        # every request carries the prompt; all but the first share it
        assert sh["requests_carrying"] == 10 and sh["requests_sharing"] == 9
        assert sh["prefill_tokens_saved"] == 9 * cached > 0
        assert sh["pages_saved"]["full"] == sh["pages_saved"]["swa"] == 9 * (cached // ps) > 0
        assert sh["cache_dropped_pages"] == sh["cache_tombstoned_pages"] == 0
        assert sh["audit_with_cache"] == [] and sh["audit_after_drop"] == []
        assert sh["pages_used_after_drop"] == {"full": 0, "swa": 0}
        # the window is smaller than every prompt: SWA pages of the shared prefix evicted
        assert run["summary"]["swa_pages_evicted"] > 0
    md = (tmp_path / "decode_loop.md").read_text()
    assert "Shared system prompt of 20 tokens" in md and "| [] / [] |" in md


def test_shared_prompt_off_by_default():
    out = decode_loop.main([*TINY, "--requests", "2", "--page-sizes", "16", "--no-reference"])
    assert out["config"]["args"]["shared_prompt"] == 0
    assert all("sharing" not in run for run in out["runs"])
