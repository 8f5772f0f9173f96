"""CPU smoke test of benchmarks/bench_page_tables.py: the quick run finishes in seconds,
writes every output, and its eager baseline builds the same CSR tables as the page tables."""

from __future__ import annotations

import importlib.util
import json
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    assert bench.main(["--quick", "--device", "cpu", "--out", str(out)]) == 0
    expected = {"bench_page_tables.json", "bench_page_tables.md"}
    if importlib.util.find_spec("matplotlib") is not None:
        expected.add("bench_page_tables.png")
    assert set(os.listdir(out)) == expected
    res = json.loads((out / "bench_page_tables.json").read_text())
    assert res["errors"] == [] and res["device_clock"] == "cpu-wall"
    assert res["machine"]["torch"] == torch.__version__
    assert [(r["b"], r["ps"]) for r in res["cases"]] == [(1, 16), (8, 16)]
    for r in res["cases"]:
        assert r["outputs_equal"]
        assert set(r["gpu_us"]) == {"tables_csr", "tables_all", "eager", "floor"}
        assert all(s["n"] == 3 for s in r["gpu_us"].values())
        assert r["ratios"]["eager / tables_csr"] > 0
        assert r["ratios"]["eager_graph / tables_csr"] is None  # no CUDA graphs on a CPU
        assert r["pages"]["swa"] < r["pages"]["full"]
    md = (out / "bench_page_tables.md").read_text()
    assert md.count("| 16 |") == 2 and "eager" in md


def test_eager_baseline_matches_page_tables_on_awkward_sizes():
    """The baseline is only a baseline if it builds what the page tables build: ps 1 and 3,
    a window longer than some lengths, frontiers lagging the window."""
    bench = _load("bench_page_tables")
    from graphalloc.attention.page_tables import PageTables, PageTableSpec

    dev = torch.device("cpu")
    for b, ps, window in ((5, 1, 7), (6, 3, 10), (3, 16, 100)):
        wl = bench.TableWorkload(b, ps, 48 * ps, window, 12 * ps, dev, seed=b)
        spec = PageTableSpec(max_batch=b, page_size=ps, sliding_window=window,
                             max_context_len=wl.max_context, forms=("csr",), backend="torch")
        pt = PageTables(spec, wl.req_to_token, wl.full_to_swa)
        planned = pt.plan(wl.rows, wl.seq_len, wl.frontier)
        pt.run(planned)
        eager = bench.EagerTables(wl, dev)
        eager.fill()
        eager.run()
        assert planned.n_swa_clipped == 0
        assert bench.same_tables(pt, eager, planned), (b, ps, window)
