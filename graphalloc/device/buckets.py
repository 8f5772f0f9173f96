"""Launch grids that follow the step: how many programs a step's kernels get.

A step's descriptor has room for ``max_release_rows`` release rows and
``max_alloc_rows`` allocation rows, but the planner packs a step's real rows at
the front of each table and marks the rest padded. A launch over the first
``n`` rows of a table therefore leaves the same state as a launch over all of
them whenever ``n`` covers the real rows -- and costs programs (each one a
64-byte read from pinned host memory) only for those ``n`` rows.

A :class:`StepGrid` is one launch shape::

    n_release_rows    release programs' rows   [0, max_release_rows]
    n_release_chunks  programs per release row  >= 1
    n_alloc_rows      allocation programs' rows [0, max_alloc_rows]
    n_alloc_chunks    programs per allocation row >= 1 (a long prefill row is shared)

:class:`GridPolicy` chooses grids, from nothing but ``PlannedStep`` counts (no
descriptor read, no numpy: this runs in ``run()``):

* ``exact(n_rel, n_al, n_tokens)`` -- the eager launch: exactly the step's rows;
* row **buckets** for captured graphs: the ladder ``0, 1, g, g^2, ... < max, max``
  (``g = growth``, 4 by default) per table; ``bucket(n_rel, n_al, n_tokens)`` is
  the smallest captured shape that covers the step, and ``shapes()`` lists every
  shape a graph executor captures;
* **long rows**: a step whose allocation carries at least ``LONG_EXTRA_TOKENS``
  tokens beyond one per row (a prefill, a chunked-prefill chunk, long speculative
  steps) has a row of at least two token blocks; its allocation rows then get
  ``long_chunks(rows)`` programs each, so that about ``long_programs`` programs
  share the work (never more chunks than a row of ``max_tokens_per_alloc_row``
  has token blocks). The chunk count never changes the result (each program
  takes a contiguous share of its row's blocks), only how fast a long row runs.

Release rows keep one program each: a release row has at most
``max_pages_per_row`` pages, so the config already bounds its length (lower it to
split long releases over more rows).

Cost: every method is O(1) list lookups after construction (``O(max rows)`` to
build the lookup tables).
"""

from __future__ import annotations

from typing import NamedTuple

from ..errors import ConfigError

__all__ = ["StepGrid", "GridPolicy", "ladder", "grid_of", "LONG_EXTRA_TOKENS"]

# A step with this many allocated tokens beyond one per row has a row of more than one
# token block (BLOCK_TOKENS = 64 lanes): two blocks of extra work, the least a long row
# is worth sharing.
LONG_EXTRA_TOKENS = 128


class StepGrid(NamedTuple):
    """One launch shape of a step's kernels (see the module docstring)."""

    n_release_rows: int
    n_release_chunks: int
    n_alloc_rows: int
    n_alloc_chunks: int

    @property
    def n_programs(self) -> int:
        """Programs launched: ``n_release_rows * n_release_chunks + n_alloc_rows *
        n_alloc_chunks`` (0: nothing to launch)."""
        return (self.n_release_rows * self.n_release_chunks
                + self.n_alloc_rows * self.n_alloc_chunks)

    def covers(self, n_release_rows: int, n_alloc_rows: int) -> bool:
        """Whether a step of that many rows may run on this grid."""
        return n_release_rows <= self.n_release_rows and n_alloc_rows <= self.n_alloc_rows


def grid_of(config, n_rows) -> StepGrid | None:
    """``launch(n_rows=)``'s argument as a :class:`StepGrid`: ``(n_release_rows,
    n_alloc_rows)`` (one program per row) or a StepGrid; ``None`` stays ``None``. Row counts
    must lie in ``[0, max_*_rows]``, chunks be >= 1 (``ContractError`` otherwise)."""
    from ..errors import ContractError

    if n_rows is None:
        return None
    if isinstance(n_rows, StepGrid):
        grid = n_rows
    elif isinstance(n_rows, (tuple, list)) and len(n_rows) == 2:
        grid = StepGrid(n_rows[0], 1, n_rows[1], 1)
    else:
        raise ContractError(f"n_rows takes (n_release_rows, n_alloc_rows) or a StepGrid, got "
                            f"{n_rows!r}")
    tops = (config.max_release_rows, None, config.max_alloc_rows, None)
    for value, top in zip(grid, tops, strict=True):
        if isinstance(value, bool) or not isinstance(value, int) or (
                value < (0 if top is not None else 1)) or (top is not None and value > top):
            raise ContractError(
                f"launch(n_rows={n_rows!r}): row counts must be ints in [0, max_release_rows="
                f"{config.max_release_rows}] and [0, max_alloc_rows={config.max_alloc_rows}], "
                "chunks ints >= 1")
    return StepGrid(*(int(v) for v in grid))


def ladder(max_rows: int, growth: int) -> tuple[int, ...]:
    """Row buckets of one table: ``0, 1, growth, growth**2, ... (< max_rows), max_rows``.

    >>> ladder(768, 4)
    (0, 1, 4, 16, 64, 256, 768)
    >>> ladder(1, 4)
    (0, 1)
    """
    sizes, size = [0], 1
    while size < max_rows:
        sizes.append(size)
        size *= growth
    sizes.append(max_rows)
    return tuple(sizes)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class GridPolicy:
    """Chooses the launch grid of each step (see the module docstring).

    Args:
        config: the allocator's :class:`~graphalloc.config.AllocatorConfig`.
        growth: ratio between consecutive row buckets (an int >= 2); ``None`` for one
            bucket per table, the frozen maximum (every step on the full grid).
        long_programs: programs a long allocation row is spread over (divided among the
            bucket's rows, at least one per row); 0 turns chunking off. 64 (H200,
            ``results/bench/grid-h200``): a 4,096-token prefill row took 8.9 and 11.8 us
            of GPU time over 64 programs in two runs (back-to-back window clock; 9.7 us
            isolated), 11.9 us over 128, 67 us on one program: the split is what matters,
            64 against 128 is within the runs' spread.
        block_tokens: token lanes per block of the allocation kernel (its
            ``BLOCK_TOKENS``).

    Invariants: ``bucket(...)`` covers the step's rows; ``exact(...)`` is the step's own
    rows; ``shapes()`` contains every grid ``bucket`` can return.
    """

    def __init__(self, config, *, growth: int | None = 4, long_programs: int = 64,
                 block_tokens: int = 64):
        if growth is not None and (isinstance(growth, bool) or not isinstance(growth, int)
                                   or growth < 2):
            raise ConfigError(f"growth must be an int >= 2 (the ratio between row buckets) or "
                              f"None (the full grid only), got {growth!r}")
        if isinstance(long_programs, bool) or not isinstance(long_programs, int) or (
                long_programs < 0):
            raise ConfigError(f"long_programs must be an int >= 0 (0: no chunking), got "
                              f"{long_programs!r}")
        self.max_release_rows = int(config.max_release_rows)
        self.max_alloc_rows = int(config.max_alloc_rows)
        self.growth = growth
        self.long_programs = long_programs
        # A row copies up to a whole request's prefix (AL_COPY) or allocates up to
        # max_tokens_per_alloc_row tokens: never more chunks than its blocks.
        longest = max(int(config.max_tokens_per_alloc_row),
                      int(config.max_context_len) if getattr(config, "max_handles", 0) else 0)
        self.max_alloc_chunks = max(1, _ceil_div(longest, block_tokens))
        if growth is None:
            self.release_sizes = (0, self.max_release_rows)
            self.alloc_sizes = (0, self.max_alloc_rows)
        else:
            self.release_sizes = ladder(self.max_release_rows, growth)
            self.alloc_sizes = ladder(self.max_alloc_rows, growth)
        # n rows -> the smallest bucket >= n (lists: an index costs tens of nanoseconds).
        self._release_bucket = self._lookup(self.release_sizes)
        self._alloc_bucket = self._lookup(self.alloc_sizes)
        self._long_cache: dict[int, int] = {}

    @staticmethod
    def _lookup(sizes: tuple[int, ...]) -> list[int]:
        table, k = [], 0
        for n in range(sizes[-1] + 1):
            while sizes[k] < n:
                k += 1
            table.append(sizes[k])
        return table

    def long_chunks(self, n_alloc_rows: int) -> int:
        """Programs per allocation row for a step with a long row on ``n_alloc_rows`` rows:
        ``clamp(long_programs // n_alloc_rows, 1, max_alloc_chunks)``."""
        if n_alloc_rows <= 0 or self.long_programs == 0:
            return 1
        return max(1, min(self.max_alloc_chunks, self.long_programs // n_alloc_rows))

    @staticmethod
    def is_long(n_alloc_rows: int, n_tokens: int) -> bool:
        """Whether the step's allocation has a row worth sharing (module docstring)."""
        return n_tokens >= n_alloc_rows + LONG_EXTRA_TOKENS

    def exact(self, n_release_rows: int, n_alloc_rows: int, n_tokens: int = 0) -> StepGrid:
        """The grid of exactly the step's rows (eager launches)."""
        chunks = self.long_chunks(n_alloc_rows) if self.is_long(n_alloc_rows, n_tokens) else 1
        return StepGrid(n_release_rows, 1, n_alloc_rows, chunks)

    def bucket(self, n_release_rows: int, n_alloc_rows: int, n_tokens: int = 0) -> StepGrid:
        """The smallest captured grid covering the step (a member of :meth:`shapes`)."""
        n_al = self._alloc_bucket[n_alloc_rows]
        chunks = self.long_chunks(n_al) if self.is_long(n_alloc_rows, n_tokens) else 1
        return StepGrid(self._release_bucket[n_release_rows], 1, n_al, chunks)

    def full(self) -> StepGrid:
        """The frozen maximum: every row of both tables, one program each."""
        return StepGrid(self.max_release_rows, 1, self.max_alloc_rows, 1)

    def shapes(self) -> list[StepGrid]:
        """Every grid :meth:`bucket` can return except the empty one (a step with no rows
        launches nothing), release buckets outer."""
        out = []
        for n_rel in self.release_sizes:
            for n_al in self.alloc_sizes:
                for chunks in sorted({1, self.long_chunks(n_al)}):
                    if n_rel or n_al:
                        out.append(StepGrid(n_rel, 1, n_al, chunks))
        return out

    def __repr__(self) -> str:
        return (f"GridPolicy(release buckets {self.release_sizes}, alloc buckets "
                f"{self.alloc_sizes}, long rows over {self.long_programs} programs, at most "
                f"{self.max_alloc_chunks} per row)")
