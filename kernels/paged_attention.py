"""Paged decode attention that reads only FlashInfer-style CSR page tables.

The attention half of the page tables (the allocator's step writes them into
``alloc.tables``, see ``graphalloc.attention.spec``; this reads them): one decode query per
lane, the lane's keys and values gathered page by page through ``kv_indptr`` /
``kv_indices`` / ``kv_last_page_len`` and nothing else (no ``req_to_token``, no
``full_to_swa``, no sequence lengths, no position table).

Paged KV cache, one K and one V tensor per layer, indexed by page id (FULL layers by FULL
page ids, SWA layers by SWA page ids; page 0 is the allocator's sink)::

    k_cache, v_cache  [n_pages, page_size, n_kv_heads, head_dim]     slot = page * ps + off

which is exactly a slot-indexed cache ``[n_pages * ps, n_kv_heads, head_dim]`` (what the
model writes new K/V into, by slot) viewed as pages: ``cache.view(-1, ps, Hkv, D)``.

What a lane reads. Lane i owns pages ``kv_indices[kv_indptr[i] : kv_indptr[i+1]]``; the
last one holds ``kv_last_page_len[i]`` tokens, so the lane's list has
``kv_len = (n_pages - 1) * ps + last`` keys (0 for an empty lane), list entry j at page
``kv_indices[kv_indptr[i] + j // ps]``, offset ``j % ps``. The list covers positions
``[S, L)`` of the request (FULL tables: S = 0; SWA tables: ``S = floor_page(max(f, L - W))``)
and the query is the decode token at position ``L - 1``. With a sliding window W (a query
at ``q`` reads keys at positions ``> q - W``: W keys, itself included; transformers'
convention) the keys read are positions ``>= L - W``, i.e. list entries
``j >= kv_len - W``: the mask needs neither S nor L (FlashInfer's ``window_left = W - 1``
is the same rule). Entries ``[0, kv_len - W)`` -- stale tokens of a live first page --
are never loaded. ``sliding_window = 0`` reads the whole list.

One program per (lane, query head) (GQA: head h reads KV head ``h // (H / Hkv)``)::

    start, end = kv_indptr[i], kv_indptr[i+1];  last = kv_last_page_len[i]
    kv_len = (end - start - 1) * ps + last  if end > start else 0
    lo = max(kv_len - W, 0) if W else 0
    q = q[i, h] * sm_scale                               (not read when kv_len == 0)
    m, l, acc = -inf, 0, 0                               online softmax
    for j0 in [lo, kv_len), BLOCK_N at a time:
        page = kv_indices[start + j // ps]               (masked to j < kv_len)
        k, v = cache[page, j % ps, h // rep, :]           [BLOCK_N, D]
        s = k @ q;  m' = max(m, max s);  p = exp(s - m')
        l = l * exp(m - m') + sum p;  acc = acc * exp(m - m') + p @ v;  m = m'
    out[i, h] = acc / l   (0 when kv_len == 0: an empty lane reads no page at all)

Bytes per (lane, head): 8 + 4 of indptr and last page length, ``4 * ceil(n / ps)`` of page
ids, ``2 * n * D * elt`` of K and V for the n keys it reads (n <= W with a window), ``D * elt``
of query and of output. The query heads of a KV group read the same K/V rows (served from
L2). Lengths, offsets, the window and the batch contents are runtime values
(``do_not_specialize``): nothing recompiles when they change; page size, head dim and the
tile are compile-time.

``paged_decode_attention`` (Triton) and ``paged_decode_attention_torch`` (the fixed-shape,
sync-free reference twin: no scalar reads and no data-dependent shapes, so it can
be captured in a CUDA graph, and it is what a CPU decode loop runs) share one signature
and agree to float32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .errors import TensorSpecError

__all__ = ["paged_decode_attention", "paged_decode_attention_torch", "paged_attention_meta"]


@triton.jit(do_not_specialize=["sliding_window", "sm_scale", "stride_qb", "stride_qh",
                               "stride_ob", "stride_oh", "stride_kp", "stride_kt",
                               "stride_kh", "stride_vp", "stride_vt", "stride_vh"])
def _paged_decode_kernel(
    # decode queries [B, H, D] and the output [B, H, D]
    q_ptr, out_ptr,
    # paged caches [n_pages, page_size, n_kv_heads, head_dim] (unit stride on head_dim)
    k_ptr, v_ptr,
    # CSR page tables: indptr [B+1], indices [capacity], last page length [B]
    kv_indptr_ptr, kv_indices_ptr, kv_last_ptr,
    # runtime scalars
    sliding_window, sm_scale,
    # strides
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    # meta-parameters
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr,
    HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    lane = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    kv_head = head // GROUP
    start = tl.load(kv_indptr_ptr + lane).to(tl.int64)
    end = tl.load(kv_indptr_ptr + lane + 1).to(tl.int64)
    last = tl.load(kv_last_ptr + lane).to(tl.int64)
    n_pages = end - start
    kv_len = tl.where(n_pages > 0, (n_pages - 1) * PAGE_SIZE + last, 0)
    lo = kv_len * 0
    if HAS_WINDOW:
        lo = tl.maximum(kv_len - sliding_window, 0)  # list entries below it: out of window

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    has_keys = kv_len > 0
    q = tl.load(q_ptr + lane * stride_qb + head * stride_qh + offs_d,
                mask=d_mask & has_keys, other=0.0).to(tl.float32) * sm_scale

    m_i = float("-inf")  # running max; every visited tile holds a valid key, so it is finite
    l_i = 0.0  # after the first tile
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    k_head_ptr = k_ptr + kv_head * stride_kh
    v_head_ptr = v_ptr + kv_head * stride_vh
    for j0 in range(lo, kv_len, BLOCK_N):
        j = j0 + offs_n  # int64 list entries
        key_mask = j < kv_len
        page = tl.load(kv_indices_ptr + start + j // PAGE_SIZE, mask=key_mask,
                       other=0).to(tl.int64)
        tok = j % PAGE_SIZE
        kv_mask = key_mask[:, None] & d_mask[None, :]
        k = tl.load(k_head_ptr + page[:, None] * stride_kp + tok[:, None] * stride_kt
                    + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], 1)
        s = tl.where(key_mask, s, float("-inf"))
        m_new = tl.maximum(tl.max(s, 0), m_i)
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(v_head_ptr + page[:, None] * stride_vp + tok[:, None] * stride_vt
                    + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    # l_i >= 1 after any tile (the max key contributes exp(0)); an empty lane divides 0 by 1
    out = acc / (l_i + (kv_len == 0).to(tl.float32))
    tl.store(out_ptr + lane * stride_ob + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


# ---- argument checks and meta-parameters (shared by the launcher and the twin) ----------

def _check_args(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sliding_window,
                max_pages, out) -> None:
    """Attribute checks only (no sync)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                    ("kv_last_page_len", kv_last_page_len)):
        if not isinstance(t, torch.Tensor):
            raise TensorSpecError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != q.device:
            raise TensorSpecError(f"{name} is on {t.device} but q on {q.device}")
    if q.dim() != 3 or not q.dtype.is_floating_point:
        raise TensorSpecError(f"q must be a floating [B, n_heads, head_dim] tensor, got "
                              f"{q.dtype} {tuple(q.shape)}")
    B, H, D = q.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise TensorSpecError(f"k_cache and v_cache must both be [n_pages, page_size, "
                              f"n_kv_heads, head_dim], got {tuple(k_cache.shape)} and "
                              f"{tuple(v_cache.shape)}")
    n_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != D or H % n_kv_heads:
        raise TensorSpecError(f"the caches' heads {n_kv_heads} x dim {k_cache.shape[3]} do not "
                              f"fit q's {H} heads x dim {D} (n_heads % n_kv_heads must be 0)")
    if k_cache.dtype != v_cache.dtype or not k_cache.dtype.is_floating_point:
        raise TensorSpecError(f"k_cache and v_cache must share a floating dtype, got "
                              f"{k_cache.dtype} and {v_cache.dtype}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise TensorSpecError(f"{name} needs unit stride on head_dim")
    for name, t, shape in (("kv_indptr", kv_indptr, (B + 1,)), ("kv_indices", kv_indices, None),
                           ("kv_last_page_len", kv_last_page_len, (B,))):
        if t.dtype not in (torch.int32, torch.int64) or t.dim() != 1:
            raise TensorSpecError(f"{name} must be a 1-D int32 or int64 tensor, got "
                                  f"{t.dtype} {tuple(t.shape)}")
        if shape is not None and tuple(t.shape) != shape:
            raise TensorSpecError(f"{name} must have shape {shape} for {B} lanes, got "
                                  f"{tuple(t.shape)}")
        if not t.is_contiguous():
            raise TensorSpecError(f"{name} must be contiguous")
    if not isinstance(sliding_window, int) or sliding_window < 0:
        raise TensorSpecError(f"sliding_window must be an int >= 0 (0: no window), got "
                              f"{sliding_window!r}")
    if max_pages is not None and (not isinstance(max_pages, int) or max_pages < 1):
        raise TensorSpecError(f"max_pages must be a positive int or None, got {max_pages!r}")
    if out is not None:
        if (not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype
                or out.device != q.device or out.stride(-1) != 1):
            raise TensorSpecError(f"out must be a {q.dtype} {tuple(q.shape)} tensor on "
                                  f"{q.device} with unit stride on head_dim")


def paged_attention_meta(head_dim: int) -> dict:
    """``BLOCK_D`` (head_dim rounded up to a power of two), ``BLOCK_N`` (keys per tile:
    a ``[BLOCK_N, BLOCK_D]`` fp32 tile of K and of V per program) and ``num_warps``."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if block_d <= 64 else 32 if block_d <= 128 else 16
    return dict(BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4 if block_d <= 128 else 8)


def paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, *,
                           sliding_window: int = 0, sm_scale: float | None = None,
                           max_pages: int | None = None, out=None) -> torch.Tensor:
    """Decode attention of ``q`` over the lanes' paged K/V: one Triton program per (lane,
    query head). Shares the twin's signature and results.

    Args:
        q: ``[B, n_heads, head_dim]`` float, the decode token of each lane (position L - 1).
        k_cache, v_cache: ``[n_pages, page_size, n_kv_heads, head_dim]``, indexed by the
            page ids of ``kv_indices`` (a slot-indexed cache ``.view(-1, ps, Hkv, D)``).
        kv_indptr: ``[B+1]`` int32/int64; ``kv_indices``: page ids ``[capacity]`` (entries
            past ``kv_indptr[B]`` are never read); ``kv_last_page_len``: ``[B]`` tokens in
            each lane's last page (0 on an empty lane).
        sliding_window: W in tokens (the lane's query reads list entries ``>= kv_len - W``,
            i.e. positions ``>= L - W``); 0: no window (FULL layers).
        sm_scale: score scale; default ``head_dim ** -0.5``.
        max_pages: most pages one lane holds: the twin's fixed grid; the kernel loops over
            each lane's own pages and ignores it.
        out: optional ``[B, n_heads, head_dim]`` output (q's dtype); a new one when omitted.

    Returns ``out``. Capture-safe: attribute checks only, no sync; returns before the device
    has finished. Empty lanes (``kv_indptr[i+1] == kv_indptr[i]``) get zeros and read no
    page, no query.
    """
    _check_args(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sliding_window,
                max_pages, out)
    B, H, D = q.shape
    if out is None:
        out = torch.empty_like(q)
    if B == 0:
        return out
    _, ps, n_kv_heads, _ = k_cache.shape
    scale = float(D ** -0.5 if sm_scale is None else sm_scale)
    # an empty kv_indices (no lane holds a page) is never read: indptr stands in for it
    indices = kv_indices if kv_indices.numel() else kv_indptr
    _paged_decode_kernel[(B, H)](
        q, out, k_cache, v_cache, kv_indptr, indices, kv_last_page_len,
        sliding_window, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=D, PAGE_SIZE=ps, GROUP=H // n_kv_heads, HAS_WINDOW=sliding_window > 0,
        **paged_attention_meta(D),
    )
    return out


def paged_decode_attention_torch(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len,
                                 *, sliding_window: int = 0, sm_scale: float | None = None,
                                 max_pages: int | None = None, out=None) -> torch.Tensor:
    """Reference twin of :func:`paged_decode_attention` (same arguments, same results to
    float32 rounding) over a fixed ``[B, max_pages * page_size]`` grid of list entries:
    fixed-shape and sync-free, so it can be captured; it reads only the CSR tables.

    ``max_pages`` (default: ``kv_indices.numel()``, always enough but large) must be at
    least the pages of the longest lane; entries past it are not read. Keys outside a lane's
    list or window are masked before the softmax (their gathered values never reach the
    output, even when they are NaN).
    """
    _check_args(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sliding_window,
                max_pages, out)
    B, H, D = q.shape
    _, ps, n_kv_heads, _ = k_cache.shape
    dev = q.device
    if max_pages is None:
        max_pages = max(1, kv_indices.numel())
    scale = float(D ** -0.5 if sm_scale is None else sm_scale)
    start = kv_indptr[:-1].long()
    n_pages = kv_indptr[1:].long() - start
    kv_len = torch.where(n_pages > 0, (n_pages - 1) * ps + kv_last_page_len.long(), 0)
    j = torch.arange(max_pages * ps, device=dev)[None, :]  # [1, T] list entries
    valid = j < kv_len[:, None]  # [B, T]
    if sliding_window > 0:
        valid = valid & (j >= kv_len[:, None] - sliding_window)
    if kv_indices.numel() == 0:  # no lane can hold a page
        valid = valid & False
        page = torch.zeros_like(valid, dtype=torch.int64)
    else:
        entry = torch.where(valid, start[:, None] + j // ps, 0)
        page = torch.where(valid, kv_indices[entry].long(), 0)
    tok = (j % ps).expand_as(page)
    k = k_cache[page, tok].float()  # [B, T, Hkv, D]
    v = v_cache[page, tok].float()
    v = torch.where(valid[:, :, None, None], v, 0.0)
    qg = q.float().view(B, n_kv_heads, H // n_kv_heads, D) * scale
    scores = torch.einsum("bgrd,btgd->bgrt", qg, k)
    key_mask = valid[:, None, None, :]
    scores = torch.where(key_mask, scores, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)  # an empty lane: every score is -inf
    p = torch.where(key_mask, torch.exp(scores - m), 0.0)
    denom = p.sum(dim=-1, keepdim=True)
    o = torch.einsum("bgrt,btgd->bgrd", p, v) / torch.where(denom > 0, denom, 1.0)
    o = o.reshape(B, H, D).to(q.dtype)
    if out is None:
        return o
    out.copy_(o)
    return out
