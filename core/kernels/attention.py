"""Triton kernels of the ``triton`` attention backend (``kvforge.plugins.attention.triton_backend``) and
the K/V cache write of every CUDA backend, and thin launchers that take device tensors.

Paged cache per layer: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (K then V); slot
``s`` is block ``s // block_size``, offset ``s % block_size``. Every kernel takes the query heads of
one KV head together (GQA), so each K/V tile is loaded once for the whole group. Scores are kept in
the log2 domain (``qk_scale = scale * log2(e)``, ``exp2``); accumulation is fp32.
Design notes (grids, tiles, the split-K heuristic, FP8): docs/attention_triton.md.

FP8 cache (``KV_FP8``): ``reshape_and_cache`` stores ``clamp(x / scale, -448, 448)`` in e4m3 (computed in
fp32, as ``kvforge.plugins.attention.kv_write.quantize_kv``); the attention kernels load the e4m3 tiles,
widen them to the query's dtype for the dots, and apply the layer's scales exactly once per program: ``k_scale`` folded into
``qk_scale`` (``q . (k8 * k_scale) = (q . k8) * k_scale``) and ``v_scale`` on the normalised output
(``sum p (v8 * v_scale) = v_scale * sum p v8``). The scales are read from a [2] fp32 device tensor
(k, v), never baked into a launch, so a captured CUDA graph reads them too.

Per-layer variants (``kvforge.attention.AttentionLayer``), each a constexpr so that a plain layer compiles
to the kernels without them: ``WINDOW`` (runtime ``window``: the loops start at the tile of the lowest key
any row sees and never read the block-table entries before it, which may be 0 once the KV manager gave
those blocks back), ``SOFTCAP`` (runtime ``softcap``: scores become ``cap * tanh(score / cap)`` before
masking) and ``SINKS`` (a [num_heads] fp32 pointer: one more logit per head in the softmax denominator,
joined once per row where the row is finalised: the prefill epilogue, the unsplit decode, or the reduce).
"""
# pyright: reportArgumentType=false
# (the kernels call the @triton.jit helper _attend_tile with Python literals for its tl.constexpr
# parameters, as Triton wants; pyright reads them as a bool passed for a constexpr)
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvforge.attention import PLAIN_LAYER, AttentionLayer
from kvforge.kernels import launcher

LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E)  # the same, for use inside kernels
FP8_MAX = tl.constexpr(448.0)  # the largest finite float8_e4m3fn (kvforge.attention.FP8_E4M3_MAX)
MIN_KEYS_PER_SPLIT = 256  # a decode split shorter than this costs more in the reduce than it saves
MAX_SPLITS = 64


@triton.jit
def _reshape_and_cache_kernel(k_ptr, v_ptr, k_cache, v_cache, slot_ptr, kv_scale_ptr,
                              stride_kt, stride_kh, stride_vt, stride_vh,
                              stride_cb, stride_cs, stride_ch,
                              NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
                              HEAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:  # NOTE: a negative slot marks a padding token: nothing is written
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, HEAD)
        mask = (offs_h < NUM_KV_HEADS)[:, None]
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs \
            + offs_h[:, None] * stride_ch + offs_d[None, :]
        k = tl.load(k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        if KV_FP8:  # saturate, then round to e4m3 (the clamp keeps out-of-range values off NaN)
            k = tl.minimum(tl.maximum(k.to(tl.float32) / tl.load(kv_scale_ptr), -FP8_MAX), FP8_MAX)
            v = tl.minimum(tl.maximum(v.to(tl.float32) / tl.load(kv_scale_ptr + 1), -FP8_MAX), FP8_MAX)
        tl.store(k_cache + dst, k.to(k_cache.dtype.element_ty), mask=mask)
        tl.store(v_cache + dst, v.to(v_cache.dtype.element_ty), mask=mask)


@triton.jit
def _soft_cap(s, cap):
    """``cap * tanh(s / cap)`` (s and cap in the log2 domain), with tanh(x) = 2 / (1 + e^-2x) - 1 through
    exp2, which every GPU and the interpreter have."""
    return cap * (2.0 / (1.0 + tl.exp2(s * ((-2.0 * LOG2E_C) / cap))) - 1.0)  # one scalar division


@triton.jit
def _join_sink(m_i, l_i, acc, sink):
    """Fold one more logit per row (``sink``, log2 domain) into a finished online softmax: it joins the
    denominator and adds nothing to acc. Returns (l_i, acc), rescaled to the new row maximum."""
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)  # 0 for a row that saw no key (m_i = -inf)
    return l_i * alpha + tl.exp2(sink - m_new), acc * alpha[:, None]


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_cache, v_cache, bt_row, kv_head_off, n0, seq_len, qpos, key_lo, window,
                 softcap, qk_scale, stride_cb, stride_cs, offs_d,
                 BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr,
                 CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over keys ``n0 .. n0 + TILE_N`` of a sequence.

    q: [M, HEAD] (model dtype; an FP8 cache's tiles are widened to it, their scales applied by the
    caller); m_i, l_i: [M] fp32 (log2 domain); acc: [M, HEAD] fp32;
    qpos: [M] absolute query positions (used when CAUSAL). MASKED=False promises every key of the
    tile is below seq_len and visible to every row. With WINDOW, keys below key_lo (the lowest any
    row sees) are not read, and a causal row at p sees keys above p - window; softcap: the cap in the
    log2 domain (with SOFTCAP).
    """
    offs_n = n0 + tl.arange(0, TILE_N)
    n_mask = offs_n < seq_len
    if WINDOW:
        # NOTE: keys before the window may sit in blocks given back (block-table entry 0, another
        # sequence's data): their entries and rows are never loaded
        n_mask = n_mask & (offs_n >= key_lo)
    if TILE_N <= BLOCK_SIZE:
        # the tile lies inside one block (TILE_N divides BLOCK_SIZE): one block-table read
        blk = tl.load(bt_row + n0 // BLOCK_SIZE).to(tl.int64)
    else:
        # the tile spans several blocks: one block id per key (masked keys read entry 0)
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    rows = blk * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + kv_head_off  # [TILE_N]
    ptrs = rows[:, None] + offs_d[None, :]
    if MASKED:
        # NOTE: keys at or past seq_len are never read (other=0) and score -inf, so uninitialised
        # cache slots cannot leak NaN/inf into the result
        k = tl.load(k_cache + ptrs, mask=n_mask[:, None], other=0.0)
        v = tl.load(v_cache + ptrs, mask=n_mask[:, None], other=0.0)
    else:
        k = tl.load(k_cache + ptrs)
        v = tl.load(v_cache + ptrs)
    k, v = k.to(q.dtype), v.to(q.dtype)  # no-ops unless the cache is FP8
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, TILE_N] fp32
    if SOFTCAP:
        s = _soft_cap(s, softcap)
    if MASKED:
        visible = n_mask[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= qpos[:, None])
            if WINDOW:
                visible = visible & (offs_n[None, :] > qpos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row that has seen no visible key yet keeps m = -inf: subtract 0 instead, so exp2 gives 0, not NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# NOTE: per-step values are not specialised on: the block-table width, the split count, and the
# index arrays that are slices of one packed buffer (their 16-byte alignment depends on the number of
# decodes). Triton would otherwise compile a variant (~2 s) for each class it meets, mid-serving.
@triton.jit(do_not_specialize=["stride_bt", "tile_seq_ptr", "tile_q0_ptr", "window"])
def _prefill_kernel(q_ptr, k_cache, v_cache, out_ptr, tile_seq_ptr, tile_q0_ptr, qsl_ptr, seq_lens_ptr,
                    bt_ptr, qk_scale, kv_scale_ptr, window, softcap, sinks_ptr,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_cs, stride_ch,
                    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    KV_FP8: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr):
    """Grid (num_q_tiles, num_kv_heads): BLOCK_Q query tokens x GROUP query heads of one sequence."""
    if KV_FP8:
        qk_scale = qk_scale * tl.load(kv_scale_ptr)
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)  # first query token of the tile, relative to the sequence
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # cached tokens before this chunk

    # row r of the tile is query token q0 + r // GROUP, query head kvh * GROUP + r % GROUP
    offs_m = tl.arange(0, BLOCK_M)
    tok = q0 + offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    offs_d = tl.arange(0, HEAD)
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if KV_FP8 and q_ptr.dtype.element_ty == tl.bfloat16:
        # e4m3 widens to fp16 two values an instruction (to bf16 through fp32): the dots run in fp16
        q = q.to(tl.float16)
    qpos = prefix + tok  # absolute position of each row's query token

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off = kvh * stride_ch
    # keys below the tile's first query position are visible to every row: no masks there
    num_full = (prefix + q0 + 1) // TILE_N
    kv_end = tl.minimum(seq_len, prefix + tl.minimum(q0 + BLOCK_Q, q_len))  # past the last visible key
    t_full = 0  # the first unmasked tile
    key_lo = 0
    if WINDOW:
        # the first row sees keys from prefix + q0 - window + 1, the last row from kv_end - window: tiles
        # wholly below the first bound are skipped, those below the second are masked; the unmasked run
        # starts after them
        key_lo = tl.maximum(prefix + q0 - window + 1, 0)
        t_first = key_lo // TILE_N
        t_full = tl.maximum(tl.minimum(tl.cdiv(tl.maximum(kv_end - window, 0), TILE_N), num_full), t_first)
        for t in range(t_first, t_full):
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache, v_cache, bt_row, kv_head_off, t * TILE_N,
                                         seq_len, qpos, key_lo, window, softcap, qk_scale, stride_cb, stride_cs,
                                         offs_d, BLOCK_SIZE, TILE_N, True, True, WINDOW, SOFTCAP, DOT_PRECISION)
    for t in range(t_full, num_full):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache, v_cache, bt_row, kv_head_off, t * TILE_N,
                                     seq_len, qpos, key_lo, window, softcap, qk_scale, stride_cb, stride_cs,
                                     offs_d, BLOCK_SIZE, TILE_N, False, True, WINDOW, SOFTCAP, DOT_PRECISION)
    for t in range(num_full, tl.cdiv(kv_end, TILE_N)):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache, v_cache, bt_row, kv_head_off, t * TILE_N,
                                     seq_len, qpos, key_lo, window, softcap, qk_scale, stride_cb, stride_cs,
                                     offs_d, BLOCK_SIZE, TILE_N, True, True, WINDOW, SOFTCAP, DOT_PRECISION)
    if SINKS:
        l_i, acc = _join_sink(m_i, l_i, acc, tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * LOG2E_C)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if KV_FP8:
        out = out * tl.load(kv_scale_ptr + 1)
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_splits", "stride_bt", "dec_seq_ptr", "window"])
def _decode_kernel(q_ptr, k_cache, v_cache, out_ptr, part_m, part_l, part_acc, dec_seq_ptr, qsl_ptr,
                   seq_lens_ptr, bt_ptr, qk_scale, kv_scale_ptr, window, softcap, sinks_ptr, num_heads, num_splits,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_cs, stride_ch,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   TILE_N: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
                   WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr):
    """Grid (num_decodes, num_kv_heads, num_splits): one query token, GROUP heads, one KV partition.

    Without SPLIT (num_splits == 1) the result goes straight to out (sinks joined here); with it the
    partial (max, sum, acc) of the partition goes to part_* for _reduce_kernel (acc already times
    v_scale; the sinks join there). With WINDOW the partitions cover the window's tiles only.
    """
    if KV_FP8:
        qk_scale = qk_scale * tl.load(kv_scale_ptr)
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(dec_seq_ptr + i)
    tok = tl.load(qsl_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_g = tl.arange(0, BLOCK_G)  # BLOCK_G >= 16 for tl.dot; rows past GROUP are padding
    g_ok = offs_g < GROUP
    head = kvh * GROUP + offs_g
    offs_d = tl.arange(0, HEAD)
    q = tl.load(q_ptr + tok * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None], other=0.0)
    if KV_FP8 and q_ptr.dtype.element_ty == tl.bfloat16:  # as in the prefill kernel: dots in fp16
        q = q.to(tl.float16)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD], tl.float32)
    # the partition is computed from seq_len on the device, so any num_splits is correct for any batch
    num_tiles = tl.cdiv(seq_len, TILE_N)
    key_lo = 0
    if WINDOW:
        # the query (at seq_len - 1) sees keys from seq_len - window: the splits share the tiles from there
        key_lo = tl.maximum(seq_len - window, 0)
        t_first = key_lo // TILE_N
        per_split = tl.cdiv(num_tiles - t_first, num_splits)
        t0 = t_first + split * per_split
    else:
        per_split = tl.cdiv(num_tiles, num_splits)
        t0 = split * per_split
    t1 = tl.minimum(t0 + per_split, num_tiles)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for t in range(t0, t1):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache, v_cache, bt_row, kvh * stride_ch, t * TILE_N,
                                     seq_len, 0, key_lo, window, softcap, qk_scale, stride_cb, stride_cs, offs_d,
                                     BLOCK_SIZE, TILE_N, True, False, WINDOW, SOFTCAP, DOT_PRECISION)
    if KV_FP8:
        acc = acc * tl.load(kv_scale_ptr + 1)
    if not SPLIT:
        if SINKS:
            l_i, acc = _join_sink(m_i, l_i, acc, tl.load(sinks_ptr + head, mask=g_ok, other=0.0) * LOG2E_C)
        out = acc / l_i[:, None]  # seq_len >= 1: every real row saw a key
        tl.store(out_ptr + tok * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        # part_m, part_l: [num_decodes, num_heads, num_splits]; part_acc: [..., HEAD]. An empty
        # partition stores m = -inf, l = 0, acc = 0, which the reduce weighs as exactly 0.
        p = (i * num_heads + head).to(tl.int64) * num_splits + split
        tl.store(part_m + p, m_i, mask=g_ok)
        tl.store(part_l + p, l_i, mask=g_ok)
        tl.store(part_acc + p[:, None] * HEAD + offs_d[None, :], acc, mask=g_ok[:, None])


@triton.jit(do_not_specialize=["num_splits", "dec_seq_ptr"])
def _reduce_kernel(out_ptr, part_m, part_l, part_acc, dec_seq_ptr, qsl_ptr, sinks_ptr, num_heads, num_splits,
                   stride_ot, stride_oh, BLOCK_S: tl.constexpr, HEAD: tl.constexpr, SINKS: tl.constexpr):
    """Grid (num_decodes, num_heads): combine the num_splits partials of one query head (and its sink,
    once)."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    tok = tl.load(qsl_ptr + tl.load(dec_seq_ptr + i)).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, HEAD)
    p = (i * num_heads + h).to(tl.int64) * num_splits + offs_s
    m = tl.load(part_m + p, mask=s_ok, other=float("-inf"))
    l = tl.load(part_l + p, mask=s_ok, other=0.0)
    acc = tl.load(part_acc + p[:, None] * HEAD + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    m_max = tl.max(m, 0)  # finite: split 0 always holds the first visible key
    if SINKS:
        sink = tl.load(sinks_ptr + h) * LOG2E_C
        m_max = tl.maximum(m_max, sink)
        w = tl.exp2(m - m_max)
        denom = tl.sum(l * w, 0) + tl.exp2(sink - m_max)
    else:
        w = tl.exp2(m - m_max)
        denom = tl.sum(l * w, 0)
    out = tl.sum(acc * w[:, None], 0) / denom  # pyright: ignore[reportOperatorIssue] - tl tensors, typed loosely
    tl.store(out_ptr + tok * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


# ---- launchers -------------------------------------------------------------------------------

def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 queries get exact products (tf32 would cost ~1e-3); 16-bit inputs ignore the setting
    return "ieee" if dtype == torch.float32 else "tf32"


def _fp8_args(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """(scale pointer, KV_FP8) for a launch: an FP8 cache needs its layer's [2] fp32 scales; otherwise
    the kernel never reads the pointer (the cache stands in for it)."""
    if kv_cache.element_size() == 1:
        if kv_scales is None:
            raise ValueError("an FP8 KV cache needs its layer's kv_scales")
        return kv_scales, True
    return kv_cache, False


def _variant_args(layer: AttentionLayer, stand_in: torch.Tensor) -> tuple[tuple, dict[str, bool]]:
    """((window, softcap, sinks pointer), constexprs) of a layer's variants for a launch. Absent ones get
    placeholders the kernel never reads (the stand-in tensor for the sinks pointer); softcap goes in the
    kernels' log2 domain."""
    window = layer.sliding_window or 0
    softcap = (layer.logits_soft_cap or 1.0) * LOG2E
    sinks = stand_in if layer.sinks is None else layer.sinks.float()
    flags = dict(WINDOW=layer.sliding_window is not None, SOFTCAP=layer.logits_soft_cap is not None,
                 SINKS=layer.sinks is not None)
    return (window, softcap, sinks), flags


def tile_sizes(head_size: int, num_queries_per_kv: int, dtype: torch.dtype) -> dict[str, int]:
    """Static tile sizes for one model: prefill rows (BLOCK_M = BLOCK_Q tokens x GROUP heads), key tiles."""
    block_m = 128 if head_size <= 128 and dtype != torch.float32 else 64
    block_m = max(block_m, triton.next_power_of_2(num_queries_per_kv))
    return {
        "block_m": block_m,
        "block_q": block_m // num_queries_per_kv,
        "prefill_tile_n": 64 if head_size <= 128 else 32,
        "decode_tile_n": 64 if head_size <= 128 else 32,
        "block_g": max(16, triton.next_power_of_2(num_queries_per_kv)),
        "prefill_warps": 8 if block_m >= 128 else 4,
        "decode_warps": 4,
        "num_stages": 2,
    }


def choose_num_splits(num_decodes: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Decode partitions per (sequence, KV head): about 4 programs per SM (measured on the H200:
    4 beat 2 by ~10% at batch 1-4), but no partition shorter than MIN_KEYS_PER_SPLIT keys, and 1
    when the batch alone gives every SM a program."""
    programs = num_decodes * num_kv_heads
    if programs == 0 or programs >= num_sms:
        return 1
    by_ctx = max(1, max_seq_len // MIN_KEYS_PER_SPLIT)
    return max(1, min(triton.cdiv(4 * num_sms, programs), by_ctx, MAX_SPLITS))


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      kv_scales: torch.Tensor | None = None) -> None:
    """k, v: [num_tokens, kv_heads, head_size]; kv_cache: [2, blocks, block_size, kv_heads, head_size];
    slot_mapping: [num_tokens] int64 (negative: skip); kv_scales: [2] fp32 (k, v) for an FP8 cache."""
    num_tokens, hkv, d = k.shape
    if num_tokens == 0:
        return
    kc, vc = kv_cache[0], kv_cache[1]
    scale_ptr, fp8 = _fp8_args(kv_cache, kv_scales)
    launcher(_reshape_and_cache_kernel, (num_tokens,))(
        k, v, kc, vc, slot_mapping, scale_ptr, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        NUM_KV_HEADS=hkv, BLOCK_H=triton.next_power_of_2(hkv), HEAD=d, BLOCK_SIZE=kc.shape[1], KV_FP8=fp8)


def prefill_attention(q, kv_cache, out, tile_seq, tile_q0, query_start_loc, seq_lens, block_tables,
                      scale: float, tiles: dict[str, int], kv_scales: torch.Tensor | None = None,
                      layer: AttentionLayer = PLAIN_LAYER) -> None:
    """q, out: [num_tokens, heads, head_size]; tile_seq, tile_q0: [num_q_tiles] int32 (sequence,
    first query token of each tile, from the backend's build_metadata); kv_scales: [2] fp32 (k, v) for
    an FP8 cache; layer: its window, soft cap and sinks."""
    num_tiles = tile_seq.shape[0]
    if num_tiles == 0:
        return
    kc, vc = kv_cache[0], kv_cache[1]
    hkv = kc.shape[2]
    scale_ptr, fp8 = _fp8_args(kv_cache, kv_scales)
    variant, flags = _variant_args(layer, kv_cache)
    launcher(_prefill_kernel, (num_tiles, hkv))(
        q, kc, vc, out, tile_seq, tile_q0, query_start_loc, seq_lens, block_tables, scale * LOG2E, scale_ptr,
        *variant, q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2),
        GROUP=q.shape[1] // hkv, BLOCK_Q=tiles["block_q"], BLOCK_M=tiles["block_m"], HEAD=q.shape[2],
        BLOCK_SIZE=kc.shape[1], TILE_N=tiles["prefill_tile_n"], DOT_PRECISION=_dot_precision(q.dtype),
        KV_FP8=fp8, **flags, num_warps=tiles["prefill_warps"], num_stages=tiles["num_stages"])


def decode_attention(q, kv_cache, out, dec_seq, query_start_loc, seq_lens, block_tables, scale: float,
                     num_splits: int, tiles: dict[str, int], kv_scales: torch.Tensor | None = None,
                     layer: AttentionLayer = PLAIN_LAYER) -> None:
    """Flash-decoding over the sequences ``dec_seq`` ([num_decodes] int32, one query token each);
    kv_scales: [2] fp32 (k, v) for an FP8 cache; layer: its window, soft cap and sinks."""
    n = dec_seq.shape[0]
    if n == 0:
        return
    kc, vc = kv_cache[0], kv_cache[1]
    hkv = kc.shape[2]
    heads, d = q.shape[1], q.shape[2]
    if num_splits > 1:
        part_m = torch.empty(n, heads, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(n, heads, num_splits, d, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused by the kernel without SPLIT
    scale_ptr, fp8 = _fp8_args(kv_cache, kv_scales)
    variant, flags = _variant_args(layer, kv_cache)
    launcher(_decode_kernel, (n, hkv, num_splits))(
        q, kc, vc, out, part_m, part_l, part_acc, dec_seq, query_start_loc, seq_lens, block_tables,
        scale * LOG2E, scale_ptr, *variant, heads, num_splits, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), block_tables.stride(0), kc.stride(0), kc.stride(1), kc.stride(2),
        GROUP=heads // hkv, BLOCK_G=tiles["block_g"], HEAD=d, BLOCK_SIZE=kc.shape[1],
        TILE_N=tiles["decode_tile_n"], SPLIT=num_splits > 1, DOT_PRECISION=_dot_precision(q.dtype),
        KV_FP8=fp8, **flags, num_warps=tiles["decode_warps"], num_stages=tiles["num_stages"])
    if num_splits > 1:
        launcher(_reduce_kernel, (n, heads))(
            out, part_m, part_l, part_acc, dec_seq, query_start_loc, variant[2], heads, num_splits, out.stride(0),
            out.stride(1), BLOCK_S=max(16, triton.next_power_of_2(num_splits)), HEAD=d,  # few variants
            SINKS=flags["SINKS"], num_warps=4)
