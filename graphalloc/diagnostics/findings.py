"""One discrepancy an audit finds (:mod:`graphalloc.diagnostics.integrity`,
:mod:`graphalloc.diagnostics.window_audit`). Cost: O(1)."""

from __future__ import annotations

import dataclasses

__all__ = ["Finding"]


@dataclasses.dataclass
class Finding:
    """One discrepancy: ``kind`` (leak, double_owner, stale_mapping, ...), the ``pool``,
    the ``page`` (or -1), the request ``req`` (or -1) and a message."""

    kind: str
    pool: str
    page: int
    req: int
    message: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}"
