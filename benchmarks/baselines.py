"""The eager baselines graphalloc is measured against, over graphalloc's own table layout.

Layout (as in ``graphalloc.device_state``): ``full_to_swa`` has
``(num_full_pages + 1) * ps`` entries, full slot -> SWA slot, 0 = no peer, page
0 is the sink; a free is given by its *representatives*, the full slots at the
starts of its pages (``req_to_token[r, s + j*ps]``).

Free of one segment, three ways::

    eager_get_and_clear_swa_pages   the pre-fusion Torch sequence engines used:
                                    index, gt, floor_divide x2, mul, arange, add,
                                    index_fill_ -- 8 launches (3 at page_size 1)
    get_and_clear_swa_pages         graphalloc.kernels: one fused launch
    (graphalloc)                    a step graph replay (benchmarks/workloads.py)

A decode step also allocates one token for each of B requests; the baselines do
that with :func:`eager_decode_alloc`, one batched Torch sequence (the same for
both baselines, so it shifts them equally).
"""

from __future__ import annotations

import torch

__all__ = ["eager_get_and_clear_swa_pages", "load_fused", "FreeTables", "DecodeTables"]


def eager_get_and_clear_swa_pages(representatives: torch.Tensor, full_to_swa: torch.Tensor,
                                  page_size: int):
    """The pre-fusion eager free: SWA pages of the representatives' full pages, mapping
    cleared. Same signature and results as ``get_and_clear_swa_pages(validate=False)``.

    Launches, in order (page_size > 1): gather peers, mapped check, SWA page, FULL page,
    FULL page starts, page offsets, expanded slots, clear -- 8. At page_size 1 the page
    arithmetic is the identity: gather, check, clear -- 3.
    """
    swa_slots = full_to_swa[representatives]                    # 1 index (gather peers)
    mapped = swa_slots > 0                                      # 2 gt (mapped check)
    if page_size == 1:
        full_to_swa.index_fill_(0, representatives, 0)          # 3 index_fill_ (clear)
        return swa_slots, mapped
    swa_pages = torch.floor_divide(swa_slots, page_size)        # 3 floor_divide (SWA page)
    full_pages = torch.floor_divide(representatives, page_size)  # 4 floor_divide (FULL page)
    page_starts = full_pages * page_size                        # 5 mul (FULL page starts)
    offsets = torch.arange(page_size, device=full_to_swa.device,
                           dtype=representatives.dtype)         # 6 arange (page offsets)
    slots = (page_starts[:, None] + offsets).reshape(-1)        # 7 add (expanded slots)
    full_to_swa.index_fill_(0, slots, 0)                        # 8 index_fill_ (clear)
    return swa_pages, mapped


def load_fused(backend: str):
    """``(fn, name, None)`` for the single fused free of ``backend`` ("triton" or "torch",
    the reference twin), or ``(None, None, reason)`` when it cannot be imported."""
    name = "get_and_clear_swa_pages" if backend == "triton" else "get_and_clear_swa_pages_torch"
    try:
        from graphalloc.kernels import get_and_clear
    except Exception as exc:  # not there yet, or Triton missing
        return None, None, f"graphalloc.kernels.get_and_clear: {type(exc).__name__}: {exc}"
    fn = getattr(get_and_clear, name, None)
    if fn is None:
        return None, None, f"graphalloc.kernels.get_and_clear has no {name}"
    return (lambda reps, f2s, ps: fn(reps, f2s, ps, validate=False)), name, None


class FreeTables:
    """B requests, each owning one ``n_pages``-page segment with live SWA peers.

    Full pages and SWA pages are shuffled (seeded), so neither the gathers nor the
    clears walk memory in order. ``representatives[r]`` is request r's segment
    (contiguous, int64, built once: the baselines get it for free). ``restore()``
    puts every mapping back (one device copy), so each timed free clears live pages.
    """

    def __init__(self, n_reqs: int, n_pages: int, page_size: int, device, *,
                 dtype=torch.int64, seed: int = 0):
        ps = page_size
        n_full = n_reqs * n_pages
        gen = torch.Generator().manual_seed(seed)
        full_pages = torch.randperm(n_full, generator=gen) + 1  # page 0 is the sink
        swa_pages = torch.randperm(n_full, generator=gen) + 1
        offs = torch.arange(ps)
        full_slots = (full_pages[:, None] * ps + offs).reshape(-1)
        mapping = torch.zeros((n_full + 1) * ps, dtype=dtype)
        mapping[full_slots] = (swa_pages[:, None] * ps + offs).reshape(-1).to(dtype)
        self.page_size = ps
        self.full_to_swa = mapping.to(device)
        self.pristine = self.full_to_swa.clone()
        req_to_token = full_slots.view(n_reqs, n_pages * ps).to(dtype)
        self.representatives = [req_to_token[r, ::ps].contiguous().to(device)
                                for r in range(n_reqs)]
        self.expected_swa_pages = swa_pages.view(n_reqs, n_pages).to(dtype)

    def restore(self) -> None:
        self.full_to_swa.copy_(self.pristine)

    def free_all(self, free_fn) -> None:
        """One free per request, back to back (the looped baseline's step)."""
        f2s, ps = self.full_to_swa, self.page_size
        for reps in self.representatives:
            free_fn(reps, f2s, ps)


class DecodeTables:
    """One decode token for each of B requests, allocated eagerly (the baselines' decode).

    Request i sits at position ``ps + i % ps`` (in its second page): the requests
    with ``i % ps == 0`` start a page and pop one FULL and one SWA page; the others
    continue their page. The host knows the positions, so it knows the pop count
    (no sync). The free lists are never advanced, so every call does the same
    work and writes the same values (idempotent: no restore needed).
    """

    def __init__(self, n_reqs: int, page_size: int, device, *, dtype=torch.int64):
        ps, n = page_size, n_reqs
        self.page_size = ps
        self.rows = torch.arange(n, device=device)
        self.pos = (ps + torch.arange(n) % ps).to(device)
        # Request i: page 0 is full page 1 + i, page 1 is full page 1 + n + i; pages
        # 1 + 2n .. 3n are free (popped in order). SWA page ids equal full page ids.
        offs = torch.arange(ps)
        pages = torch.stack([1 + torch.arange(n), 1 + n + torch.arange(n)], dim=1)
        slots = (pages[:, :, None] * ps + offs).reshape(n, 2 * ps)
        self.req_to_token = slots.to(dtype).to(device)
        self.full_to_swa = torch.zeros((3 * n + 1) * ps, dtype=dtype, device=device)
        self.full_to_swa[self.req_to_token.reshape(-1)] = self.req_to_token.reshape(-1)
        self.full_free = torch.arange(1 + 2 * n, 1 + 3 * n, dtype=dtype, device=device)
        self.swa_free = self.full_free.clone()
        self.full_head = 0  # host-side free-list heads: the host knows the pop count
        self.swa_head = 0

    def step(self):
        """Allocate: ~20 small launches, batched over the B requests."""
        return eager_decode_alloc(self)


def eager_decode_alloc(t: DecodeTables):
    """Batched eager decode allocation: new pages popped in request order, page-continuing
    tokens take the next slot; writes ``req_to_token`` and the per-token mapping."""
    ps = t.page_size
    pos = t.pos
    last = t.req_to_token[t.rows, pos - 1]                       # sub, index
    new_page = (pos % ps) == 0                                   # remainder, eq
    rank = (torch.cumsum(new_page, 0) - 1).clamp_(min=0)         # cumsum, sub, clamp
    cap = t.full_free.shape[0]
    full_page = t.full_free[(rank + t.full_head) % cap]          # add, remainder, index
    swa_page = t.swa_free[(rank + t.swa_head) % cap]             # add, remainder, index
    full_slot = torch.where(new_page, full_page * ps, last + 1)  # mul, add, where
    swa_slot = torch.where(new_page, swa_page * ps,
                           t.full_to_swa[last] + 1)              # mul, index, add, where
    t.req_to_token[t.rows, pos] = full_slot                      # index_put_
    t.full_to_swa[full_slot] = swa_slot                          # index_put_
    return full_slot, swa_slot


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run benchmarks/bench_frees.py "
            "instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
