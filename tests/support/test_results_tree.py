"""The committed results tree: every run folder says what ran, docs/results.md indexes every
one of them with links that resolve, every committed plot redraws from its JSON, every run
folder's stamp names a commit of the history (a recorded one: the source that ran, by its
digest, clean unless the run was told otherwise), and the tables generated from the results
(the README's headline, docs/results.md's provenance) equal what the data gives."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "results")
INDEX = os.path.join(ROOT, "docs", "results.md")
KINDS = ("gpu-suite", "bench", "examples", "engines")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import headlines  # noqa: E402
import provenance  # noqa: E402

sys.path.pop(0)


def kinds() -> list[str]:
    return list(KINDS)


def run_folders() -> list[str]:
    """``results/<kind>/<run>``: one folder per run (subfolders are parts of a run)."""
    return sorted(os.path.join(kind, run) for kind in kinds()
                  for run in os.listdir(os.path.join(RESULTS, kind))
                  if os.path.isdir(os.path.join(RESULTS, kind, run)))


def stamped_folders() -> list[str]:
    """Every folder holding a stamp: the runs, and the sub-runs of a run that have their own."""
    return sorted(os.path.relpath(folder, RESULTS) for folder, _, files in os.walk(RESULTS)
                  if provenance.STAMP in files)


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


# ---- stamps: which commit each result measured --------------------------------------------------
needs_history = pytest.mark.skipif(
    not provenance.history_complete(),
    reason="needs git and the whole history (a shallow clone or an exported tree has no ages)")


@pytest.mark.parametrize("run", run_folders())
def test_every_run_folder_has_a_stamp_and_its_readme_names_the_same_commit(run):
    folder = os.path.join(RESULTS, run)
    stamp = provenance.read_stamp(folder)
    assert stamp is not None, f"{run} has no {provenance.STAMP} (benchmarks/provenance.py)"
    if not provenance.history_complete():
        pytest.skip("the commit check needs git and the whole history")
    r = provenance.resolve(stamp, folder)
    with open(os.path.join(folder, "README.md")) as f:
        text = f.read()
    at = text.index("**Commit")
    commit_line = text[at:text.find("\n\n", at) % (len(text) + 1)]  # its paragraph
    if r["commit"] is None:
        assert "not recorded" in commit_line, commit_line
    else:
        assert r["short"] in commit_line, (run, r["short"], commit_line)


@needs_history
@pytest.mark.parametrize("folder", stamped_folders())
def test_every_stamp_names_a_commit_of_the_history_and_a_recorded_one_ran_clean(folder):
    path = os.path.join(RESULTS, folder)
    stamp = provenance.read_stamp(path)
    r = provenance.resolve(stamp, path)
    if stamp.get("recorded"):
        for key in ("commit", "dirty", "source_digest", "date", "machine", "command"):
            assert key in stamp, f"{folder}/stamp.json lacks {key}"
        if not stamp.get("allow_dirty"):  # told: the tables say "+ uncommitted changes"
            assert r["how"] in ("recorded", "digest"), (
                f"{folder}: no commit of the history holds the source that ran; commit it, "
                "or re-run; a dirty run is committed only with --allow-dirty")
    elif r["how"] == "not recorded":
        assert r["added_in"], f"{folder}: no commit added it"
    if r["commit"]:
        assert r["age"] is not None, f"{folder}: {r['commit']} is not in HEAD's history"


@needs_history
def test_a_recorded_stamp_resolves_by_digest_where_its_commit_is_stale(tmp_path):
    """The case the old hand corrections were for: the git metadata where the run ran named
    another commit; the digest finds the right one, and a source no commit holds is dirty."""
    head = provenance.git("rev-parse", "HEAD")
    parent = provenance.git("rev-parse", "HEAD~1")
    digest = provenance.commit_digest(head)
    oldest = next(c for c in provenance.git("rev-list", "--reverse", "HEAD").split()
                  if provenance.commit_digest(c) == digest)
    stale = {"recorded": True, "commit": "0" * 40, "source_digest": digest}
    assert provenance.resolve(stale)["commit"] == oldest
    assert provenance.resolve({**stale, "commit": head})["how"] == "recorded"
    if provenance.commit_digest(parent) != digest:
        assert provenance.resolve({**stale, "commit": parent})["how"] == "digest"
    dirty = provenance.resolve({**stale, "source_digest": "sha256:" + "0" * 64})
    assert dirty["how"] == "dirty" and dirty["clean"] is False


# ---- the generated tables ------------------------------------------------------------------------
@needs_history
def test_the_readme_headline_and_the_provenance_table_are_what_the_data_gives():
    """Regenerated at the commit each table names; after a history rewrite (that commit gone)
    everything but the ages must still agree. Fix: python benchmarks/headlines.py --write."""
    differ = headlines.rewrite(check=True)
    if not differ:
        return
    for rel, pattern, end, make in (("README.md", headlines._BEGIN_RE, headlines.END,
                                     headlines.headline_table),
                                    ("docs/results.md", headlines._PROV_RE,
                                     headlines.PROV_END, headlines.provenance_table)):
        if rel not in differ:
            continue
        with open(os.path.join(ROOT, rel)) as f:
            text = f.read()
        start, stop, at = headlines._blocks(text, pattern, end)
        assert provenance.git("merge-base", "--is-ancestor", at, "HEAD") is None, (
            f"{rel}: the generated table differs from the results; run "
            "python benchmarks/headlines.py --write")

        def ageless(block):
            block = re.sub(r"\(ages at [0-9a-f]+\)", "", block)
            return re.sub(r"(>= )?\d+( commits)? \|", "N |", block)
        assert ageless(text[start:stop]) == ageless(make()), (
            f"{rel}: the generated table differs from the results beyond its ages; run "
            "python benchmarks/headlines.py --write")


def test_the_headline_compares_like_with_like_and_names_what_is_its_own():
    """Every row names both sides' work; a baseline that uploads block tables is compared
    with graphalloc writing them; the project's re-implementations say they are its own."""
    rows = [f() for f in headlines.ROWS]
    engines = [r for r in (f() for f in headlines.ENGINE_ROWS) if r is not None]
    for row in engines:  # the engines' own code, named with its version
        assert all(row[k] for k in ("measured", "graphalloc", "against", "machine", "run"))
        assert re.search(r"\d+\.\d+", row["against"]), row["against"]  # its version
        assert "re-implementation" not in row["against"]
    for row in rows:
        assert all(row[k] for k in ("measured", "graphalloc", "against", "machine", "run"))
        if "vLLM-style" in row["against"]:
            assert "own vLLM-style re-implementation" in row["against"]
            assert "tables" in row["graphalloc"], row  # the baseline uploads tables
        if "SGLang-style" in row["against"]:
            assert "own SGLang-style re-implementation" in row["against"]
            assert "no tables" in row["graphalloc"] or "without tables" in row["measured"]
    seam = [r for r in rows if "seam" in r["measured"]]
    direct = [r for r in rows if "no engine seam" in r["graphalloc"]]
    assert seam and direct  # the engine path is the seam; alloc.step alone says so


def test_engine_rows_are_picked_up_from_results_engines(tmp_path, monkeypatch):
    """A committed engine run's headline.json becomes rows of the table's engine part."""
    run = tmp_path / "engines" / "vllm-cpu"
    run.mkdir(parents=True)
    (run / "headline.json").write_text(json.dumps({"rows": [{
        "measured": "m", "graphalloc": "g 1 us", "against": "vLLM 0.33's KVCacheManager 2 us",
        "machine": "CPU"}]}))
    (run / provenance.STAMP).write_text(json.dumps({"recorded": False, "commit": None}))
    monkeypatch.setattr(headlines, "RESULTS", str(tmp_path))
    (row,) = headlines.engine_rows()
    assert row["run"] == "engines/vllm-cpu" and row["against"].startswith("vLLM 0.33")
    monkeypatch.setattr(headlines, "ROWS", ())
    table = headlines.headline_table()
    assert "vLLM 0.33's KVCacheManager 2 us" in table and "no such run" not in table
