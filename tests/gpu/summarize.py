"""Summary of a tests/gpu/run_gpu_suite.sh run: OUTDIR/summary.md and OUTDIR/summary.json.

    python3 tests/gpu/summarize.py OUTDIR [BUDGET_S]

Reads ``OUTDIR/phases.tsv`` (one line per finished phase: name, exit status, time bound,
wall seconds, kind), each pytest phase's ``<name>.outcomes.jsonl`` (tests/gpu/outcome_log.py)
and each sanitizer phase's log. Run after every phase, so an interrupted run still has one.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter

OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")


def status_of(rc: int, kind: str, counts: dict) -> str:
    if rc in (124, 137):
        return "TIMEOUT"
    if rc == 5 and kind == "pytest":
        return "NO TESTS"
    if rc != 0:
        return "FAIL"
    if kind == "pytest" and counts.get("failed", 0) + counts.get("error", 0):
        return "FAIL"
    return "pass"


def pytest_counts(path: str) -> tuple[dict, list]:
    counts: Counter = Counter()
    durations = []
    selected = None
    finished = False
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if "selected" in rec:
                    selected = rec["selected"]
                elif "exitstatus" in rec:
                    finished = True
                else:
                    counts[rec["outcome"]] += 1
                    durations.append((rec["duration"], rec["nodeid"]))
    out = {k: counts.get(k, 0) for k in OUTCOMES}
    out["selected"] = selected
    out["ran"] = sum(counts.values())
    out["session_finished"] = finished
    return out, sorted(durations, reverse=True)[:5]


def sanitizer_counts(log: str) -> dict:
    text = open(log).read() if os.path.exists(log) else ""
    out = {"ran_to_end": "sanitize_kernels: all kernels ran on every row kind" in text}
    m = re.search(r"ERROR SUMMARY: (\d+) error", text)
    if m:
        out["errors"] = int(m.group(1))
    m = re.search(r"RACECHECK SUMMARY: (\d+) hazards displayed \((\d+) errors, (\d+) warnings\)",
                  text)
    if m:
        out["hazards"], out["errors"], out["warnings"] = map(int, m.groups())
    return out


def main(out_dir: str, budget_s: float | None) -> int:
    phases = []
    tsv = os.path.join(out_dir, "phases.tsv")
    if os.path.exists(tsv):
        with open(tsv) as f:
            for line in f:
                name, rc, bound, wall, kind = line.rstrip("\n").split("\t")
                rec = {"name": name, "kind": kind, "rc": int(rc), "bound_s": int(bound),
                       "wall_s": float(wall), "log": f"{name}.log"}
                if kind == "pytest":
                    rec["counts"], rec["slowest"] = pytest_counts(
                        os.path.join(out_dir, f"{name}.outcomes.jsonl"))
                elif kind == "sanitizer":
                    rec["counts"] = sanitizer_counts(os.path.join(out_dir, f"{name}.log"))
                else:
                    rec["counts"] = {}
                rec["status"] = status_of(rec["rc"], kind, rec["counts"])
                phases.append(rec)
    total = sum(p["wall_s"] for p in phases)
    ok = bool(phases) and all(p["status"] == "pass" for p in phases)
    summary = {"ok": ok, "total_wall_s": round(total, 1), "budget_s": budget_s,
               "within_budget": None if budget_s is None else total <= budget_s,
               "phases": phases}
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)

    lines = ["# GPU suite summary", "",
             f"Verdict: {'PASS' if ok else 'FAIL'}; total wall {total:.1f} s"
             + (f" (budget {budget_s:.0f} s: {'within' if total <= budget_s else 'OVER'})"
                if budget_s else ""), "",
             "| phase | status | exit | wall s | bound s | passed | failed | errors | skipped "
             "| ran / selected | log |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in phases:
        c = p["counts"]
        if p["kind"] == "pytest":
            cells = [c["passed"], c["failed"], c["error"], c["skipped"],
                     f"{c['ran']} / {c['selected'] if c['selected'] is not None else '?'}"]
        elif p["kind"] == "sanitizer":
            cells = ["ran to end" if c.get("ran_to_end") else "-", "-", c.get("errors", "?"),
                     "-", f"hazards {c['hazards']}" if "hazards" in c else "-"]
        else:
            cells = ["-"] * 5
        lines.append(f"| {p['name']} | {p['status']} | {p['rc']} | {p['wall_s']:.1f} | "
                     f"{p['bound_s']} | " + " | ".join(map(str, cells)) + f" | {p['log']} |")
    slow = [(p["name"], d, n) for p in phases for d, n in p.get("slowest", [])]
    if slow:
        lines += ["", "Slowest tests per phase (s):", ""]
        lines += [f"* {name}: {d:.1f} {n}" for name, d, n in slow]
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else None))
