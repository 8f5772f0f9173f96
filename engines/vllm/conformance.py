"""Conformance: vLLM 0.33's real Scheduler with its own KV-cache manager and with graphalloc's.

Run in the engine environment (``make engines-vllm`` installs it and runs this)::

    python engines/vllm/conformance.py [--out results/engines/vllm-0.33.0] [--only NAME ...]

For every workload (engines/vllm/workloads.py) both schedulers run the same seeded requests
through the same fake runner; every step's scheduled tokens per request, speculative
tokens, preemptions, finished requests and the hit tokens of newly scheduled requests are
compared, then each request's output tokens. Block ids are not compared: graphalloc's are
its own pages (two pools, one per group); the invariant compared instead is the schedule
itself, which depends on vLLM's free-block counts and hits only. Writes ``summary.json``
(``{"workloads": [{"name", "identical", "first_difference", "vllm", "graphalloc"}]}``);
exit status 1 when a workload differs or fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import workloads  # noqa: E402


def compare(name: str) -> dict:
    w = workloads.workload(name)
    row = {"name": name, "identical": False}
    try:
        ours = harness.run(w, "vllm")
        row["vllm"] = ours["stats"]
        theirs = harness.run(w, "graphalloc")
        row["graphalloc"] = theirs["stats"]
    except Exception as exc:  # a failure is a result: recorded, not hidden
        row["error"] = f"{type(exc).__name__}: {exc}"
        row["traceback"] = traceback.format_exc(limit=6)
        return row
    first = None
    for i, (a, b) in enumerate(zip(ours["steps"], theirs["steps"], strict=False)):
        if a != b:
            first = {"step": i, "vllm": a, "graphalloc": b}
            break
    if first is None and len(ours["steps"]) != len(theirs["steps"]):
        first = {"step": min(len(ours["steps"]), len(theirs["steps"])), "note": "lengths"}
    row["steps_compared"] = len(ours["steps"])
    row["outputs_equal"] = ours["outputs"] == theirs["outputs"]
    row["first_difference"] = first
    row["identical"] = first is None and row["outputs_equal"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/engines/vllm-0.33.0")
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    names = args.only or list(workloads.WORKLOADS)
    rows = []
    for name in names:
        row = compare(name)
        rows.append(row)
        print(f"{name:22s} identical={row['identical']} vllm={row.get('vllm')} "
              f"graphalloc={row.get('graphalloc')} {row.get('error', '')}", flush=True)
    import vllm

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    summary = {"vllm": vllm.__version__, "commit": commit, "machine": platform.platform(),
               "python": platform.python_version(), "workloads": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
