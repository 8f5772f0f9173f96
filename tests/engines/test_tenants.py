"""Tenants are isolated on every path that keys pages, and every page is hashed once.

Two tenants sending the same prompt share no page: through ``PrefixCache`` directly (a
salt), the SGLang seam (the request's ``extra_key``), the vLLM facade (``cache_salt``, or
the engine's own block hashes), both page-key hashes. The same tenant hits its own
prefix, and a request without a salt stays in the default namespace (it hits neither
tenant). Dropping the salt anywhere on a path makes its "share no page" assertion fail.

Hashing once: a counting stand-in for the compiled hash counts the pages hashed along a
request's life through each path (match at admission, insert at its end): each of its
whole pages exactly once.
"""

from __future__ import annotations

import dataclasses
import types

import pytest

import graphalloc as ga
from graphalloc.integrations.sglang import SGLangAllocator
from graphalloc.integrations.vllm import GraphallocKVCacheManager
from graphalloc.sharing import page_keys as pk

PS = 4
HASHES = ["siphash", "blake2b"]


def config(ps=PS):
    cfg = ga.AllocatorConfig.for_engine(
        max_running_requests=6, chunked_prefill_size=48, max_context_len=128, page_size=ps,
        model_sliding_window=65, num_full_pages=200, num_swa_pages=200, max_reqs=12)
    return dataclasses.replace(cfg, max_handles=16, max_alloc_rows=2 * cfg.max_alloc_rows)


PROMPT = list(range(500, 524))  # 6 pages


# ---- PrefixCache directly ---------------------------------------------------------------
def serve(alloc, tokens, salt):
    """Prefill ``tokens`` for one request of ``salt`` on its cache hit, cache it, release it.
    Returns (hit tokens, FULL pages it allocated)."""
    cache = alloc.prefix_cache
    hit = cache.match(tokens[:-1], salt=salt)
    free0 = alloc.n_free("full")
    row = alloc.admit(handle=hit.handle) if hit.cached_tokens else alloc.admit()
    alloc.alloc_extend([row], [len(tokens) - hit.cached_tokens])
    used = free0 - alloc.n_free("full")
    cache.insert(row, tokens, keys=hit.keys)  # the match's keys: no page hashed again
    alloc.release([row])
    return hit.cached_tokens, used


@pytest.mark.parametrize("key_hash", HASHES)
def test_prefix_cache_tenants_share_no_page(key_hash):
    alloc = ga.HybridAllocator(config(), prefix_cache=key_hash)
    n_pages = -(-(len(PROMPT) + 1) // PS)
    assert serve(alloc, PROMPT + [1], "tenant-a") == (0, n_pages)
    assert serve(alloc, PROMPT + [1], "tenant-b") == (0, n_pages)  # all of its pages fresh
    assert serve(alloc, PROMPT + [1], None) == (0, n_pages)  # the default namespace
    assert len(alloc.prefix_cache) == 3
    assert serve(alloc, PROMPT + [2], "tenant-a") == (24, 1)  # its own prefix: a hit
    assert serve(alloc, PROMPT + [2], b"tenant-b") == (24, 1)  # bytes or str: one salt
    assert serve(alloc, PROMPT + [2], "") == (24, 1)  # empty = no salt
    alloc.prefix_cache.drop_all()
    assert alloc.n_free("full") == alloc.config.num_full_pages and alloc.audit() == []


def test_extra_keys_separate_prefixes_from_their_page_on():
    """Multimodal hashes on page 3: a prompt whose page 3 holds another image shares pages
    0-2 (text before the image) and nothing from page 3 on."""
    alloc = ga.HybridAllocator(config(), prefix_cache=True)
    cache = alloc.prefix_cache
    row = alloc.admit()
    alloc.alloc_extend([row], [len(PROMPT)])
    cache.insert(row, PROMPT, extra_keys=[None, None, None, "image-1"])
    alloc.release([row])
    same = cache.match(PROMPT + [0], extra_keys=[None, None, None, "image-1"])
    other = cache.match(PROMPT + [0], extra_keys=[None, None, None, "image-2"])
    assert same.full_tokens == 24 and other.full_tokens == 12


# ---- the SGLang seam --------------------------------------------------------------------
def sglang_req(tokens, extra_key=None):
    return types.SimpleNamespace(origin_input_ids=list(tokens), output_ids=[],
                                 req_pool_idx=None, last_node=None, extra_key=extra_key)


def sglang_serve(seam, req, n_decode=2):
    """match_prefix, one prefill, ``n_decode`` decodes, cache_finished_req, flush.
    Returns (hit tokens, FULL pages the prefill allocated)."""
    alloc = seam.alloc
    p = seam.match_prefix(req)
    free0 = alloc.n_free("full")
    batch = types.SimpleNamespace(reqs=[req], prefix_lens=[p],
                                  extend_lens=[len(req.origin_input_ids) - p])
    seam.prepare_for_extend(batch)
    used = free0 - alloc.n_free("full")
    n = len(req.origin_input_ids)
    for i in range(n_decode):
        req.output_ids.append(900 + i)
        seam.prepare_for_decode(types.SimpleNamespace(reqs=[req], seq_lens_cpu=[n + i]))
    seam.cache_finished_req(req)
    seam.flush()
    return p, used


@pytest.mark.parametrize("key_hash", HASHES)
def test_sglang_seam_extra_keys_share_no_page(key_hash):
    alloc = ga.HybridAllocator(config(), prefix_cache=key_hash)
    seam = SGLangAllocator(alloc)
    pages = len(PROMPT) // PS
    assert sglang_serve(seam, sglang_req(PROMPT, "lora-1")) == (0, pages)
    assert sglang_serve(seam, sglang_req(PROMPT, "lora-2")) == (0, pages)
    assert sglang_serve(seam, sglang_req(PROMPT)) == (0, pages)
    assert sglang_serve(seam, sglang_req(PROMPT + [5], "lora-1"))[0] == 24  # its own: a hit
    assert sglang_serve(seam, sglang_req(PROMPT + [5]))[0] == 24  # no extra_key: its own
    assert alloc.audit() == []


# ---- the vLLM facade --------------------------------------------------------------------
def vllm_serve(mgr, rid, tokens, n_decode=2, **key_args):
    """get_computed_blocks, allocate, decode ``n_decode`` tokens, free with the tokens.
    Returns (hit tokens, FULL pages the prefill allocated)."""
    alloc = mgr.alloc
    hit, n = mgr.get_computed_blocks(rid, tokens, **key_args)
    free0 = alloc.n_free("full")
    mgr.allocate_slots(rid, len(tokens) - n, num_new_computed_tokens=n,
                       new_computed_blocks=hit if n else None)
    mgr.run_step()
    used = free0 - alloc.n_free("full")
    computed = len(tokens)
    for _ in range(n_decode):
        mgr.allocate_slots(rid, 1, num_computed_tokens=computed)
        mgr.run_step()
        computed += 1
    mgr.free(rid, list(tokens) + [900] * n_decode, **key_args)
    mgr.run_step()
    return n, used


@pytest.mark.parametrize("key_hash", HASHES)
def test_vllm_facade_cache_salts_share_no_block(key_hash):
    alloc = ga.HybridAllocator(config(), prefix_cache=key_hash)
    mgr = GraphallocKVCacheManager(alloc, enable_caching=True)
    pages = len(PROMPT) // PS
    assert vllm_serve(mgr, "a", PROMPT, cache_salt="tenant-a") == (0, pages)
    assert vllm_serve(mgr, "b", PROMPT, cache_salt="tenant-b") == (0, pages)
    assert vllm_serve(mgr, "c", PROMPT) == (0, pages)
    assert vllm_serve(mgr, "a2", PROMPT + [7], cache_salt="tenant-a")[0] == 24
    assert vllm_serve(mgr, "c2", PROMPT + [7])[0] == 24
    before = len(alloc.prefix_cache)
    mgr.get_computed_blocks("d", PROMPT, cache_salt="tenant-d")
    with pytest.raises(ga.ContractError, match="salt"):  # a request keeps its salt
        mgr.get_computed_blocks("d", PROMPT, cache_salt="tenant-e")
    assert mgr.free("d") is False and len(alloc.prefix_cache) == before
    assert alloc.audit() == []


def test_vllm_facade_takes_the_engines_block_hashes():
    """vLLM computes ``request.block_hashes`` itself (its salt in them): the facade keys
    blocks with them as they are, so two tenants' hashes share nothing, equal ones hit."""
    alloc = ga.HybridAllocator(config(), prefix_cache=True)
    mgr = GraphallocKVCacheManager(alloc, enable_caching=True)

    def engine_hashes(tenant, n):
        return [f"{tenant}:{j}".encode() for j in range(n)]

    pages = len(PROMPT) // PS
    assert vllm_serve(mgr, "a", PROMPT, block_hashes=engine_hashes("x", 8)) == (0, pages)
    assert vllm_serve(mgr, "b", PROMPT, block_hashes=engine_hashes("y", 8)) == (0, pages)
    assert vllm_serve(mgr, "a2", PROMPT + [1], block_hashes=engine_hashes("x", 8))[0] == 24
    assert vllm_serve(mgr, "c", PROMPT)[0] == 0  # graphalloc's own keys: another chain
    with pytest.raises(ga.ContractError, match="block_hashes"):
        mgr.get_computed_blocks("e", PROMPT, block_hashes=tuple(engine_hashes("x", 8)))


# ---- each page hashed once ----------------------------------------------------------------
class CountingHash:
    """The compiled hash, counting the pages it hashes."""

    def __init__(self, real):
        self.real, self.pages = real, 0

    def extend(self, out, tokens, start, n_pages, *rest):
        self.pages += n_pages
        return self.real.extend(out, tokens, start, n_pages, *rest)

    def siphash128(self, *args):
        return self.real.siphash128(*args)


@pytest.fixture
def counting(monkeypatch):
    if not pk.COMPILED:
        pytest.skip("graphalloc.sharing._ckeys not built")
    counter = CountingHash(pk._ckeys)
    monkeypatch.setattr(pk, "_ckeys", counter)
    return counter


def test_each_page_is_hashed_once_through_every_path(counting):
    alloc = ga.HybridAllocator(config(), prefix_cache=True)
    serve(alloc, PROMPT + [1, 2, 3, 4, 5], "t")  # 29 tokens: 7 whole pages
    assert counting.pages == 7
    seam = SGLangAllocator(alloc)
    counting.pages = 0
    sglang_serve(seam, sglang_req(list(range(40, 70))), n_decode=3)  # 33 tokens
    assert counting.pages == 8
    mgr = GraphallocKVCacheManager(alloc, enable_caching=True)
    counting.pages = 0
    vllm_serve(mgr, "r", list(range(80, 110)), n_decode=6, cache_salt="t")  # 36 tokens
    assert counting.pages == 9
