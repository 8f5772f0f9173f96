"""CPU smoke test of benchmarks/bench_page_tables.py: the quick run finishes in seconds and
writes every output, and its eager baseline (the way engines build the tables today) builds
exactly the tables the allocator writes inside its step -- on awkward sizes too -- or the
comparison says they differ."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")


def _load(name: str):
    """A benchmarks/ module under a private name (benchmarks/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}",
                                                  os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_writes_every_output(tmp_path):
    bench = _load("bench_page_tables")
    out = tmp_path / "bench"
    assert bench.main(["--quick", "--device", "cpu", "--no-progress", "--out", str(out)]) == 0
    assert set(os.listdir(out)) == {"bench_page_tables.json", "bench_page_tables.md",
                                    "stamp.json"}
    res = json.loads((out / "bench_page_tables.json").read_text())
    assert res["errors"] == [] and res["device_clock"] == "cpu-wall"
    assert res["machine"]["torch"] == torch.__version__
    assert [r["b"] for r in res["cases"]] == [4, 8]
    for r in res["cases"]:
        assert r["outputs_equal"] and all(r["buffers_equal"].values())
        assert r["same_allocator_state"]
        assert set(r["gpu_us"]) == set(bench.VARIANTS) == set(r["host_us"])
        assert all(s["n"] == 3 for s in r["gpu_us"].values())
        for clock in ("device", "host"):
            q = r["ratios"][clock]
            assert q["step_tables / step"] > 0 and q["step_eager / step_tables"] > 0
        assert 0 < r["pages"]["swa"] < r["pages"]["full"]
    md = (out / "bench_page_tables.md").read_text()
    assert md.count("| True |") == 2 and "step_eager" in md


def test_eager_baseline_equals_the_in_step_tables_on_awkward_sizes():
    """The baseline is only a baseline if it builds what the step builds: page sizes 1 and
    3, a window longer than some lengths, decode steps with window evictions; and a baseline
    one key off in its window is caught."""
    bench = _load("bench_page_tables")
    dev = torch.device("cpu")
    for b, ps, window in ((5, 1, 7), (6, 3, 10), (3, 16, 100)):
        p = dict(bench.QUICK, ps=ps, window=window, max_context=48 * ps, median_len=12 * ps,
                 samples=2, warmup=0, prefill_step_tokens=40 * ps, prefill_row_tokens=9 * ps)
        st = bench.EngineState(b, p, dev, "torch", seed=b)
        spec = st.spec.resolve(st.cfg)
        eager = bench.EagerTables(st.allocs["step_eager"], spec, dev, window)
        short = bench.EagerTables(st.allocs["step_eager"], spec, dev, window - 1)
        caught = 0
        for _ in range(6):
            pl = {v: a.plan(evict_all=True, decode=st.rows) for v, a in st.allocs.items()}
            for v, a in st.allocs.items():
                a.run(pl[v])
            for e in (eager, short):
                e.fill(st.rows, st.seq_lens())
                e.run()
            equal = bench.compare_tables(st.tables, eager, pl["step_tables"].tables)
            assert all(equal.values()), (b, ps, window, equal)
            # one key short moves a lane's SWA start a page only where L - W + 1 is a page
            # boundary: exactly then the comparison must fail
            L = st.seq_lens()
            moved = bool(((L >= window) & ((L - window + 1) % ps == 0)).any())
            differ = not all(bench.compare_tables(st.tables, short,
                                                  pl["step_tables"].tables).values())
            assert differ == moved, (b, ps, window, L)
            caught += differ
        assert np.array_equal(st.allocs["step"].seq_lens(), st.allocs["step_tables"].seq_lens())
        assert caught or ps > 1, (b, ps, window)


def test_help(capsys):
    bench = _load("bench_page_tables")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage" in out and "--quick" in out and "--no-progress" in out
