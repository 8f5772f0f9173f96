"""vLLM's real v1 Scheduler on the CPU with a fake model runner: the conformance harness's parts.

Runs in the engine environment (engines/vllm/install.sh), never in the project's .venv.
:func:`build` makes a ``VllmConfig`` from a tiny local model config (no weights, no hub:
a ``config.json`` written to a temporary folder), a ``KVCacheConfig`` with the workload's
groups, and the scheduler class asked for: vLLM's own ``Scheduler`` or the one
``SchedulerConfig.scheduler_cls`` names (graphalloc's). :func:`run` drives it: requests
arrive at their step, ``schedule()``, a deterministic fake runner (a sampled token is a
hash of the request id and position; drafts of ``k`` tokens, of which a seeded number are
accepted), ``update_from_output()``, aborts at their step; every step is recorded as a
plain dict (scheduled tokens per request, preempted, finished, hit tokens of the requests
scheduled for the first time, spec tokens), and each request's output tokens at the end.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

__all__ = ["build", "run", "make_requests", "fake_output", "GRAPHALLOC_CLS"]

GRAPHALLOC_CLS = "graphalloc.integrations.vllm_scheduler.GraphallocAsyncScheduler"
_MODEL_DIR = None
_TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
         "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 8192,
         "rms_norm_eps": 1e-5, "torch_dtype": "float32", "eos_token_id": 2,
         "bos_token_id": 1}


def _model_dir() -> str:
    global _MODEL_DIR
    if _MODEL_DIR is None:
        _MODEL_DIR = tempfile.mkdtemp(prefix="tiny-llama-")
        with open(os.path.join(_MODEL_DIR, "config.json"), "w") as f:
            json.dump(_TINY, f)
        init_none_hash(sha256)
    return _MODEL_DIR


def build(w: dict, manager: str):
    """The scheduler of workload ``w`` with vLLM's manager (``"vllm"``) or graphalloc's."""
    bs, mml = w["block_size"], w["max_model_len"]
    sched = SchedulerConfig(
        max_num_seqs=w["max_num_seqs"], max_num_batched_tokens=w["max_num_batched_tokens"],
        max_model_len=mml, enable_chunked_prefill=True, is_encoder_decoder=False,
        **({"scheduler_cls": GRAPHALLOC_CLS} if manager == "graphalloc" else {}))
    model = ModelConfig(model=_model_dir(), skip_tokenizer_init=True, dtype="float32",
                        max_model_len=mml)
    cache = CacheConfig(block_size=bs, enable_prefix_caching=w["caching"])
    cache.num_gpu_blocks = w["num_blocks"]
    spec = None
    if w.get("spec_tokens"):
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=w["spec_tokens"],
                                 prompt_lookup_min=1, prompt_lookup_max=2)
    cfg = VllmConfig(scheduler_config=sched, model_config=model, cache_config=cache,
                     device_config=DeviceConfig("cpu"), speculative_config=spec)
    groups = [KVCacheGroupSpec(["full"], FullAttentionSpec(
        block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32))]
    if w.get("sliding_window"):
        groups.append(KVCacheGroupSpec(["swa"], SlidingWindowSpec(
            block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32,
            sliding_window=w["sliding_window"])))
    if w.get("mamba"):  # one state block per request, vLLM's "none" cache mode
        groups.append(KVCacheGroupSpec(["mamba"], MambaSpec(
            block_size=bs, shapes=((4, 4),), dtypes=(torch.float32,))))
    kv = KVCacheConfig(num_blocks=w["num_blocks"], kv_cache_tensors=[], kv_cache_groups=groups)
    cls = cfg.scheduler_config.get_scheduler_cls()
    return cls(vllm_config=cfg, kv_cache_config=kv,
               structured_output_manager=StructuredOutputManager(cfg), block_size=bs,
               log_stats=True)


def _token(rid: str, pos: int) -> int:
    digest = hashlib.blake2b(f"{rid}:{pos}".encode(), digest_size=4).digest()
    return 3 + int.from_bytes(digest, "little") % 900


def make_requests(w: dict) -> list[tuple[int, Request]]:
    """``(arrival step, Request)`` of workload ``w`` (its ``requests`` list of dicts:
    ``id``, ``prompt`` tokens, ``max_tokens``, ``arrive``, optional ``salt``)."""
    hasher = get_request_block_hasher(w["block_size"], sha256)
    out = []
    for r in w["requests"]:
        req = Request(request_id=r["id"], prompt_token_ids=list(r["prompt"]),
                      sampling_params=SamplingParams(max_tokens=r["max_tokens"],
                                                     ignore_eos=True),
                      pooling_params=None, cache_salt=r.get("salt"), block_hasher=hasher,
                      arrival_time=float(r.get("arrive", 0)))
        out.append((r.get("arrive", 0), req))
    return out


def fake_output(s, so, k: int = 0, drafts: list | None = None) -> ModelRunnerOutput:
    """The fake runner's output for ``so``: a request whose scheduled tokens reach its end
    samples ``1 + accepted`` tokens (deterministic); ``drafts`` (when ``k``) gets the
    next drafts of ``k`` tokens."""
    ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        req = s.requests[rid]
        n = so.num_scheduled_tokens[rid]
        spec = so.scheduled_spec_decode_tokens.get(rid, ())
        if req.num_computed_tokens + n < req.num_tokens + len(spec):
            sampled.append([])
            continue
        pos = req.num_tokens
        accept = (_token(rid, pos + 7) % (len(spec) + 1)) if spec else 0
        sampled.append([_token(rid, pos + j) for j in range(accept + 1)])
        if k and drafts is not None:
            drafts.append((rid, [_token(rid, pos + 100 + j) for j in range(k)]))
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: j for j, r in enumerate(ids)},
                             sampled_token_ids=sampled)


def run(w: dict, manager: str, *, max_steps: int = 2000, timed: bool = False) -> dict:
    """Drive workload ``w``; the per-step records, the outputs and (``timed``) the
    seconds of each ``schedule()`` + ``update_from_output()``."""
    s = build(w, manager)
    arrivals = make_requests(w)
    aborts = {}
    for step, rid in w.get("aborts", ()):
        aborts.setdefault(step, []).append(rid)
    k = w.get("spec_tokens", 0)
    steps, times, outputs = [], [], {}
    seen = set()
    i = 0
    while i < max_steps:
        for arrive, req in arrivals:
            if arrive == i:
                s.add_request(req)
        if i in aborts:
            s.finish_requests(aborts[i], RequestStatus.FINISHED_ABORTED)
        if not s.has_unfinished_requests() and all(a <= i for a, _ in arrivals):
            break
        t0 = time.perf_counter()
        so = s.schedule()
        t1 = time.perf_counter()
        ids = list(so.num_scheduled_tokens)
        drafts = []
        out = fake_output(s, so, k, drafts)
        t2 = time.perf_counter()
        s.update_from_output(so, out)
        t3 = time.perf_counter()
        if k and drafts:
            s.update_draft_token_ids(DraftTokenIds([d[0] for d in drafts],
                                                   [d[1] for d in drafts]))
        hits = {}
        for nr in so.scheduled_new_reqs:
            hits[nr.req_id] = nr.num_computed_tokens
        for rid in ids:
            if rid not in seen:
                seen.add(rid)
        steps.append({
            "scheduled": sorted(so.num_scheduled_tokens.items()),
            "spec": sorted((r, len(v)) for r, v in so.scheduled_spec_decode_tokens.items()),
            "preempted": sorted(so.preempted_req_ids or ()),
            "finished": sorted(so.finished_req_ids),
            "hits": sorted(hits.items()),
        })
        times.append((t1 - t0) + (t3 - t2))
        i += 1
    for _, req in arrivals:
        outputs[req.request_id] = list(req.output_token_ids)
    stats = {"steps": len(steps),
             "preemptions": sum(len(st["preempted"]) for st in steps),
             "hit_tokens": sum(n for st in steps for _, n in st["hits"]),
             "tokens_scheduled": sum(n for st in steps for _, n in st["scheduled"])}
    res = {"steps": steps, "outputs": outputs, "stats": stats, "scheduler": type(s).__name__}
    if timed:
        res["times"] = times
    return res
