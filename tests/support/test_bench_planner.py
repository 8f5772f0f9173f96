"""bench_planner.py's quick run: both planners agree, and the "before" column is read from an
earlier run's data (its compiled plan p50, named by the commit its stamp resolves to)."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_planner  # noqa: E402

sys.path.pop(0)
COMMITTED = os.path.join(ROOT, "results", "bench", "planner-cpu")


@pytest.mark.skipif(not bench_planner.twin.AVAILABLE, reason="compiled planner not built")
def test_quick_run_takes_its_before_column_from_an_earlier_run(tmp_path):
    earlier = tmp_path / "earlier"
    shutil.copytree(COMMITTED, earlier)
    with open(earlier / "bench_planner.json") as f:
        doc = json.load(f)
    doc["results"][0]["compiled"]["plan"]["p50"] = 123.4  # decode B = 16: a marked value
    (earlier / "bench_planner.json").write_text(json.dumps(doc))
    out = tmp_path / "now"
    assert bench_planner.main(["--quick", "--device", "cpu", "--no-progress", "--out",
                               str(out), "--before", str(earlier / "bench_planner.json")]) == 0
    res = json.loads((out / "bench_planner.json").read_text())
    assert res["before"]["commit"] == "49eff60"  # the earlier folder's stamp, resolved
    assert res["before"]["plan_p50_us"]["decode 16"] == 123.4
    md = (out / "bench_planner.md").read_text()
    assert "| before (49eff60) |" in md
    row = next(line for line in md.splitlines() if line.startswith("| decode | 16 |"))
    assert "| 123.4 |" in row
    assert all(r["identical"] and r["all_compiled"] for r in res["results"])
    assert json.loads((out / "stamp.json").read_text())["command"].startswith(
        "python benchmarks/bench_planner.py")


@pytest.mark.skipif(not bench_planner.twin.AVAILABLE, reason="compiled planner not built")
def test_without_an_earlier_run_there_is_no_before_figure(tmp_path):
    assert bench_planner.main(["--quick", "--device", "cpu", "--no-progress", "--out",
                               str(tmp_path)]) == 0
    md = (tmp_path / "bench_planner.md").read_text()
    assert "No `--before` run given." in md
    row = next(line for line in md.splitlines() if line.startswith("| decode | 16 |"))
    assert row.split("|")[-3].strip() == ""  # the before cell: empty, never a constant
