"""The conformance workloads: seeded, small enough for a 2-core CPU, each one vLLM path.

Each is a plain dict (the harness's input): scheduler sizes, KV-cache groups, the block
pool, and requests (id, prompt tokens, max_tokens, arrival step, cache salt), aborts as
``(step, request id)``. Prompts come from ``random.Random(seed)``; nothing else varies.
"""

from __future__ import annotations

import random

__all__ = ["WORKLOADS", "workload"]


def _base(**kw) -> dict:
    w = {"block_size": 16, "max_model_len": 1024, "max_num_seqs": 16,
         "max_num_batched_tokens": 64, "num_blocks": 61, "caching": True}
    w.update(kw)
    return w


def _shared_prefix(seed: int, n: int = 16, shared: int = 96, own: int = 8,
                   max_tokens: int = 40, salt=None, first_id: int = 0) -> list[dict]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 900) for _ in range(shared)]
    return [{"id": f"r{first_id + i}", "prompt": prefix + [rng.randrange(3, 900)
                                                            for _ in range(own)],
             "max_tokens": max_tokens, "arrive": i // 4, "salt": salt} for i in range(n)]


def _mixed(seed: int, n: int, lo: int = 20, hi: int = 200, max_tokens=(8, 60)) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"r{i}", "prompt": [rng.randrange(3, 900) for _ in range(rng.randint(lo, hi))],
             "max_tokens": rng.randint(*max_tokens), "arrive": rng.randint(0, 20)}
            for i in range(n)]


def workload(name: str) -> dict:
    """The workload called ``name`` (see :data:`WORKLOADS`)."""
    if name == "shared_prefix":  # chunked prefill + prefix caching + preemption
        return _base(requests=_shared_prefix(1, max_tokens=120), num_blocks=41)
    if name == "no_caching":  # the same requests, caching off
        return _base(requests=_shared_prefix(1), caching=False)
    if name == "mixed_no_caching":  # ragged prompts and outputs, arrivals over 20 steps
        return _base(requests=_mixed(2, 24), caching=False, num_blocks=81)
    if name == "sliding_window":  # full + sliding-window groups sharing one pool
        return _base(requests=_mixed(3, 20, 40, 240), caching=False, sliding_window=32,
                     num_blocks=81)
    if name == "spec_decode":  # ngram drafts of 3, seeded acceptance
        return _base(requests=_mixed(4, 16), caching=False, spec_tokens=3, num_blocks=81)
    if name == "mamba_hybrid":  # full attention + a Mamba group (a state block a request)
        return _base(requests=_mixed(8, 20), caching=False, mamba=True, num_blocks=45)
    if name == "tenants":  # the same prompts under two cache salts
        return _base(requests=_shared_prefix(5, n=8, salt="tenant-a")
                     + _shared_prefix(5, n=8, salt="tenant-b", first_id=8), num_blocks=121)
    if name == "aborts":  # requests aborted while waiting, prefilling and decoding
        return _base(requests=_mixed(6, 20), caching=False, num_blocks=81,
                     aborts=[(0, "r0"), (3, "r1"), (5, "r2"), (9, "r3"), (15, "r4"),
                             (25, "r5")])
    if name == "shared_prefix_roomy":  # prefix caching without memory pressure
        return _base(requests=_shared_prefix(7), num_blocks=401)
    raise KeyError(name)


WORKLOADS = ("no_caching", "mixed_no_caching", "sliding_window", "spec_decode", "aborts",
             "mamba_hybrid",
             "shared_prefix", "shared_prefix_roomy", "tenants")
