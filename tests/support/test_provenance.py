"""benchmarks/provenance.py on a throw-away repository: a stamp records the commit and the
source digest, a result into results/ from uncommitted source is refused unless told, and a
stamp whose git metadata is stale or absent still resolves to the commit that ran."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import provenance  # noqa: E402

sys.path.pop(0)
pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(repo, *args):
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                          text=True, env=env).stdout.strip()


@pytest.fixture()
def repo(tmp_path):
    """Two commits of a tiny source tree (the second changes the code), plus a doc."""
    r = tmp_path / "repo"
    (r / "graphalloc").mkdir(parents=True)
    (r / "results").mkdir()
    (r / "graphalloc" / "a.py").write_text("A = 1\n")
    (r / "README.md").write_text("docs are not source\n")
    git(r, "init", "-q")
    git(r, "add", "-A")
    git(r, "commit", "-qm", "one")
    (r / "graphalloc" / "a.py").write_text("A = 2\n")
    git(r, "commit", "-qam", "two")
    return r


def test_a_clean_tree_is_stamped_with_its_commit_and_digest(repo):
    head = git(repo, "rev-parse", "HEAD")
    stamp = provenance.results_stamp(str(repo / "results" / "x"), "python x.py",
                                     root=str(repo))
    assert (stamp["commit"], stamp["dirty"], stamp["recorded"]) == (head, False, True)
    assert stamp["source_digest"] == provenance.commit_digest(head, str(repo))
    assert json.loads((repo / "results" / "x" / "stamp.json").read_text()) == stamp
    r = provenance.resolve(stamp, at=head, root=str(repo))
    assert (r["commit"], r["how"], r["clean"], r["age"]) == (head, "recorded", True, 0)


def test_uncommitted_source_is_refused_into_results_unless_told(repo, tmp_path):
    (repo / "graphalloc" / "a.py").write_text("A = 3\n")
    with pytest.raises(provenance.DirtyTreeError, match="--allow-dirty"):
        provenance.results_stamp(str(repo / "results" / "x"), "c", root=str(repo))
    assert not (repo / "results" / "x").exists()  # refused before anything was written
    told = provenance.results_stamp(str(repo / "results" / "x"), "c", allow_dirty=True,
                                    root=str(repo))
    assert told["dirty"] is True and told["allow_dirty"] is True
    scratch = provenance.results_stamp(str(tmp_path / "scratch"), "c", root=str(repo))
    assert scratch["dirty"] is True  # outside results/: recorded, not refused
    r = provenance.resolve(scratch, root=str(repo))
    assert r["how"] == "dirty" and r["clean"] is False


def test_a_doc_change_is_not_dirty_and_a_new_source_file_is(repo):
    (repo / "README.md").write_text("edited\n")
    assert provenance.results_stamp(str(repo / "results" / "x"), "c",
                                    root=str(repo))["dirty"] is False
    (repo / "graphalloc" / "new.py").write_text("")  # untracked source: not in any commit
    with pytest.raises(provenance.DirtyTreeError):
        provenance.results_stamp(str(repo / "results" / "y"), "c", root=str(repo))


def test_stale_or_absent_git_metadata_resolves_by_the_digest(repo, tmp_path):
    """A copy of commit one run where git says commit two (or nothing): the digest finds one."""
    first = git(repo, "rev-parse", "HEAD~1")
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    (copy / "graphalloc" / "a.py").write_text("A = 1\n")  # commit one's source
    stamp = provenance.results_stamp(str(copy / "out"), "c", root=str(copy))
    assert stamp["commit"] is None and stamp["dirty"] is None  # no git metadata there
    r = provenance.resolve(stamp, root=str(repo))
    assert (r["commit"], r["how"], r["age"]) == (first, "digest", 1)
    stale = {**stamp, "commit": git(repo, "rev-parse", "HEAD")}  # a stale HEAD recorded
    assert provenance.resolve(stale, root=str(repo))["commit"] == first


def test_the_command_line_stamps_a_shell_scripts_folder(repo, tmp_path):
    out = tmp_path / "suite"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "provenance.py"),
                          "stamp", str(out), "--command", "bash tests/gpu/run.sh OUT"],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert json.loads((out / "stamp.json").read_text())["command"] == "bash tests/gpu/run.sh OUT"
