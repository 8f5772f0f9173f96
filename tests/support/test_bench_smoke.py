"""CPU smoke test of benchmarks/: the quick run writes every output, and the baselines
compute what the fused op computes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")


def _load(name: str):
    """A benchmarks/ module under a private name (benchmarks/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", os.path.join(BENCH,
                                                                                 f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_writes_every_output(tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, os.path.join(BENCH, "bench_frees.py"), "--quick", "--device", "cpu",
           "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    expected = ["bench_frees.json", "bench_frees.md", "trace_eager_8frees.json",
                "trace_graphalloc_8frees.json", "stamp.json"]  # stamp: benchmarks/provenance.py
    if importlib.util.find_spec("matplotlib") is not None:  # the [bench] extra
        expected += ["single_free.png", "step_frees.png", "step_frees_decode.png"]
    assert sorted(os.listdir(out)) == sorted(expected)
    res = json.loads((out / "bench_frees.json").read_text())
    for key in ("command", "machine", "config", "floor", "copy_bandwidth", "single_free",
                "steps", "plan_profile", "traces", "targets", "skipped", "errors"):
        assert key in res, key
    assert res["errors"] == []
    assert res["machine"]["torch"] == torch.__version__
    assert res["config"]["device_clock"] == "cpu-wall"

    impls = {r["impl"] for r in res["single_free"]}
    assert {"eager", "graphalloc"} <= impls
    for rec in res["single_free"] + res["steps"]:
        assert rec["cpu_us"]["p50"] > 0 and rec["gpu_us"]["p50"] > 0
        assert set(rec["cpu_us"]) >= {"p20", "p50", "p80", "n"}
    decode = [r for r in res["steps"] if r["decode"]]
    assert decode and len(decode) < len(res["steps"])
    for rec in res["steps"]:
        if rec["impl"] == "graphalloc":  # every timed step freed live pages, checked
            assert rec["workload"]["swa_pages_freed"] == (rec["workload"]["steps"] * rec["B"]
                                                          * rec["pages"])
            assert rec["plan_us"]["p50"] > 0
    eager_counts = [r["launches"]["aten_ops"] for r in res["single_free"]
                    if r["impl"] == "eager"]
    assert set(eager_counts) == {3, 8}  # page_size 1 and page_size > 1
    assert set(res["plan_profile"]) == {"frees", "decode"}
    assert all(t["ok"] is None for t in res["targets"])  # never judged without CUDA

    md = (out / "bench_frees.md").read_text()
    for heading in ("## Headline", "## Targets", "## 1. Single segment free",
                    "## 2. A step of B segment frees", "## 3. A step of B segment frees and B",
                    "## 4. Launches per step and graph nodes", "## Notes",
                    "Where graphalloc's planning time goes"):
        assert heading in md, heading
    trace = json.loads((out / "trace_eager_8frees.json").read_text())
    names = [e.get("name", "") for e in trace.get("traceEvents", [])]
    assert sum(n.startswith("eager free") for n in names) == 8


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_eager_baseline_matches_expected_and_twin(page_size):
    baselines = _load("baselines")
    tables = baselines.FreeTables(5, 4, page_size, "cpu", seed=page_size)
    twin = None
    try:
        from graphalloc.kernels.get_and_clear import get_and_clear_swa_pages_torch as twin
    except ImportError:
        pass
    for r, reps in enumerate(tables.representatives):
        swa_pages, mapped = baselines.eager_get_and_clear_swa_pages(reps, tables.full_to_swa,
                                                                    page_size)
        assert mapped.all()
        assert torch.equal(swa_pages, tables.expected_swa_pages[r])
    assert not tables.full_to_swa.any()  # every mapped page was cleared whole
    if twin is not None:
        tables.restore()
        for reps in tables.representatives:
            a = twin(reps, tables.full_to_swa.clone(), page_size)
            b = baselines.eager_get_and_clear_swa_pages(reps, tables.full_to_swa, page_size)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_eager_decode_allocation():
    baselines = _load("baselines")
    ps, n = 4, 9
    t = baselines.DecodeTables(n, ps, "cpu")
    full_slot, swa_slot = t.step()
    starts = [i for i in range(n) if i % ps == 0]  # these pop pages 1 + 2n, 2 + 2n, ...
    for k, i in enumerate(starts):
        assert full_slot[i] == (1 + 2 * n + k) * ps
    for i in range(n):
        if i % ps:
            assert full_slot[i] == (1 + n + i) * ps + i % ps  # continues its second page
        assert t.req_to_token[i, ps + i % ps] == full_slot[i]
        assert t.full_to_swa[full_slot[i]] == swa_slot[i]
    again = t.step()  # idempotent: the free lists are not advanced
    assert torch.equal(again[0], full_slot)


def test_targets_are_judged_only_on_cuda_events():
    report = _load("report")

    def stats(v):
        return {"p20": v, "p50": v, "p80": v, "n": 1}

    steps = []
    for impl, gpu, cpu in (("eager", 400.0, 2000.0), ("fused", 100.0, 1500.0),
                           ("graphalloc", 5.0, 12.0)):
        steps.append({"impl": impl, "B": 256, "page_size": 16, "pages": 1, "decode": False,
                      "gpu_us": stats(gpu), "cpu_us": stats(cpu)})
    res = {"config": {"headline_b": 256, "step_ps": [16], "step_pages": [1],
                      "device_clock": "cuda-events"},
           "floor": {"gpu_us": stats(4.0), "cpu_us": stats(3.0)}, "steps": steps,
           "single_free": [{"impl": "graphalloc", "page_size": 128, "pages": 1024,
                            "clear_gb_per_s": 1000.0}],
           "copy_bandwidth": {"gb_per_s": 4000.0}}
    verdicts = {(t["target"]): t["ok"] for t in report.targets(res)}
    assert verdicts["graphalloc GPU / floor"] is True  # 1.25 <= 1.5
    assert verdicts["graphalloc host us per step"] is True  # 12 <= 15
    assert verdicts["host: fused loop / graphalloc"] is True  # 125 >= 100
    assert verdicts["GPU: eager loop / graphalloc"] is True  # 80 >= 20
    assert verdicts["graphalloc clear bandwidth / copy bandwidth"] is False  # 0.25 < 0.5
    assert verdicts["fused clear bandwidth / copy bandwidth"] is None  # not measured
    res["config"]["device_clock"] = "cpu-wall"
    assert all(t["ok"] is None for t in report.targets(res))
