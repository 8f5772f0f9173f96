"""A tiny hybrid full/sliding-window decoder whose KV caches are paged through graphalloc.

The architecture is Qwen2's (RMSNorm, rotary, grouped-query attention with
q/k/v biases, SwiGLU MLP, untied LM head) with a per-layer mix of full and
sliding-window attention (``Qwen2Config.layer_types``), the pattern of Gemma 2/3
and gpt-oss. Weights are random and held under the transformers parameter
names, so :func:`to_transformers` builds the matching ``Qwen2ForCausalLM`` and
loads them with ``strict=True``: the reference is code we did not write.

Sliding-window convention (transformers' ``sliding_window_overlay``): a query at
position ``q`` sees keys at positions ``k`` with ``q - W < k <= q``: W tokens,
itself included. At a decode step the new token sits at position ``L`` (the
length before the step), so the oldest position read is ``L - W + 1``. The
allocator frees positions below ``floor_page(L - W_alloc)`` at that step
(``StepBuilder.window_frontier``, evaluated on the length before the step), so
``W_alloc = W - 1`` (:func:`allocator_window`) is the smallest window that
never frees a position the model still reads. It is the same off-by-one
SGLang's models apply (``sliding_window - 1``).

Paged K/V (one cache per layer kind, in the model's dtype)::

    full_k/full_v  [n_full_layers, (num_full_pages + 1) * ps, n_kv_heads, head_dim]
    swa_k/swa_v    [n_swa_layers,  (num_swa_pages + 1) * ps,  n_kv_heads, head_dim]

A full layer reads position ``t`` of request row ``r`` at full slot
``req_to_token[r, t]``; an SWA layer at SWA slot ``full_to_swa[req_to_token[r, t]]``.
An SWA slot of 0 means "evicted" (position below the frontier) and is masked
out; slot 0 of either cache is the sink that padded lanes write to, never read
unmasked. Every read is a fixed-shape gather, so the forward can be captured.

Slot ``page * ps + off`` of a cache is offset ``off`` of page ``page``, so one layer's
cache viewed as ``[n_pages + 1, ps, n_kv_heads, head_dim]`` (``cache.view(-1, ps, Hkv,
D)``, no copy) is the page-indexed layout the paged decode attention kernel reads
(``graphalloc.kernels.paged_attention``; ``paged_decode.TableAttention``), and FlashInfer's
NHD paged layout (``paged_decode.FlashInferAttention``).

Half precision (``TinyHybridLM(..., dtype=torch.float16)`` or ``bfloat16``): weights, K/V
caches and activations in that dtype, and the math follows what transformers' Qwen2 does in
it, op for op, so that greedy tokens can agree: RMSNorm in float32 and cast back before the
weight (``Qwen2RMSNorm``), rotary cos/sin computed in float32 on the model's device and cast
to the dtype, attention scores and softmax in float32 with the probabilities cast to the
dtype for the product with V (what SDPA's fused kernels do), everything else (linear layers,
SwiGLU, residual adds, logits) in the dtype. In float32 every one of these is the float32
computation of before, bit for bit. :func:`to_transformers` casts the reference's
parameters only (``Module.to(dtype)`` would also round its rotary ``inv_freq`` buffer to
the dtype, which loading with ``from_pretrained(dtype=...)`` does not do).
"""

from __future__ import annotations

import dataclasses
import math

import torch

__all__ = ["ModelConfig", "PagedKV", "KeyTable", "TinyHybridLM", "allocator_window",
           "random_weights", "to_transformers", "DTYPES"]

SLIDING, FULL = "sliding_attention", "full_attention"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def allocator_window(model_window: int) -> int:
    """``AllocatorConfig.sliding_window`` that keeps exactly what a model with a
    transformers-style window of ``model_window`` tokens reads (see the module doc)."""
    return model_window - 1


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the tiny decoder. ``layer_pattern`` repeats over the layers:
    ``s`` sliding-window attention, ``f`` full attention (``"ssf"``: two SWA, one full)."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    sliding_window: int = 16
    layer_pattern: str = "sf"
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position: int = 4096

    def __post_init__(self) -> None:
        if set(self.layer_pattern) - {"s", "f"} or not self.layer_pattern:
            raise ValueError(f"layer_pattern must use 's' and 'f', got {self.layer_pattern!r}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size % num_heads and num_heads % num_kv_heads must be 0")
        kinds = set(self.layer_types)
        if kinds != {SLIDING, FULL}:
            raise ValueError(f"a hybrid model needs both layer kinds; {self.num_layers} layers "
                             f"of pattern {self.layer_pattern!r} give {sorted(kinds)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def layer_types(self) -> list[str]:
        pat = self.layer_pattern
        return [SLIDING if pat[i % len(pat)] == "s" else FULL for i in range(self.num_layers)]

    @property
    def n_swa_layers(self) -> int:
        return self.layer_types.count(SLIDING)

    @property
    def n_full_layers(self) -> int:
        return self.layer_types.count(FULL)

    def kv_bytes_per_token_layer(self, elt_bytes: int = 4) -> int:
        """K and V of one token in one layer (``elt_bytes`` per element: 4 for float32,
        2 for float16 / bfloat16)."""
        return 2 * self.num_kv_heads * self.head_dim * elt_bytes


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights under the transformers Qwen2 names (CPU).

    Scaled like 1/sqrt(fan_in) (not transformers' 0.02) so that attention is
    peaked and logits spread: a wrong window or a wrong slot changes the argmax.
    """
    g = torch.Generator().manual_seed(seed)
    h, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd

    def lin(n_out, n_in, gain=1.0):
        return torch.randn(n_out, n_in, generator=g) * (gain / math.sqrt(n_in))

    w = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, h, generator=g)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
        w[p + "self_attn.q_proj.weight"] = lin(q_out, h, 2.0)
        w[p + "self_attn.q_proj.bias"] = 0.1 * torch.randn(q_out, generator=g)
        w[p + "self_attn.k_proj.weight"] = lin(kv_out, h, 2.0)
        w[p + "self_attn.k_proj.bias"] = 0.1 * torch.randn(kv_out, generator=g)
        w[p + "self_attn.v_proj.weight"] = lin(kv_out, h)
        w[p + "self_attn.v_proj.bias"] = 0.1 * torch.randn(kv_out, generator=g)
        w[p + "self_attn.o_proj.weight"] = lin(h, q_out)
        w[p + "post_attention_layernorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
        w[p + "mlp.gate_proj.weight"] = lin(inter, h)
        w[p + "mlp.up_proj.weight"] = lin(inter, h)
        w[p + "mlp.down_proj.weight"] = lin(h, inter)
    w["model.norm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
    w["lm_head.weight"] = lin(cfg.vocab_size, h, 2.0)
    return w


class PagedKV:
    """The model's paged K/V caches, allocated once (their addresses are captured).

    ``n_full_slots`` / ``n_swa_slots`` are the allocator's pool sizes in slots,
    sink page included: ``(num_*_pages + 1) * page_size``; ``dtype`` the model's.
    """

    def __init__(self, cfg: ModelConfig, n_full_slots: int, n_swa_slots: int, device,
                 dtype: torch.dtype = torch.float32):
        shape = (cfg.num_kv_heads, cfg.head_dim)
        self.full_k = torch.zeros(cfg.n_full_layers, n_full_slots, *shape, device=device,
                                  dtype=dtype)
        self.full_v = torch.zeros_like(self.full_k)
        self.swa_k = torch.zeros(cfg.n_swa_layers, n_swa_slots, *shape, device=device,
                                 dtype=dtype)
        self.swa_v = torch.zeros_like(self.swa_k)


@dataclasses.dataclass
class KeyTable:
    """Where each query's keys live, built once per forward and shared by every layer of a
    kind (like a FlashInfer ``plan``). ``*_slot``: ``[B, K]`` cache slots; ``*_mask``:
    ``[B, Q, K]`` which keys each query sees.

    :meth:`TinyHybridLM.forward` only calls :meth:`attend`; any object with that method
    can stand in for a KeyTable (``paged_decode.TableAttention`` attends through the page
    tables instead)."""

    full_slot: torch.Tensor
    full_mask: torch.Tensor
    swa_slot: torch.Tensor
    swa_mask: torch.Tensor

    def attend(self, kind: str, q, cache_k, cache_v, n_kv_heads: int):
        """Attention of ``q`` ``[B, Q, H, D]`` over one layer's slot-indexed caches
        ``[n_slots, Hkv, D]`` (the new tokens' K/V already written): ``[B, Q, H * D]``."""
        slot, mask = ((self.full_slot, self.full_mask) if kind == FULL
                      else (self.swa_slot, self.swa_mask))
        return _attend(q, cache_k[slot], cache_v[slot], mask, n_kv_heads)


def _rms_norm(x, weight, eps):
    """Qwen2RMSNorm: normalised in float32, cast back to ``x``'s dtype, then the weight (a
    no-op cast in float32)."""
    h = x.float()
    var = h.pow(2).mean(-1, keepdim=True)
    return weight * (h * torch.rsqrt(var + eps)).to(x.dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TinyHybridLM:
    """The decoder in plain torch, reading and writing K/V through graphalloc's tables.

    :meth:`forward` is fixed-shape for fixed input shapes and never synchronises,
    so a decode step can be captured into a CUDA graph. ``dtype``: float32 (default),
    float16 or bfloat16 (see the module docstring: the half-precision math follows
    transformers').
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device,
                 dtype: torch.dtype = torch.float32):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype}")
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.w = {k: v.to(device=self.device, dtype=dtype) for k, v in weights.items()}
        hd = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64)
                                              .float() / hd))
        pos = torch.arange(cfg.max_position).float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        if dtype == torch.float32:  # cos/sin on the CPU, where the float32 reference runs
            self.cos, self.sin = emb.cos().to(self.device), emb.sin().to(self.device)
        else:  # on the device in float32, then cast: what transformers does in this dtype
            emb = emb.to(self.device)
            self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)
        # index of each layer within its kind's cache
        self.kind_index = []
        counts = {SLIDING: 0, FULL: 0}
        for kind in cfg.layer_types:
            self.kind_index.append(counts[kind])
            counts[kind] += 1

    # ---- key tables ------------------------------------------------------------------
    def key_table(self, r2t_rows, full_to_swa, q_pos, n_full_keys: int,
                  swa_window_keys: bool) -> KeyTable:
        """Slots and masks of every query's keys.

        ``r2t_rows`` ``[B, max_context_len]``: the ``req_to_token`` row of each batch lane;
        ``q_pos`` ``[B, Q]``: query positions. Full layers read positions
        ``[0, n_full_keys)`` (masked to ``<= q``). SWA layers read, with
        ``swa_window_keys`` (decode, Q = 1), the W positions ``(q - W, q]`` only; else
        positions ``[0, n_full_keys)`` masked to the window. SWA slots of 0 are masked.
        """
        W = self.cfg.sliding_window
        dev = q_pos.device
        k_full = torch.arange(n_full_keys, device=dev)
        full_slot = r2t_rows[:, :n_full_keys]
        full_mask = k_full[None, None, :] <= q_pos[:, :, None]
        if swa_window_keys:
            k_swa = q_pos[:, :1] - (W - 1) + torch.arange(W, device=dev)[None, :]  # [B, W]
        else:
            k_swa = k_full[None, :].expand(q_pos.shape[0], -1)
        swa_slot = full_to_swa[torch.gather(r2t_rows, 1, k_swa.clamp(min=0))]
        swa_mask = ((k_swa[:, None, :] <= q_pos[:, :, None])
                    & (k_swa[:, None, :] > q_pos[:, :, None] - W)
                    & (k_swa >= 0)[:, None, :] & (swa_slot != 0)[:, None, :])
        return KeyTable(full_slot, full_mask, swa_slot, swa_mask)

    # ---- forward -----------------------------------------------------------------------
    def forward(self, tokens, q_pos, keys, new_full_slot, new_swa_slot,
                kv: PagedKV) -> torch.Tensor:
        """Logits ``[B, Q, vocab]`` for ``tokens`` ``[B, Q]`` at ``q_pos`` ``[B, Q]``.

        The new tokens' K/V are first written at ``new_full_slot`` / ``new_swa_slot``
        ``[B, Q]`` (0, the sink, for padded lanes), then every query attends through
        ``keys`` (``keys.attend(kind, q, cache_k, cache_v, n_kv_heads)``, see
        :class:`KeyTable`).
        """
        cfg, w = self.cfg, self.w
        B, Q = tokens.shape
        H, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos, sin = self.cos[q_pos][:, :, None, :], self.sin[q_pos][:, :, None, :]
        x = w["model.embed_tokens.weight"][tokens]
        for i, kind in enumerate(cfg.layer_types):
            p = f"model.layers.{i}."
            h = _rms_norm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            q = torch.nn.functional.linear(h, w[p + "self_attn.q_proj.weight"],
                                           w[p + "self_attn.q_proj.bias"]).view(B, Q, H, hd)
            k = torch.nn.functional.linear(h, w[p + "self_attn.k_proj.weight"],
                                           w[p + "self_attn.k_proj.bias"]).view(B, Q, Hkv, hd)
            v = torch.nn.functional.linear(h, w[p + "self_attn.v_proj.weight"],
                                           w[p + "self_attn.v_proj.bias"]).view(B, Q, Hkv, hd)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            j = self.kind_index[i]
            if kind == FULL:
                cache_k, cache_v, new_slot = kv.full_k[j], kv.full_v[j], new_full_slot
            else:
                cache_k, cache_v, new_slot = kv.swa_k[j], kv.swa_v[j], new_swa_slot
            cache_k[new_slot.reshape(-1)] = k.reshape(-1, Hkv, hd)
            cache_v[new_slot.reshape(-1)] = v.reshape(-1, Hkv, hd)
            attn = keys.attend(kind, q, cache_k, cache_v, Hkv)
            x = x + torch.nn.functional.linear(attn, w[p + "self_attn.o_proj.weight"])
            h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            gate = torch.nn.functional.linear(h, w[p + "mlp.gate_proj.weight"])
            up = torch.nn.functional.linear(h, w[p + "mlp.up_proj.weight"])
            x = x + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up,
                                               w[p + "mlp.down_proj.weight"])
        x = _rms_norm(x, w["model.norm.weight"], cfg.rms_norm_eps)
        return torch.nn.functional.linear(x, w["lm_head.weight"])


def _attend(q, k, v, mask, n_kv_heads: int):
    """Grouped-query attention: ``q`` [B, Q, H, D], ``k``/``v`` [B, K, Hkv, D], ``mask``
    [B, Q, K]. Head h uses KV head ``h // (H / Hkv)`` (transformers' ``repeat_kv``).
    Masked scores become the dtype's minimum, not -inf, so a fully masked (padded) lane
    stays finite. Scores and softmax in float32; in half precision the probabilities are
    cast to ``v``'s dtype for the product with V (SDPA's fused kernels do the same); in
    float32 every cast is a no-op."""
    B, Q, H, D = q.shape
    rep = H // n_kv_heads
    qg = q.view(B, Q, n_kv_heads, rep, D)
    scores = torch.einsum("bqgrd,bkgd->bgrqk", qg.float(), k.float()) * (D ** -0.5)
    scores = torch.where(mask[:, None, None, :, :], scores, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.einsum("bgrqk,bkgd->bqgrd", probs, v)
    return out.reshape(B, Q, H * D)


def to_transformers(cfg: ModelConfig, weights: dict[str, torch.Tensor], *, device="cpu",
                    dtype: torch.dtype = torch.float32, attn_implementation: str = "eager"):
    """The matching ``transformers`` ``Qwen2ForCausalLM`` with ``weights`` loaded strictly
    (default: float32, CPU, eager attention). Checked with transformers 5.17 and 5.24.

    ``dtype``: the parameters are cast to it after loading (the rotary ``inv_freq``
    buffers stay float32, as ``from_pretrained(dtype=...)`` leaves them; ``.to(dtype)``
    would round them). ``attn_implementation``: ``"eager"`` or ``"sdpa"``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if attn_implementation not in ("eager", "sdpa"):
        raise ValueError(f"attn_implementation must be 'eager' or 'sdpa', got "
                         f"{attn_implementation!r}")

    kwargs = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position, rms_norm_eps=cfg.rms_norm_eps,
        use_sliding_window=True, sliding_window=cfg.sliding_window, max_window_layers=0,
        layer_types=cfg.layer_types, tie_word_embeddings=False, attention_dropout=0.0,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    try:
        hf_cfg = Qwen2Config(rope_parameters={"rope_type": "default",
                                               "rope_theta": cfg.rope_theta}, **kwargs)
    except TypeError:  # transformers 4.x: rope_theta is a plain field
        hf_cfg = Qwen2Config(rope_theta=cfg.rope_theta, **kwargs)
    hf_cfg._attn_implementation = attn_implementation
    if list(hf_cfg.layer_types) != cfg.layer_types or hf_cfg.sliding_window != cfg.sliding_window:
        raise RuntimeError(f"transformers rewrote the layer layout: {hf_cfg.layer_types}, "
                           f"window {hf_cfg.sliding_window}")
    model = Qwen2ForCausalLM(hf_cfg).eval()
    model.load_state_dict(weights, strict=True)
    model.to(device)
    if dtype != torch.float32:
        for prm in model.parameters():
            prm.data = prm.data.to(dtype)
    return model


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run examples/model_loops/decode_loop.py (and "
            "speculative_decode.py, recurrent_decode.py, "
            "benchmarks/bench_decode_loop.py) instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
