"""Launch failures injected at a chosen kernel of a step, for the transaction tests.

:class:`LaunchFaults` wraps every launch point of one allocator's step kernels -- the
release, allocation and fused step launchers, the page-table launch, the state-table
launch and each state tensor's copy launch -- and counts them. ``arm(k)`` makes the k-th
launch from now (0: the next one) raise before it enqueues anything, so the kernels before
it ran and the ones after it never start: every point "before the first kernel" and
"between two kernels" of a step (and of a split free's parts) is reachable. ``seen``
names the launches of the last run, so a test can draw k uniformly over a step's kernels.
"""

from __future__ import annotations

__all__ = ["LaunchFaults", "InjectedLaunchFailure", "defined_state", "same_state"]


class InjectedLaunchFailure(RuntimeError):
    pass


class LaunchFaults:
    def __init__(self, alloc):
        self.alloc = alloc
        self.armed: int | None = None
        self.count = 0
        self.seen: list[str] = []
        self.fired: str | None = None
        k = alloc.kernels
        for attr, name in (("_release", "release"), ("_allocate", "allocate"),
                           ("_step", "fused"), ("_write_states", "state_table")):
            setattr(k, attr, self._wrap(getattr(k, attr), name))
        copy = k._copy_states

        def copy_each(rows, tensors, n_programs=1):  # one launch per tensor, each counted
            for i, entry in enumerate(tensors):
                self._tick(f"state_copy[{i}]")
                copy(rows, (entry,), n_programs)
        k._copy_states = copy_each
        if alloc.tables is not None:
            alloc.tables._write = self._wrap(alloc.tables._write, "page_tables")

    def _tick(self, name: str) -> None:
        if self.armed is not None and self.count == self.armed:
            self.armed = None
            self.fired = name
            raise InjectedLaunchFailure(f"injected failure at launch {self.count} ({name})")
        self.count += 1
        self.seen.append(name)

    def _wrap(self, fn, name):
        def launch(*args, **kwargs):
            self._tick(name)
            return fn(*args, **kwargs)
        return launch

    def arm(self, k: int) -> None:
        """The k-th launch from now raises (before it enqueues anything)."""
        self.count, self.seen, self.fired, self.armed = 0, [], None, int(k)

    def disarm(self) -> None:
        self.armed = None

    def watch(self) -> None:
        """Count the next launches without failing (``seen`` names them)."""
        self.count, self.seen, self.fired, self.armed = 0, [], None, None


def defined_state(alloc) -> dict:
    """Every entry the allocator defines, host and device, as numpy copies: the host arrays
    and ring positions, ``req_to_token[:L]`` of each live row and held handle,
    ``full_to_swa``, the free rings' windows, ring mode's live ring pages and the state
    table's defined entries (what ``audit()`` compares; entries past a row's length, ring
    positions outside the window and the speculative slots of a row with no step in
    flight are unspecified)."""
    import numpy as np

    snap = alloc.snapshot()
    cfg, led = alloc.config, alloc.ledger
    out = {k: np.asarray(v).copy() for k, v in snap.items() if k.startswith("host_")}
    r2t = snap["req_to_token"]
    for r in np.flatnonzero(led.live):
        out[f"r2t[{r}]"] = r2t[r, :led.seq_len[r]].copy()
        if cfg.ring_mode:
            out[f"ring[{r}]"] = snap["ring_pages"][r, :cfg.swa_ring_pages].copy()
    if "handle_to_token" in snap:
        for h in np.flatnonzero(led.h_live):
            out[f"h2t[{h}]"] = snap["handle_to_token"][h, :led.h_len[h]].copy()
    out["full_to_swa"] = snap["full_to_swa"].copy()
    for name, ring in (("full_free", led.full), ("swa_free", led.swa)):
        cap = len(snap[name])
        out[name] = snap[name][(ring.head + np.arange(ring.n_free)) % max(cap, 1)].copy()
    if cfg.num_state_slots:
        table = snap["state_table"]
        n = cfg.max_reqs + cfg.max_handles
        out["state_slots"] = table[:n].copy()
        depth = np.count_nonzero(led.spec_steps, axis=1)
        for r in np.flatnonzero(depth):
            k = int(np.count_nonzero(led.spec_state[r, depth[r] - 1]))
            base = n + r * cfg.max_spec_tokens
            out[f"spec[{r}]"] = table[base:base + k].copy()
    out["err"] = snap["err"].copy()
    return out


def same_state(a: dict, b: dict) -> str | None:
    """The first key where two :func:`defined_state` dicts differ (None: equal)."""
    import numpy as np

    if a.keys() != b.keys():
        return f"keys {sorted(a.keys() ^ b.keys())}"
    for k in a:
        if not np.array_equal(np.asarray(a[k]), np.asarray(b[k])):
            return k
    return None
