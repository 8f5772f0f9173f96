"""The replicas' consistency check: digest rows, their history, and the cross-rank verdict.

:class:`~graphalloc.replicas.ReplicatedAllocator` keeps the ranks equal; this module is
how it finds out that they are not. The wrapper holds one :class:`DigestHistory` and
decides when to record a row and when to check (the cadence below); nothing here runs
by itself.

**Consistency check.** Every ``digest_every`` steps each rank records a digest row:
``step``, ``planned_step`` (broadcast: the step number the planner put in the
payload), the host digests by part (``ledger``, ``spec``, ``handles``, ``refs``,
``pages``, ``cache``: 64-bit BLAKE2b each, see :func:`graphalloc.replicas.digest.host_digests`)
and one 64-bit digest per device table of ``DeviceState.tables()`` (mapping, free rings,
``req_to_token``, ring pages, error word, handle rows). A table digest is
``sum_r w_r * sum_c w_c * x[r, c]`` in wrapping int64 arithmetic with odd pseudo-random
position weights, computed by Torch ops into a preallocated buffer (captured as one
CUDA graph on a GPU): no sync, and integer wrapping sums are exact and
order-independent, so every rank computes the same bits. A change of a single entry
changes the digest with certainty (``delta * odd * odd != 0 mod 2**64``). Every
``check_every`` steps the rows are all-gathered (the one place that synchronises, inside
:func:`~graphalloc.diagnostics.sync_points.sync_allowed`) and compared; the first
differing row names the step, the rank (against the majority, ties to the planner) and the
fields, and every rank raises the same :class:`~graphalloc.errors.ReplicaDivergenceError`.

* :class:`DigestHistory`: the rows since the last check (device buffers, host values
  beside them), recording and the all-gather;
* :func:`first_divergence`: the verdict on a gathered table, a pure function of it;
* :func:`check_same_setup`: the construction-time comparison of the ranks'
  configurations and wrapper options.

The digests themselves live in :mod:`graphalloc.replicas.digest`.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import torch
import torch.distributed as dist

from ..errors import ConfigError, ReplicaDivergenceError
from .digest import HOST_PARTS, META_STEP, StateDigest

__all__ = ["DigestHistory", "first_divergence", "check_same_setup", "COL_STEP",
           "COL_PLANNED_STEP", "COL_LEDGER"]

# Columns of a digest row: step, planned step, the host digests (HOST_PARTS order, the
# first being "ledger"), then the table digests.
COL_STEP, COL_PLANNED_STEP, COL_LEDGER = 0, 1, 2
_N_HEAD_COLS = COL_LEDGER + len(HOST_PARTS)


class DigestHistory:
    """The digest rows one rank recorded since its last check.

    Allocated once, updated in place only (graphs hold their addresses)::

        digest_buf  int64 [n_cols]             device  the latest digest row
        hist_buf    int64 [n_rows, n_cols]     device  digest rows since the check
        _host_hist  int64 [n_rows, n_cols]     host    the values the host knows
        _host_cols  bool  [n_rows, n_cols]     host    which values come from the host

    ``n_cols = 2 + len(HOST_PARTS) + n_tables``; ``n_rows = check_every // digest_every +
    1`` (the extra row for ``check()``). A row's ``step`` always comes from the host;
    ``planned_step`` and the host digests from the host on a rank that knows its ledger,
    else (broadcast mode) from the payload's meta row as the planner sent it (a follower
    replaces them by its own at a check: :meth:`set_host`); the table digests from the
    device. :meth:`gather` merges the two.

    Args:
        tables: the device tables to digest (``DeviceState.tables()``: name -> tensor).
        device: where the allocator's tables live.
        n_rows: rows the history holds (the most recorded between two checks).
        planned_meta: broadcast mode: the payload's meta row (int64 ``[8]``, device), read
            by every :meth:`compute`; ``None`` in replicated mode.
    """

    def __init__(self, tables: dict[str, torch.Tensor], device: torch.device, n_rows: int,
                 planned_meta: torch.Tensor | None = None):
        self.digest = StateDigest(tables)
        self.columns = ["step", "planned_step", *HOST_PARTS, *self.digest.names]
        n_cols = len(self.columns)
        self.device = device
        self.planned_meta = planned_meta
        self.digest_buf = torch.zeros(n_cols, dtype=torch.int64, device=device)
        self.hist_buf = torch.zeros(n_rows, n_cols, dtype=torch.int64, device=device)
        self._host_hist = np.zeros((n_rows, n_cols), dtype=np.int64)
        self._host_cols = np.zeros((n_rows, n_cols), dtype=bool)
        self.n_recorded = 0  # rows [0, n_recorded) hold this check's digests

    def compute(self) -> None:
        """The current digest row into ``digest_buf``: device ops only, no sync (the
        wrapper captures this as its digest graph)."""
        if self.planned_meta is not None:  # what the planner said: its step and digests
            self.digest_buf[COL_PLANNED_STEP:_N_HEAD_COLS].copy_(
                self.planned_meta[META_STEP:META_STEP + _N_HEAD_COLS - COL_PLANNED_STEP])
        self.digest.compute(self.digest_buf[_N_HEAD_COLS:])

    def record(self, step: int, host: dict[str, int] | None, graph=None) -> None:
        """Append the row of ``step``: ``host`` holds the host digests by part on a rank that
        knows its ledger (``None``: a broadcast rank, whose row carries the planner's from
        the payload); ``graph``, when given, is the capture of :meth:`compute` and is
        replayed instead."""
        row = self.n_recorded
        self.n_recorded += 1
        self._host_hist[row, COL_STEP] = step
        self._host_cols[row] = False
        self._host_cols[row, COL_STEP] = True
        if host is not None:
            self._host_hist[row, COL_PLANNED_STEP] = step
            self._host_cols[row, COL_PLANNED_STEP] = True
            self.set_host(host)
        if graph is not None:
            graph.replay()
        else:
            self.compute()
        self.hist_buf[row].copy_(self.digest_buf)

    def set_host(self, host: dict[str, int]) -> None:
        """Replace host digests of the latest row by these (by part name; parts not given
        keep their values)."""
        row = self.n_recorded - 1
        for name, value in host.items():
            col = COL_LEDGER + HOST_PARTS.index(name)
            self._host_hist[row, col] = value
            self._host_cols[row, col] = True

    def covers(self, step: int) -> bool:
        """Whether the latest recorded row is that of ``step``."""
        n = self.n_recorded
        return n > 0 and self._host_hist[n - 1, COL_STEP] == step

    def gather(self, group, world_size: int) -> np.ndarray:
        """All-gather the recorded rows: ``[world_size, n_recorded, n_cols]`` int64, rank by
        rank of ``group``; the history is empty after. Collective and synchronising: call
        under ``sync_allowed``."""
        n = self.n_recorded
        host = torch.from_numpy(self._host_hist[:n]).to(self.device)
        mask = torch.from_numpy(self._host_cols[:n]).to(self.device)
        local = torch.where(mask, host, self.hist_buf[:n])
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local, group=group)
        table = torch.stack(gathered).cpu().numpy()  # sync ok: the periodic check
        self.n_recorded = 0
        return table

    def current(self, step: int, host: dict[str, int]) -> dict[str, int]:
        """This rank's digest row of its current state, by column name: ``host`` the host
        digests by part (reads the device: call under ``sync_allowed``; records nothing)."""
        self.digest.compute(self.digest_buf[_N_HEAD_COLS:])
        values = self.digest_buf.cpu().tolist()  # sync ok: explicit inspection
        values[COL_STEP] = values[COL_PLANNED_STEP] = step
        row = dict(zip(self.columns, values, strict=True))
        row.update(host)
        return row


def first_divergence(table: np.ndarray, columns: list[str], global_ranks: list[int],
                     src: int, last_equal_step: int) -> ReplicaDivergenceError | None:
    """First row where ranks differ: reference = the majority value (ties: the planner
    ``src``, then the lowest rank); every rank computes the same answer from the same
    table (``DigestHistory.gather``'s). ``None`` when every row is equal."""
    last_equal = last_equal_step
    src_index = global_ranks.index(src)
    for j in range(table.shape[1]):
        rows = table[:, j, :]
        if (rows == rows[0]).all():
            last_equal = int(rows[0, COL_STEP])
            continue
        same = (rows[:, None, :] == rows[None, :, :]).all(-1)  # [world, world]
        votes = same.sum(1)
        best = votes.max()
        ref = src_index if votes[src_index] == best else int(np.flatnonzero(votes == best)[0])
        diverged = np.flatnonzero(~same[ref])
        first = int(diverged[0])
        fields = [columns[c] for c in np.flatnonzero(rows[first] != rows[ref])]
        return ReplicaDivergenceError(
            step=int(rows[ref, COL_STEP]), rank=global_ranks[first],
            ranks=[global_ranks[int(r)] for r in diverged],
            reference_rank=global_ranks[ref], fields=fields,
            last_equal_step=last_equal)
    return None


def check_same_setup(config, options: tuple, group, global_ranks: list[int],
                     device: torch.device) -> None:
    """Refuse ranks whose allocators differ: compares a BLAKE2b of ``config`` (every field
    but ``device``) and the wrapper ``options`` (mode, src, check_every, digest_every,
    descriptor ring length, prefix cache) across ``group`` (collective; synchronises)."""
    geometry = sorted((f.name, str(getattr(config, f.name)))
                      for f in dataclasses.fields(config) if f.name != "device")
    text = repr((geometry, *options))
    value = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little",
                           signed=True)
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(len(global_ranks))]
    dist.all_gather(gathered, mine, group=group)
    values = torch.cat(gathered).cpu().tolist()  # sync ok: construction
    bad = [global_ranks[r] for r, v in enumerate(values) if v != values[0]]
    if bad:
        raise ConfigError(
            f"ranks {bad} wrap an allocator with a different geometry or wrapper options "
            f"than rank {global_ranks[0]}; every rank needs the same AllocatorConfig "
            "(device aside), mode, src, check_every, digest_every, descriptor ring and "
            "prefix_cache")
