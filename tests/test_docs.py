"""Every python block of the README and of ``docs/`` runs as written (on the CPU: lines
ending in ``# gpu-only`` are left out; a block opening with ``# not run`` is skipped and says
why). Blocks of one page run in order in one namespace, as a reader would paste them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))


def blocks(page: str) -> list[str]:
    text = (ROOT / page).read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


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
