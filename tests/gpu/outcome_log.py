"""pytest plugin of tests/gpu/run_gpu_suite.sh: every test's outcome as one JSON line,
appended the moment it is known, so a phase cut off by its time bound still has counts.

    GRAPHALLOC_PHASE_LOG=FILE python -m pytest -p outcome_log ...   (tests/gpu on PYTHONPATH)

Lines: ``{"selected": N}`` once collection is done, then ``{"nodeid", "outcome",
"duration"}`` per test (outcome: passed, failed, error, skipped, xfailed, xpassed), then
``{"exitstatus": S}`` if the session ends by itself. Without the variable it does nothing.
"""

from __future__ import annotations

import json
import os


def _write(record: dict) -> None:
    path = os.environ.get("GRAPHALLOC_PHASE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def pytest_collection_finish(session) -> None:
    _write({"selected": len(session.items)})


def pytest_runtest_logreport(report) -> None:
    if report.when == "call":
        outcome = report.outcome
    elif report.outcome == "skipped" and report.when == "setup":
        outcome = "skipped"  # skip markers take effect at set-up
    elif report.outcome == "failed":
        outcome = "error"  # a fixture failed in set-up or teardown
    else:
        return
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.outcome == "skipped" else "xpassed"
    _write({"nodeid": report.nodeid, "when": report.when, "outcome": outcome,
            "duration": round(report.duration, 3)})


def pytest_sessionfinish(session, exitstatus) -> None:
    _write({"exitstatus": int(exitstatus)})
