"""The fused MoE Triton kernels (``kvforge.layers.fused_moe`` describes the algorithm and calls them)."""


def build_kernels(triton, tl):
    """The Triton kernels of kvforge.layers.fused_moe, built once (triton passed in, so that importing
    fused_moe never needs it): gate/up, down, the routing, and the pair alignment (one program, or three)."""
    # NOTE: no helper @triton.jit functions: the CPU interpreter re-executes a kernel's source in its
    # module globals, where a helper held in this closure would not be found
    # (plugins/quantization/triton_kernels.py); the tile ordering is therefore written out twice.

    @triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
    def gate_up_kernel(x_ptr, w_ptr, b_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr, out_ptr,
                       num_pairs, num_blocks, top_k, inter, hidden, alpha, limit,
                       stride_xt, stride_xh, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, EVEN_K: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
        """act[rows of one block, N tile] = act(x[tokens] @ gate^T, x[tokens] @ up^T) for the block's expert."""
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(inter, BLOCK_N)
        group = GROUP_M * tiles_n
        first_m = (pid // group) * GROUP_M
        group_rows = tl.minimum(num_blocks - first_m, GROUP_M)
        pid_m = first_m + (pid % group) % group_rows
        pid_n = (pid % group) // group_rows
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(pairs_ptr + offs_m)
        row_ok = pairs < num_pairs
        tokens = (pairs // top_k).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < inter
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xh
        gate_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
        up_ptrs = gate_ptrs + inter * stride_wn
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            if EVEN_K:
                xs = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
                wg = tl.load(gate_ptrs, mask=n_ok[None, :], other=0.0)
                wu = tl.load(up_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = offs_k < hidden - k0
                xs = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                wg = tl.load(gate_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                wu = tl.load(up_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_gate = tl.dot(xs, wg, acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(xs, wu, acc_up, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K * stride_xh
            gate_ptrs += BLOCK_K * stride_wk
            up_ptrs += BLOCK_K * stride_wk
        # rounded where the reference rounds: the projection, the bias add, the activation
        dt = out_ptr.dtype.element_ty
        gate = acc_gate.to(dt).to(tl.float32)
        up = acc_up.to(dt).to(tl.float32)
        if HAS_BIAS:
            bias = b_ptr + expert * stride_be + offs_n * stride_bn
            gate = (gate + tl.load(bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]).to(dt).to(tl.float32)
            up = (up + tl.load(bias + inter * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]).to(dt)
            up = up.to(tl.float32)
        if ACTIVATION == 0:  # silu(gate) * up
            act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up
        else:  # swigluoai: (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            act = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
        # NOTE: padding rows are written too (finite: their x rows load as zeros), so the down kernel
        # reads whole blocks unmasked
        out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out, act.to(dt), mask=n_ok[None, :])

    @triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
    def down_kernel(a_ptr, w_ptr, b_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr, routing_ptr, out_ptr,
                    num_pairs, num_blocks, hidden, inter,
                    stride_am, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_om,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """out[pair, N tile] = routing[pair] * (act[row] @ w2[expert]^T + bias) for one block's rows."""
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(hidden, BLOCK_N)
        group = GROUP_M * tiles_n
        first_m = (pid // group) * GROUP_M
        group_rows = tl.minimum(num_blocks - first_m, GROUP_M)
        pid_m = first_m + (pid % group) % group_rows
        pid_n = (pid % group) // group_rows
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hidden
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = offs_k < inter - k0
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        dt = out_ptr.dtype.element_ty
        y = acc.to(dt).to(tl.float32)
        if HAS_BIAS:
            bias = tl.load(b_ptr + expert * stride_be + offs_n * stride_bn, mask=n_ok, other=0.0)
            y = (y + bias.to(tl.float32)[None, :]).to(dt).to(tl.float32)
        pairs = tl.load(pairs_ptr + offs_m)
        row_ok = pairs < num_pairs
        y = y * tl.load(routing_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out, y.to(dt), mask=row_ok[:, None] & n_ok[None, :])

    @triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
    def align_kernel(ids_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_experts, num_blocks,
                     BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, CHUNK: tl.constexpr):
        """align_pairs as one program: count the pairs per expert, pad, lay out the blocks, then place
        each pair after the earlier pairs of its expert (a one-hot [CHUNK, EXPERTS] tile per step)."""
        experts = tl.arange(0, EXPERTS)
        counts = tl.zeros([EXPERTS], dtype=tl.int32)
        for start in range(0, num_pairs, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=EXPERTS).to(tl.int32)
            counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        padded_end = tl.cumsum(padded, axis=0)
        tl.store(num_padded_ptr, tl.sum(padded, axis=0))
        for b0 in range(0, num_blocks, CHUNK):
            blocks = b0 + tl.arange(0, CHUNK)
            # the block's expert: how many experts end at or before its first row (E past the end)
            ended = tl.sum((padded_end[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + blocks, tl.minimum(ended, num_experts), mask=blocks < num_blocks)
        for r0 in range(0, num_blocks * BLOCK_M, CHUNK):
            rows = r0 + tl.arange(0, CHUNK)
            tl.store(pairs_ptr + rows, tl.full([CHUNK], 0, tl.int32) + num_pairs, mask=rows < num_blocks * BLOCK_M)
        tl.debug_barrier()  # the padding is written before the pairs overwrite their rows
        next_row = padded_end - padded
        for start in range(0, num_pairs, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=EXPERTS).to(tl.int32)
            onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
            before = tl.cumsum(onehot, axis=0) - onehot  # earlier pairs of the same expert in this chunk
            dest = tl.sum((before + next_row[None, :]) * onehot, axis=1)
            tl.store(pairs_ptr + dest, offs, mask=offs < num_pairs)
            next_row += tl.sum(onehot, axis=0)

    @triton.jit(do_not_specialize=["num_pairs"])
    def align_count_kernel(ids_ptr, counts_ptr, rank_ptr, num_pairs, CHUNK: tl.constexpr):
        """Count each chunk's pairs per expert; a pair's rank in its expert is the count it found."""
        offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
        ok = offs < num_pairs
        ids = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
        rank = tl.atomic_add(counts_ptr + ids, tl.full([CHUNK], 1, tl.int32), mask=ok, sem="relaxed")
        tl.store(rank_ptr + offs, rank, mask=ok)

    @triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
    def align_layout_kernel(counts_ptr, start_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr, num_pairs,
                            num_experts, num_blocks, BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr,
                            CHUNK: tl.constexpr, FILL: tl.constexpr):
        """From the counts: each expert's first row, every block's expert, and padding in every row."""
        experts = tl.arange(0, EXPERTS)
        counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        padded_end = tl.cumsum(padded, axis=0)
        tl.store(num_padded_ptr, tl.sum(padded, axis=0))
        tl.store(start_ptr + experts, padded_end - padded, mask=experts < num_experts)
        for b0 in range(0, num_blocks, CHUNK):
            blocks = b0 + tl.arange(0, CHUNK)
            ended = tl.sum((padded_end[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + blocks, tl.minimum(ended, num_experts), mask=blocks < num_blocks)
        for r0 in range(0, num_blocks * BLOCK_M, FILL):
            rows = r0 + tl.arange(0, FILL)
            tl.store(pairs_ptr + rows, tl.full([FILL], 0, tl.int32) + num_pairs, mask=rows < num_blocks * BLOCK_M)

    @triton.jit(do_not_specialize=["num_pairs"])
    def align_scatter_kernel(ids_ptr, rank_ptr, start_ptr, pairs_ptr, num_pairs, CHUNK: tl.constexpr):
        """Each pair to its expert's first row plus its rank (the padding is already written)."""
        offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
        ok = offs < num_pairs
        ids = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
        dest = tl.load(start_ptr + ids, mask=ok, other=0) + tl.load(rank_ptr + offs, mask=ok, other=0)
        tl.store(pairs_ptr + dest, offs.to(tl.int32), mask=ok)

    @triton.jit
    def route_kernel(logits_ptr, weights_ptr, ids_ptr, stride_l, num_experts, top_k,
                     SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr, ROUND: tl.constexpr,
                     BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        """One token's routing, as kvforge.layers.moe.select_experts computes it: softmax over the experts
        then the top k (renormalised, rounded), or the top k logits then a softmax over them. The k are
        written best first; of equal scores the lowest expert wins."""
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_E)
        ok = offs < num_experts
        x = tl.load(logits_ptr + t * stride_l + offs, mask=ok, other=float("-inf")).to(tl.float32)
        dt = logits_ptr.dtype.element_ty
        if SOFTMAX_FIRST:
            e = tl.where(ok, tl.exp(x - tl.max(x, axis=0)), 0.0)
            score = tl.where(ok, e / tl.sum(e, axis=0), float("-inf"))
        else:
            score = x
        kk = tl.arange(0, BLOCK_K)
        k_ok = kk < top_k
        sel_w = tl.zeros([BLOCK_K], dtype=tl.float32)
        sel_i = tl.zeros([BLOCK_K], dtype=tl.int32)
        for j in range(top_k):
            best = tl.max(score, axis=0)
            idx = tl.min(tl.where(score == best, offs, BLOCK_E), axis=0)
            sel_w = tl.where(kk == j, best, sel_w)
            sel_i = tl.where(kk == j, idx, sel_i)
            score = tl.where(offs == idx, float("-inf"), score)
        if SOFTMAX_FIRST:
            if RENORMALIZE:
                sel_w = sel_w / tl.sum(tl.where(k_ok, sel_w, 0.0), axis=0)
            if ROUND:
                sel_w = sel_w.to(dt).to(tl.float32)
        else:  # a softmax over the k logits, in the logits' dtype (computed in float32, then rounded)
            e = tl.where(k_ok, tl.exp(sel_w - tl.max(tl.where(k_ok, sel_w, float("-inf")), axis=0)), 0.0)
            sel_w = (e / tl.sum(e, axis=0)).to(dt).to(tl.float32)
        tl.store(weights_ptr + t * top_k + kk, sel_w, mask=k_ok)
        tl.store(ids_ptr + t * top_k + kk, sel_i.to(tl.int64), mask=k_ok)

    return {"gate_up": gate_up_kernel, "down": down_kernel, "route": route_kernel, "align": align_kernel,
            "align_count": align_count_kernel, "align_layout": align_layout_kernel,
            "align_scatter": align_scatter_kernel}
