"""Where a result came from: the stamp every results folder carries, and what git says of it.

Every writer of a result (the benchmarks through ``timing.bench_main``, the examples, the GPU
scripts through this module's command line) calls :func:`results_stamp` before it measures:
it writes ``stamp.json`` into the output folder::

    commit          git's HEAD where the run started (None: no git metadata there)
    dirty           whether the source that ran differs from HEAD's (None: unknown)
    source_digest   sha256 over the source files that ran (their paths and git blob ids:
                    SOURCE_DIRS, SOURCE_FILES, SOURCE_SUFFIXES), computed from the files
                    themselves, so it names the code even where git's metadata is stale or
                    absent (an exported tree, a copy on another machine)
    date, machine, command, allow_dirty

and refuses (:class:`DirtyTreeError`, nothing measured) to write a result into the
repository's ``results/`` folder from source that no commit holds, unless told
(``--allow-dirty``); elsewhere (a scratch folder, a device machine's output folder) it
records the state and the check moves to the commit: ``tests/support/test_results_tree.py``
refuses a committed stamp whose source digest matches no commit, unless it says
``allow_dirty``.

:func:`resolve` turns a stamp into the commit that ran -- the recorded commit when its
digest matches, else the oldest commit of the history whose source has that digest -- and
its age in commits. Folders from before stamps carry ``"recorded": false`` with the commit
their README gave (carried over once when stamps came in, never re-typed); their age counts
from it. Cost: one ``git ls-tree`` per commit looked at, one read of every source file for
the tree's digest.

    python benchmarks/provenance.py stamp OUTDIR --command "..." [--allow-dirty]
    python benchmarks/provenance.py show results/bench/scheduler-h200
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import os
import platform
import subprocess
import sys

__all__ = ["STAMP", "DirtyTreeError", "results_stamp", "stamp_or_exit", "add_stamp_option",
           "command_line", "source_digest", "commit_digest", "resolve", "read_stamp", "age",
           "output_value", "added_in", "history_complete",
           "git", "REPO"]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAMP = "stamp.json"
SOURCE_DIRS = ("graphalloc", "kernels", "benchmarks", "examples", "tools", "tests")
SOURCE_FILES = ("setup.py", "pyproject.toml", "Makefile")
SOURCE_SUFFIXES = (".py", ".c", ".h", ".sh")
_SKIP_DIRS = {".venv", "__pycache__", "build", "dist", ".git", "results"}


class DirtyTreeError(RuntimeError):
    """A result for ``results/`` from source no commit holds, without ``--allow-dirty``."""


# ---- git and the source digest ------------------------------------------------------------
def git(*args: str, root: str = REPO) -> str | None:
    """``git args`` in ``root``: its stdout stripped, or None (no git, not a repository, an
    unknown commit)."""
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _is_source(path: str) -> bool:
    head = path.split("/", 1)[0]
    if path in SOURCE_FILES:
        return True
    parts = path.split("/")
    return (head in SOURCE_DIRS and path.endswith(SOURCE_SUFFIXES)
            and not any(p in _SKIP_DIRS or p.endswith(".egg-info") for p in parts[:-1]))


def _digest(entries: list[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for path, blob in sorted(entries):
        h.update(f"{path}\0{blob}\n".encode())
    return "sha256:" + h.hexdigest()


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # noqa: S324 (git's id)


def source_digest(root: str = REPO) -> str:
    """The digest of the source files under ``root`` as they are on disk (no git needed)."""
    entries = []
    for name in SOURCE_FILES:
        if os.path.isfile(os.path.join(root, name)):
            with open(os.path.join(root, name), "rb") as f:
                entries.append((name, _blob_id(f.read())))
    for top in SOURCE_DIRS:
        for folder, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.endswith(".egg-info")
                       and not d.startswith(".")]
            for name in files:
                rel = os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
                if _is_source(rel):
                    with open(os.path.join(folder, name), "rb") as f:
                        entries.append((rel, _blob_id(f.read())))
    return _digest(entries)


@functools.lru_cache(maxsize=4096)
def commit_digest(commit: str, root: str = REPO) -> str | None:
    """The same digest for ``commit``'s tree (``git ls-tree``), or None."""
    listing = git("ls-tree", "-r", commit, root=root)
    if listing is None:
        return None
    entries = []
    for line in listing.splitlines():
        meta, _, path = line.partition("\t")
        _, kind, blob = meta.split()
        if kind == "blob" and _is_source(path):
            entries.append((path, blob))
    return _digest(entries)


# ---- writing a stamp ------------------------------------------------------------------------
def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder + os.sep)


def results_stamp(out_dir: str, command: str, *, allow_dirty: bool = False,
                  machine: dict | None = None, root: str = REPO) -> dict:
    """Write ``out_dir/stamp.json`` (the module docstring's fields) and return it; raise
    :class:`DirtyTreeError` first, writing nothing, for a result into ``root/results/`` from
    source that differs from HEAD's, unless ``allow_dirty``. ``machine``: the writer's
    machine record (``timing.machine_info``); without one, Python and the platform."""
    digest = source_digest(root)
    head = git("rev-parse", "HEAD", root=root) if os.path.isdir(os.path.join(root, ".git")) \
        or os.path.isfile(os.path.join(root, ".git")) else None
    dirty = None if head is None else commit_digest(head, root) != digest
    if dirty and not allow_dirty and _inside(out_dir, os.path.join(root, "results")):
        raise DirtyTreeError(
            f"refusing to write a result into {out_dir}: the source differs from HEAD "
            f"({head[:12]}), so no commit names the code that would run. Commit first, or "
            "pass --allow-dirty (the stamp then says so, and the result cannot pass "
            "tests/support/test_results_tree.py as a clean one)")
    stamp = {"schema": 1, "recorded": True, "commit": head, "dirty": dirty,
             "source_digest": digest, "allow_dirty": bool(allow_dirty),
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "machine": machine or {"python": platform.python_version(),
                                    "platform": platform.platform()},
             "command": command}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, STAMP), "w") as f:
        json.dump(stamp, f, indent=1, default=str)
        f.write("\n")
    return stamp


def command_line(script: str, argv) -> str:
    """``python <script relative to the repository> <argv>``: how a folder's result ran."""
    argv = sys.argv[1:] if argv is None else argv
    rel = os.path.relpath(os.path.abspath(script), REPO).replace(os.sep, "/")
    return " ".join(["python", rel, *map(str, argv)])


def stamp_or_exit(out_dir: str, script: str, argv, *, allow_dirty: bool,
                  machine: dict | None = None) -> dict | None:
    """:func:`results_stamp` for a script's ``--out`` (nothing for ``''``: no output), or
    exit with status 2 and the refusal on stderr before anything runs."""
    if not out_dir:
        return None
    try:
        return results_stamp(out_dir, command_line(script, argv), allow_dirty=allow_dirty,
                             machine=machine)
    except DirtyTreeError as exc:
        print(f"{os.path.basename(script)}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def add_stamp_option(parser: argparse.ArgumentParser) -> None:
    """``--allow-dirty``: let a result into ``results/`` from uncommitted source."""
    parser.add_argument("--allow-dirty", action="store_true",
                        help="write a result into results/ from source that differs from "
                             "HEAD (the stamp records it; refused otherwise)")


# ---- reading one ------------------------------------------------------------------------------
def read_stamp(folder: str) -> dict | None:
    path = os.path.join(folder, STAMP)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


@functools.lru_cache(maxsize=8)
def _history(root: str) -> tuple[str, ...]:
    """HEAD's history, oldest first."""
    out = git("rev-list", "--reverse", "HEAD", root=root)
    return tuple(out.split()) if out else ()


def history_complete(root: str = REPO) -> bool:
    """Whether git and the whole history are here (not an exported tree, not a shallow
    clone): what ages and commits found in the history need."""
    return git("rev-parse", "--is-shallow-repository", root=root) == "false"


def age(commit: str, at: str = "HEAD", root: str = REPO) -> int | None:
    """Commits from ``commit`` to ``at`` (0: the same), None when not an ancestor."""
    if git("merge-base", "--is-ancestor", commit, at, root=root) is None:
        return None
    out = git("rev-list", "--count", f"{commit}..{at}", root=root)
    return None if out is None else int(out)


def output_value(folder: str, ref: str):
    """The value a stamp's ``"file.json:a.b.c"`` reference names in ``folder``'s output."""
    name, _, keys = ref.partition(":")
    with open(os.path.join(folder, name)) as f:
        value = json.load(f)
    for key in keys.split("."):
        value = value[key]
    return value


def added_in(folder: str, root: str = REPO) -> str | None:
    """The commit that first added ``folder``'s first output (renames followed), or None."""
    names = sorted(n for n in os.listdir(folder) if n not in (STAMP, "README.md")
                   and os.path.isfile(os.path.join(folder, n)))
    for name in names[:1] or ["README.md"]:
        rel = os.path.relpath(os.path.join(folder, name), root)
        out = git("log", "--follow", "--diff-filter=A", "--format=%H", "--", rel, root=root)
        if out:
            return out.split()[-1]
    return None


def resolve(stamp: dict, folder: str | None = None, at: str = "HEAD",
            root: str = REPO) -> dict:
    """``{"commit", "short", "how", "clean", "age", "stale", "added_in"}`` for the stamp of
    ``folder``:
    the commit whose source ran and its age in commits at ``at``. ``how``: "recorded" (the
    stamp's commit has the stamp's digest); "digest" (found by its digest in the history:
    the stamp's own commit was stale or absent); "dirty" (no commit has that source).
    Folders from before stamps: "output" (the commit the run wrote into its own output,
    ``commit_from``), "by hand" (carried from the folder's README when stamps came in; its
    output's stale stamp, ``stale_stamp_from``, is read into ``stale``), "not recorded"
    (``age`` then counts from ``added_in``, the commit that added the folder: a lower
    bound)."""
    commit, digest = stamp.get("commit"), stamp.get("source_digest")
    how, clean, stale = ("by hand" if commit else "not recorded"), None, None
    if not stamp.get("recorded"):
        clean = None if not commit else not stamp.get("dirty", False)
        if stamp.get("commit_from"):
            text = str(output_value(folder, stamp["commit_from"])).split()[0]
            commit, how = text.removesuffix("-dirty"), "output"
            clean = not text.endswith("-dirty")
        if stamp.get("stale_stamp_from"):
            stale = str(output_value(folder, stamp["stale_stamp_from"]))
    if stamp.get("recorded"):
        full = git("rev-parse", "--verify", f"{commit}^{{commit}}", root=root) if commit else None
        if full and commit_digest(full, root) == digest:
            commit, how, clean = full, "recorded", True
        else:
            found = next((c for c in _history(root) if commit_digest(c, root) == digest), None)
            if found:
                commit, how, clean = found, "digest", True
            else:
                how, clean = "dirty", False
    elif commit:
        commit = git("rev-parse", "--verify", f"{commit}^{{commit}}", root=root) or commit
    added = None
    if how == "not recorded" and folder:  # the run was at or before the commit that added it
        added = added_in(folder, root)
    years = age(commit or added, at, root) if (commit or added) else None
    return {"added_in": added, "commit": commit, "short": commit[:7] if commit else None,
            "how": how, "clean": clean, "age": years, "stale": stale}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    st = sub.add_parser("stamp", help="write OUTDIR/stamp.json (a shell script's result)")
    st.add_argument("out_dir")
    st.add_argument("--command", required=True, help="the command the folder's result ran")
    add_stamp_option(st)
    sh = sub.add_parser("show", help="print a folder's stamp and the commit it resolves to")
    sh.add_argument("folder")
    args = ap.parse_args(argv)
    if args.verb == "stamp":
        try:
            stamp = results_stamp(args.out_dir, args.command, allow_dirty=args.allow_dirty)
        except DirtyTreeError as exc:
            print(f"provenance: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(stamp, indent=1))
        return 0
    stamp = read_stamp(args.folder)
    if stamp is None:
        print(f"{args.folder}: no {STAMP}", file=sys.stderr)
        return 1
    print(json.dumps({"stamp": stamp, "resolved": resolve(stamp, args.folder)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
