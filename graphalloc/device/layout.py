"""The step descriptor's layout: its named sections, computed once from the config and the pools.

A step's descriptor buffer (:class:`~graphalloc.device.descriptor.DescriptorRing`, the
device ABI's rows, :mod:`graphalloc.kernels.abi`) is one int64 tensor ``[n_rows, 8]`` cut
into sections, in this order (a section a model does not have is absent, not empty):

=======================  =========================  ============================================
section                  rows                       contributed by
=======================  =========================  ============================================
``release``              ``max_release_rows``       the FULL pool (with the first window pool,
``allocation``           ``max_alloc_rows``         planned in the step's main rows)
``lanes``                ``max_batch``              the page tables (an allocator with them)
``states``               ``max_state_rows + 1``     the state pool (header row first), when the
                                                    model has recurrent-state slots
``window{p}_release``    ``max_release_rows``       further window pool p >= 1 (one pair each,
``window{p}_allocation`` ``max_alloc_rows``         in pool order)
=======================  =========================  ============================================

Each pool says which sections it contributes and their rows (``descriptor_sections(config)``
in :mod:`graphalloc.pools`); :meth:`DescriptorLayout.of` lays them end to end, once per
allocator, and every reader of the buffer asks the layout for a section by name: the ring's
views and mirrors, the staging copy, the compiled twin (its constructor gets the first rows
of the sections it writes), the launch-failure restore, the footprint, the replicas'
payload. Nothing else computes an offset (``tests/support/test_descriptor_layout.py``
checks the source).

Invariants: the sections tile ``[0, n_rows)`` in order, no gap, no overlap; names are
unique; the layout is immutable. Cost: O(sections) once, at construction; a lookup is one
dict read.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["DescriptorLayout", "Section", "RELEASE", "ALLOCATION", "LANES", "STATES",
           "window_release", "window_allocation"]

RELEASE, ALLOCATION, LANES, STATES = "release", "allocation", "lanes", "states"


def window_release(pool: int) -> str:
    """The name of further window pool ``pool``'s (>= 1) release section."""
    return f"window{pool}_release"


def window_allocation(pool: int) -> str:
    """The name of further window pool ``pool``'s (>= 1) allocation section."""
    return f"window{pool}_allocation"


class Section(NamedTuple):
    """One section: rows ``[first_row, end_row)`` of a descriptor buffer."""

    name: str
    first_row: int
    n_rows: int

    @property
    def end_row(self) -> int:
        return self.first_row + self.n_rows

    def rows(self, n_rows: int | None = None) -> slice:
        """The slice of the section's first ``n_rows`` rows (None: all of them). O(1)."""
        end = self.end_row if n_rows is None else self.first_row + min(n_rows, self.n_rows)
        return slice(self.first_row, end)


class DescriptorLayout:
    """The ordered sections of one allocator's descriptor buffers (see the module docstring).

    ``sections``: a tuple of :class:`Section`; ``n_rows``: the buffer's rows. Built from
    ``(name, n_rows)`` pairs in order (sections of no rows are left out)."""

    __slots__ = ("sections", "n_rows", "_by_name")

    def __init__(self, sizes):
        sections, first = [], 0
        for name, n_rows in sizes:
            if n_rows < 0:
                raise ValueError(f"descriptor section {name!r} has {n_rows} rows")
            if n_rows:
                sections.append(Section(name, first, int(n_rows)))
                first += int(n_rows)
        self.sections = tuple(sections)
        self.n_rows = first
        self._by_name = {s.name: s for s in self.sections}
        if len(self._by_name) != len(self.sections):
            raise ValueError(f"descriptor sections named twice: {[s.name for s in sections]}")

    @classmethod
    def of(cls, config, n_lane_rows: int = 0) -> DescriptorLayout:
        """The layout of ``config``'s pools, with ``n_lane_rows`` lane rows (the page
        tables' ``max_batch``; 0: no page tables). O(pools)."""
        pools = config.pools
        sizes = [*pools.full.descriptor_sections(config),
                 *pools.window.descriptor_sections(config)]
        sizes.append((LANES, n_lane_rows))
        sizes += pools.state.descriptor_sections(config)
        for extra in pools.extras:
            sizes += extra.descriptor_sections(config)
        return cls(sizes)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> Section:
        """The section ``name`` (KeyError when this layout has none)."""
        return self._by_name[name]

    def n_rows_of(self, name: str) -> int:
        """Rows of section ``name``; 0 when the layout has none."""
        section = self._by_name.get(name)
        return 0 if section is None else section.n_rows

    def rows(self, name: str, n_rows: int | None = None) -> slice:
        """The slice of section ``name``'s first ``n_rows`` rows (None: all); an empty slice
        at the buffer's end when the layout has no such section. O(1)."""
        section = self._by_name.get(name)
        if section is None:
            return slice(self.n_rows, self.n_rows)
        return section.rows(n_rows)

    def first_row(self, name: str) -> int:
        """Section ``name``'s first row, or -1 when the layout has none."""
        section = self._by_name.get(name)
        return -1 if section is None else section.first_row

    def window_sections(self) -> tuple[tuple[Section, Section], ...]:
        """Each further window pool's ``(release, allocation)`` sections, in pool order
        (p = 1, 2, ...). O(pools)."""
        out, pool = [], 1
        while window_release(pool) in self._by_name:
            out.append((self[window_release(pool)], self[window_allocation(pool)]))
            pool += 1
        return tuple(out)

    def __repr__(self) -> str:
        body = ", ".join(f"{s.name}[{s.first_row}:{s.end_row}]" for s in self.sections)
        return f"DescriptorLayout({body}; {self.n_rows} rows)"
