"""The committed results tree: every run folder says what ran, docs/results.md indexes every
one of them with links that resolve, and every committed plot redraws from its JSON."""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "results")
INDEX = os.path.join(ROOT, "docs", "results.md")
KINDS = ("gpu-suite", "bench", "examples", "engines")


def run_folders() -> list[str]:
    """``results/<kind>/<run>``: one folder per run (subfolders are parts of a run)."""
    return sorted(os.path.join(kind, run) for kind in KINDS
                  for run in os.listdir(os.path.join(RESULTS, kind))
                  if os.path.isdir(os.path.join(RESULTS, kind, run)))


def test_only_the_four_kinds_of_results():
    assert sorted(e for e in os.listdir(RESULTS) if e != "README.md") == sorted(KINDS)


@pytest.mark.parametrize("run", run_folders())
def test_every_run_folder_says_what_ran_where_and_on_which_commit(run):
    path = os.path.join(RESULTS, run, "README.md")
    assert os.path.exists(path), f"{run} has no README.md"
    with open(path) as f:
        text = f.read()
    for fact in ("What", "Command", "Machine", "Commit"):
        assert f"**{fact}" in text, f"{run}/README.md does not state its {fact.lower()}"


def test_the_index_links_every_run_and_every_link_resolves():
    with open(INDEX) as f:
        text = f.read()
    links = re.findall(r"\]\(([^)#]+)\)", text)
    broken = [link for link in links if not link.startswith("http")
              and not os.path.exists(os.path.join(os.path.dirname(INDEX), link))]
    assert not broken, f"docs/results.md links to missing paths: {broken}"
    linked = {os.path.normpath(os.path.join("docs", link)) for link in links}
    missing = [run for run in run_folders()
               if os.path.normpath(os.path.join("results", run)) not in linked]
    assert not missing, f"runs not in docs/results.md: {missing}"


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib (the [bench] extra) is not installed")
def test_every_committed_plot_redraws_from_its_json(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import replot
    finally:
        sys.path.pop(0)
    kept = sorted(os.path.relpath(os.path.join(folder, name), RESULTS)
                  for folder, _, files in os.walk(RESULTS) for name in files
                  if name.endswith(".png"))
    drawn = []
    for path in replot.committed_results(RESULTS):
        out = tmp_path / os.path.relpath(os.path.dirname(path), RESULTS)
        folder = os.path.dirname(path)
        for png in replot.replot(path, str(out)):
            rel = os.path.relpath(os.path.join(folder, os.path.basename(png)), RESULTS)
            if rel in kept:
                drawn.append(rel)
    assert sorted(drawn) == kept, "committed plots with no JSON to redraw them from"
