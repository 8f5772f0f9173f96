"""Every python block of the README and of ``docs/`` runs as written (on the CPU: lines
ending in ``# gpu-only`` are left out; a block opening with ``# not run`` is skipped and says
why). Blocks of one page run in order in one namespace, as a reader would paste them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix()
                             for p in (ROOT / "docs").glob("*.md"))]


def blocks(page: str) -> list[str]:
    text = (ROOT / page).read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_has_blocks():
    """The README's first use is a python block, so the test below really runs it."""
    assert blocks("README.md")


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)])
def test_page_runs_as_written(page):
    scope: dict = {"__name__": "__docs__"}
    ran = 0
    for i, block in enumerate(blocks(page)):
        if block.lstrip().startswith("# not run"):
            continue
        code = "\n".join(line for line in block.splitlines()
                         if not line.rstrip().endswith("# gpu-only"))
        exec(compile(code, f"{page}[{i}]", "exec"), scope)  # noqa: S102
        ran += 1
    assert ran, f"{page}: every block is skipped"


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading (lower case, punctuation dropped, spaces to -)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve(page):
    """Every relative link of the page names a file that exists, and an anchor into a
    markdown page names one of its headings."""
    text = (ROOT / page).read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (ROOT / page).parent / path if path else ROOT / page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.M)
            if anchor not in {slug(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{page}: links that do not resolve: {broken}"


def _resolves(dotted: str) -> bool:
    """Whether ``graphalloc.a.b.c`` names a module, or an attribute of one."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        except ImportError:  # a name built lazily from an engine that is absent (the vLLM
            return parts[-1] in getattr(obj, "__all__", ())  # scheduler): declared is enough
        return True
    return False


@pytest.mark.parametrize("page", PAGES)
def test_names_and_paths_exist(page):
    """Every ``graphalloc.*`` dotted name the page mentions imports, and every repository
    path it quotes in backticks exists (patterns with ``*`` aside): the docs follow the
    code when modules move."""
    text = (ROOT / page).read_text()
    names = set(re.findall(r"\bgraphalloc(?:\.[A-Za-z_]\w*)+", text))
    missing = sorted(n for n in names if not _resolves(n))
    paths = set(re.findall(r"`((?:graphalloc|kernels|tests|examples|benchmarks|docs|results)"
                           r"/[\w./-]*)`", text))
    missing += sorted(p for p in paths if "*" not in p and not (ROOT / p).exists())
    assert not missing, f"{page}: names or paths that do not exist: {missing}"
