"""The scheduler benchmark's trace types: what a trace is drawn from and what it holds.

:class:`WorkloadSpec` (the workload's parameters), :class:`TraceStep` (one scheduler
iteration's decisions and the page counts each replay must report) and :class:`Trace`
(the steps, the phases, the sizes the pools and shapes need, and with a prefix workload
the requests' token ids and the hit rate). ``sched_workload.generate`` makes them; its
docstring says what every field means for the replays.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np
from sched_prefix import PREFIX_WORKLOADS

__all__ = ["WorkloadSpec", "TraceStep", "Trace", "STEP_CLASSES"]

# Step classes, for per-class statistics (a step is in the first class it matches).
STEP_CLASSES = ("prefill", "release", "decode+evict", "decode")
_EMPTY = np.zeros(0, dtype=np.int64)


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """What the trace is drawn from.

    ``n_running`` (B): requests running at once; ``window``: the MODEL's window W (the
    allocator's is ``W - 1``); ``eviction_interval``: decode tokens between a request's
    window evictions; ``chunk_tokens``: the chunked-prefill budget C per step;
    lengths: log-normal with the given medians and ``sigma``, prompts clipped to
    ``[1, max_prompt]`` and outputs to ``[1, max_output]`` (``prompt + output <=
    max_context_len``).

    ``prefix`` (None, ``"system-prompt"``, ``"multi-turn"``): the prefix-caching workload
    (``sched_prefix.py``), with ``system_prompts`` prompts of ``system_prompt_tokens``
    tokens, or conversations of ``turns_mean`` turns on average.
    """

    n_running: int
    page_size: int
    window: int
    eviction_interval: int
    max_context_len: int
    chunk_tokens: int = 8192
    prompt_median: int = 512
    output_median: int = 128
    sigma: float = 0.8
    seed: int = 0
    prefix: str | None = None
    system_prompts: int = 4
    system_prompt_tokens: int = 1024
    turns_mean: float = 4.0

    def __post_init__(self):
        for name in ("n_running", "page_size", "window", "eviction_interval",
                     "max_context_len", "chunk_tokens", "prompt_median", "output_median",
                     "system_prompts", "system_prompt_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.max_context_len < 2:
            raise ValueError("max_context_len must be >= 2")
        if self.prefix not in (None, *PREFIX_WORKLOADS):
            raise ValueError(f"prefix must be None or one of {PREFIX_WORKLOADS}, got "
                             f"{self.prefix!r}")
        if self.prefix == "system-prompt" and self.system_prompt_tokens >= self.max_prompt:
            raise ValueError(f"system_prompt_tokens={self.system_prompt_tokens} leaves no "
                             f"user tokens in a prompt of at most {self.max_prompt}: use "
                             "fewer, or a larger max_context_len")
        if self.prefix == "multi-turn" and self.window % self.page_size > 1:
            raise ValueError(
                f"multi-turn needs window % page_size in (0, 1), got window={self.window}, "
                f"page_size={self.page_size}: otherwise a finished turn may have freed the "
                "SWA page its next turn's window needs, which SGLang frees and vLLM keeps "
                "cached (sched_prefix.py), and the engines' hits differ")
        if not self.turns_mean >= 1.0:
            raise ValueError(f"turns_mean must be >= 1, got {self.turns_mean!r}")

    @property
    def alloc_window(self) -> int:
        """The allocator's window, ``max(W - 1, 1)`` (``AllocatorConfig.for_engine``'s)."""
        return max(self.window - 1, 1)

    @property
    def max_prompt(self) -> int:
        return self.max_context_len // 2

    @property
    def max_output(self) -> int:
        return self.max_context_len - self.max_prompt

    def mean_output(self) -> float:
        return self.output_median * math.exp(self.sigma ** 2 / 2)


@dataclasses.dataclass
class TraceStep:
    """One scheduler iteration's decisions (request ids, int64 arrays).

    ``extend_ids`` / ``extend_n``: prefill chunks (``admit`` lists those that start here,
    in the same order they appear in ``extend_ids``); ``decode``: one token each.
    ``expect``: (FULL allocated, SWA allocated, FULL freed, SWA freed) pages.
    ``n_evict_segments`` / ``n_evict_pages``: evictions that free at least one page.
    Prefix caching (module docstring): ``hit`` the hit tokens of each admitted request
    (aligned with ``admit``), ``extend_n_nocache`` the chunks of a replay without a cache,
    ``expect_cache`` (FULL allocated, SWA allocated, FULL freed) of one with a cache.
    ``expect`` and the eviction and row counts are the replay without a cache.
    """

    index: int
    phase: str
    release: np.ndarray
    evict: np.ndarray
    admit: np.ndarray
    extend_ids: np.ndarray
    extend_n: np.ndarray
    decode: np.ndarray
    expect: tuple
    n_evict_segments: int
    n_evict_pages: int
    n_release_rows: int  # graphalloc release rows (1 or 2 per release + 1 per eviction)
    hit: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY)
    extend_n_nocache: np.ndarray | None = None
    expect_cache: tuple | None = None

    def __post_init__(self):
        if self.extend_n_nocache is None:
            self.extend_n_nocache = self.extend_n

    @property
    def step_class(self) -> str:
        if len(self.extend_ids):
            return "prefill"
        if len(self.release):
            return "release"
        if self.n_evict_segments:
            return "decode+evict"
        return "decode"

    @property
    def n_tokens(self) -> int:
        return int(self.extend_n.sum()) + len(self.decode)


@dataclasses.dataclass
class Trace:
    """A generated trace: the steps, where each phase starts, and what the pools need."""

    spec: WorkloadSpec
    steps: list
    phase_start: dict  # phase -> first step index
    n_requests: int  # request ids are 0 .. n_requests - 1
    peak_full: int  # pages in use right after a step's allocations, at most
    peak_swa: int
    max_releases: int  # requests released in one step, at most
    max_free_lanes: int  # FULL pages freed + SWA pages evicted in one step, at most
    max_release_rows: int
    # prefix caching (module docstring); the defaults are a trace without it
    max_alloc_row_tokens: int = 0  # tokens one request allocates in one step, at most
    max_step_tokens: int = 0  # tokens allocated in one step, at most
    cache_pages: int = 0  # pages a replay with a cache allocates in all (its no-evict pool)
    tokens: list | None = None  # token ids of each request (prompt + output)
    fill: np.ndarray | None = None  # prompt tokens (+ bootstrap age) of each request
    prefix: dict | None = None  # PrefixModel.summary(): the hit rate the trace expects

    def expected(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """``[n, 4]`` int64: the generator's page counts of steps ``[start, stop)``."""
        return np.array([s.expect for s in self.steps[start:stop]], dtype=np.int64).reshape(
            -1, 4)

    def expected_cache(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """``[n, 3]`` int64: ``expect_cache`` of steps ``[start, stop)``."""
        return np.array([s.expect_cache for s in self.steps[start:stop]],
                        dtype=np.int64).reshape(-1, 3)

    def hits(self, stop: int | None = None) -> np.ndarray:
        """Hit tokens of each request admitted in steps ``[0, stop)`` (-1: not admitted)."""
        out = np.full(self.n_requests, -1, dtype=np.int64)
        for s in self.steps[:stop]:
            if len(s.admit):
                out[s.admit] = s.hit if len(s.hit) else 0
        return out

    def phase_range(self, phase: str) -> tuple[int, int]:
        order = list(self.phase_start)
        i = order.index(phase)
        stop = self.phase_start[order[i + 1]] if i + 1 < len(order) else len(self.steps)
        return self.phase_start[phase], stop

    def stats(self, start: int, stop: int) -> dict:
        """Means over steps ``[start, stop)`` (for the report)."""
        steps = self.steps[start:stop]
        if not steps:
            return {}
        classes = collections.Counter(s.step_class for s in steps)

        def mean(fn):
            return float(np.mean([fn(s) for s in steps]))

        admitted = np.concatenate([s.admit for s in steps])
        hit = np.concatenate([s.hit if len(s.hit) else np.zeros(len(s.admit), np.int64)
                              for s in steps])
        prompt = int(self.fill[admitted].sum()) if self.fill is not None else 0
        return {
            "steps": len(steps),
            "hit_tokens": mean(lambda s: int(s.hit.sum())),
            "hit_rate": float(hit.sum()) / prompt if prompt else 0.0,
            "decode_rows": mean(lambda s: len(s.decode)),
            "prefill_rows": mean(lambda s: len(s.extend_ids)),
            "prefill_tokens": mean(lambda s: int(s.extend_n.sum())),
            "admits": mean(lambda s: len(s.admit)),
            "releases": mean(lambda s: len(s.release)),
            "evict_calls": mean(lambda s: len(s.evict)),
            "evict_segments": mean(lambda s: s.n_evict_segments),
            "evict_pages": mean(lambda s: s.n_evict_pages),
            "full_pages_allocated": mean(lambda s: s.expect[0]),
            "full_pages_freed": mean(lambda s: s.expect[2]),
            "swa_pages_freed": mean(lambda s: s.expect[3]),
            "step_classes": {c: classes.get(c, 0) for c in STEP_CLASSES},
        }


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run benchmarks/bench_scheduler.py "
            "instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
