"""The mixture-of-experts expert computation: the torch reference against transformers' experts and a
per-token loop; the alignment of pairs into expert blocks; the Triton kernels in the CPU interpreter
against the reference.

As in tests/plugins/models/test_fused_ops.py, the interpreter must be on before triton is first
imported, so the kernel tests run in a subprocess with TRITON_INTERPRET=1 (test_kernels_in_interpreter).
"""
import importlib.util

import numpy as np
import pytest
import torch

from kvforge.layers import fused_moe
from testing_support import IN_INTERPRETER, interpreted

outside_interpreter = pytest.mark.skipif(IN_INTERPRETER, reason="outside the interpreter only")


def make_moe(num_tokens, num_experts, top_k, hidden, inter, *, bias=False, dtype=torch.float32, seed=0):
    """Random operands with outputs of order one: x, w13, w2, topk_weights, topk_ids and the biases."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    ids = torch.rand(num_tokens, num_experts, generator=g).topk(top_k, dim=-1).indices
    weights = torch.rand(num_tokens, top_k, generator=g).softmax(dim=-1)
    b13 = 0.5 * torch.randn(num_experts, 2 * inter, generator=g) if bias else None
    b2 = 0.5 * torch.randn(num_experts, hidden, generator=g) if bias else None

    def cast(t):
        return None if t is None else t.to(dtype)
    return dict(x=cast(x), w13=cast(w13), w2=cast(w2), topk_weights=weights, topk_ids=ids,
                w13_bias=cast(b13), w2_bias=cast(b2))


def run(fn, moe, **kwargs):
    return fn(moe["x"], moe["w13"], moe["w2"], moe["topk_weights"], moe["topk_ids"], w13_bias=moe["w13_bias"],
              w2_bias=moe["w2_bias"], **kwargs)


# ---- the reference (plain torch) ----------------------------------------------------------------------

@outside_interpreter
def test_cpu_uses_the_reference():
    moe = make_moe(5, 4, 2, 16, 24, bias=True)
    assert not fused_moe.use_triton(moe["x"])
    assert torch.equal(run(fused_moe.fused_experts, moe), run(fused_moe.fused_experts_ref, moe))


@outside_interpreter
def test_unknown_activation_is_a_value_error_naming_it():
    moe = make_moe(3, 4, 2, 16, 16)
    for fn in (fused_moe.fused_experts, fused_moe.fused_experts_ref):
        with pytest.raises(ValueError, match="'gelu_tanh'.*silu, swigluoai"):
            run(fn, moe, activation="gelu_tanh")


@outside_interpreter
@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_reference_matches_a_per_token_loop(activation):
    """Different code (a loop over tokens and slots, in float64) for a few tokens."""
    moe = make_moe(4, 6, 3, 24, 20, bias=True, seed=1)
    got = run(fused_moe.fused_experts_ref, moe, activation=activation, swiglu_alpha=1.5, swiglu_limit=1.0)
    inter = moe["w13"].shape[1] // 2
    for t in range(4):
        want = torch.zeros(24, dtype=torch.float64)
        for j in range(3):
            e = int(moe["topk_ids"][t, j])
            h = moe["w13"][e].double() @ moe["x"][t].double() + moe["w13_bias"][e].double()
            gate, up = h[:inter], h[inter:]
            if activation == "silu":
                a = gate / (1 + torch.exp(-gate)) * up
            else:  # limit 1.0 so that the clamps bite
                gate, up = gate.clamp(max=1.0), up.clamp(-1.0, 1.0)
                a = (up + 1) * gate / (1 + torch.exp(-1.5 * gate))
            want += float(moe["topk_weights"][t, j]) * (moe["w2"][e].double() @ a + moe["w2_bias"][e].double())
        torch.testing.assert_close(got[t].double(), want, rtol=1e-5, atol=1e-5)


@outside_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_transformers_eager_experts_exactly(dtype):
    """Bit for bit against transformers' Mixtral and gpt-oss expert modules (eager), gpt-oss's
    interleaved [E, H, 2I] gate/up converted to w13 as kvforge's loader does."""
    from transformers import GptOssConfig, MixtralConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 32, generator=g).to(dtype)
    ids = torch.rand(9, 6, generator=g).topk(2, dim=-1).indices
    weights = torch.rand(9, 2, generator=g).softmax(dim=-1)

    config = MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    mixtral = MixtralExperts(config)
    with torch.no_grad():
        for p in mixtral.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / 6)
        mixtral.to(dtype)
        want = mixtral(x, ids, weights)
    got = fused_moe.fused_experts_ref(x, mixtral.gate_up_proj.data, mixtral.down_proj.data, weights, ids)
    assert torch.equal(got, want)

    config = GptOssConfig(hidden_size=32, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    gpt_oss = GptOssExperts(config)
    with torch.no_grad():
        for p in gpt_oss.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / 5)
        gpt_oss.to(dtype)
        routing = weights.to(dtype)  # gpt-oss's router gives the weights in the model dtype
        want = gpt_oss(x, ids, routing)
    gate_up, gate_up_bias = gpt_oss.gate_up_proj.data, gpt_oss.gate_up_proj_bias.data
    w13 = torch.cat([gate_up[:, :, 0::2], gate_up[:, :, 1::2]], dim=2).transpose(1, 2)
    b13 = torch.cat([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], dim=1)
    got = fused_moe.fused_experts_ref(x, w13, gpt_oss.down_proj.data.transpose(1, 2), routing.float(), ids,
                                      activation="swigluoai", w13_bias=b13, w2_bias=gpt_oss.down_proj_bias.data,
                                      swiglu_alpha=config.swiglu_alpha, swiglu_limit=config.swiglu_limit)
    assert torch.equal(got, want)


@outside_interpreter
def test_reference_with_no_tokens():
    moe = make_moe(0, 4, 2, 16, 16)
    assert run(fused_moe.fused_experts_ref, moe).shape == (0, 16)


ALIGN_CASES = [(1, 8, 2, 16), (33, 4, 3, 16), (40, 8, 1, 32), (7, 128, 8, 16), (5, 3, 1, 64), (100, 8, 2, 16)]


def routed_ids(num_tokens, num_experts, top_k):
    ids = torch.rand(num_tokens, num_experts, generator=torch.Generator().manual_seed(3)).topk(top_k).indices
    ids[: num_tokens // 2] = ids[: num_tokens // 2] % 2  # crowd experts 0 and 1, leave others empty
    return ids


def check_alignment(blocks, ids, num_experts, block_m, stable=True):
    """Each block holds pairs of its expert only (in order when ``stable``); every pair once; padding
    past the count."""
    num_pairs = ids.numel()
    flat = ids.reshape(-1).long()
    rows = blocks.sorted_pairs.long()
    num_padded = int(blocks.num_padded)
    assert num_padded % block_m == 0 and rows.shape[0] == blocks.num_blocks * block_m >= num_padded
    real = rows[rows < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    assert (rows[num_padded:] == num_pairs).all()  # past the count: padding only
    counts = torch.bincount(flat, minlength=num_experts)
    assert num_padded == int(((counts + block_m - 1) // block_m * block_m).sum())
    for b in range(blocks.num_blocks):
        expert = int(blocks.block_expert[b])
        block = rows[b * block_m:(b + 1) * block_m]
        if b * block_m >= num_padded:
            assert expert == num_experts
            continue
        pairs = block[block < num_pairs]
        assert len(pairs) and (flat[pairs] == expert).all()  # no block of padding alone
        if stable:
            assert torch.equal(pairs, pairs.sort().values)  # pairs keep their order (a stable sort)


@outside_interpreter
@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m", ALIGN_CASES)
def test_align_pairs_blocks_hold_one_expert_each(num_tokens, num_experts, top_k, block_m):
    ids = routed_ids(num_tokens, num_experts, top_k).to(torch.int32)
    check_alignment(fused_moe.align_pairs(ids, num_experts, block_m), ids, num_experts, block_m)


@outside_interpreter
@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m", [
    (1, 128, 8, 16), (64, 128, 8, 16), (256, 128, 8, 32), (512, 128, 8, 64), (4096, 128, 8, 128),  # Qwen3-30B-A3B
    (64, 32, 4, 16), (4096, 32, 4, 128),  # gpt-oss-20b
])
def test_tiles_follow_the_pairs_per_expert(num_tokens, num_experts, top_k, block_m):
    assert fused_moe.pick_tiles(num_tokens * top_k, num_experts).block_m == block_m


# ---- the Triton kernels in the interpreter -------------------------------------------------------------

@outside_interpreter
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernels_in_interpreter(run_in_triton_interpreter):
    run_in_triton_interpreter(__file__)


@pytest.fixture(autouse=True)
def interpreter_rounds_bf16_like_the_gpu(monkeypatch):
    """Two patches of Triton 3.9's interpreter, for these tests only (the kernels are unchanged):
    ``tl.dot`` multiplies bf16 operands as their raw uint16 bits (tests/plugins/quantization/
    test_int4_triton.py says why), so they are widened to float32 first (exact); and float32 -> bf16
    casts truncate where the GPU (and torch) round to nearest even, which biases every rounding of
    the kernel one way, so they round to nearest even here. Then bf16 is checked to one bf16 step."""
    if not IN_INTERPRETER:
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter

    create_dot, cast_impl = interpreter.InterpreterBuilder.create_dot, interpreter.InterpreterBuilder.cast_impl

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def cast(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast_impl(self, src, dst_type)
        bits = src.data.astype(np.float32).view(np.uint32)  # finite values: no NaN handling needed
        return interpreter.TensorHandle(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16), tl.bfloat16)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", dot)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast)
    yield


def check_kernel(moe, dtype, **kwargs):
    """The Triton path against the reference. float32: reduction order only (exact products, fp32
    accumulation). bf16: both round the projections, the activation and the expert output to bf16,
    but the kernel sums the k slots in float32 once where the reference adds them in bf16, and
    computes the activation in float32 from rounded inputs: a bf16 step of the output's scale apart
    (2**-7 of its largest magnitude), and no further from the float32 computation on the same inputs
    than the reference is."""
    assert fused_moe.use_triton(moe["x"])
    got = run(fused_moe.fused_experts, moe, **kwargs)
    want = run(fused_moe.fused_experts_ref, moe, **kwargs)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7 * scale)
    exact = run(fused_moe.fused_experts_ref, {k: v.float() if v is not None and v.is_floating_point() else v
                                              for k, v in moe.items()}, **kwargs)
    error = (got.float() - exact).norm() / exact.norm()
    assert error <= 1.1 * (want.float() - exact).norm() / exact.norm()


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, num_experts, top_k, hidden, inter, bias, activation", [
    (1, 4, 1, 32, 48, False, "silu"),
    (5, 8, 2, 48, 32, True, "swigluoai"),
    (33, 8, 3, 32, 48, True, "silu"),
    (33, 4, 2, 48, 32, False, "swigluoai"),
    (5, 4, 3, 32, 32, True, "silu"),
])
def test_kernel_matches_reference(dtype, num_tokens, num_experts, top_k, hidden, inter, bias, activation):
    moe = make_moe(num_tokens, num_experts, top_k, hidden, inter, bias=bias, dtype=dtype, seed=num_tokens)
    check_kernel(moe, dtype, activation=activation, swiglu_limit=1.5)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_with_experts_that_get_no_tokens(dtype):
    moe = make_moe(9, 8, 2, 32, 48, bias=True, dtype=dtype, seed=4)
    moe["topk_ids"] = moe["topk_ids"] % 3  # experts 3..7 idle (k = 2 distinct ids: 0/1/2 pairs)
    moe["topk_ids"][:, 1] = (moe["topk_ids"][:, 0] + 1) % 3
    check_kernel(moe, dtype)


@interpreted
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(33, 4, 1), (64, 2, 2)])  # BLOCK_M 32; 128
def test_kernel_with_every_token_on_the_same_experts(num_tokens, num_experts, top_k):
    moe = make_moe(num_tokens, num_experts, top_k, 48, 32, bias=True, seed=5)
    moe["topk_ids"] = (torch.arange(top_k) + 1).expand(num_tokens, top_k) % num_experts
    check_kernel(moe, torch.float32, activation="swigluoai")


@interpreted
@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m",
                         [c for c in ALIGN_CASES if c[0] * c[2] <= fused_moe.ALIGN_KERNEL_MAX_PAIRS])
def test_align_kernel_equals_the_torch_alignment(num_tokens, num_experts, top_k, block_m):
    ids = routed_ids(num_tokens, num_experts, top_k)  # int64, as the router gives them
    blocks = fused_moe.align_pairs(ids, num_experts, block_m, use_kernel=True)
    check_alignment(blocks, ids, num_experts, block_m)
    want = fused_moe.align_pairs(ids, num_experts, block_m, use_kernel=False)
    for field in ("sorted_pairs", "block_expert", "num_padded"):
        assert torch.equal(getattr(blocks, field), getattr(want, field)), field


@interpreted
@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m", [(100, 8, 2, 16), (300, 8, 4, 16),
                                                                     (160, 128, 8, 32)])
def test_parallel_align_kernels_fill_the_same_blocks(num_tokens, num_experts, top_k, block_m):
    """Past ALIGN_KERNEL_MAX_PAIRS pairs the alignment runs as three kernels with atomics: the same
    blocks, experts and padding as torch's stable sort, the order within an expert free."""
    ids = routed_ids(num_tokens, num_experts, top_k)
    assert ids.numel() > fused_moe.ALIGN_KERNEL_MAX_PAIRS
    blocks = fused_moe.align_pairs(ids, num_experts, block_m, use_kernel=True)
    check_alignment(blocks, ids, num_experts, block_m, stable=False)
    want = fused_moe.align_pairs(ids, num_experts, block_m, use_kernel=False)
    assert torch.equal(blocks.block_expert, want.block_expert) and torch.equal(blocks.num_padded, want.num_padded)
    rows = blocks.sorted_pairs.reshape(-1, block_m)
    for b, want_rows in enumerate(want.sorted_pairs.reshape(-1, block_m)):
        assert sorted(rows[b].tolist()) == sorted(want_rows.tolist()), b


@interpreted
def test_kernel_int32_ids_and_strided_x():
    moe = make_moe(6, 4, 2, 32, 32, seed=6)
    moe["topk_ids"] = moe["topk_ids"].to(torch.int32)
    moe["x"] = torch.randn(32, 6, generator=torch.Generator().manual_seed(7)).t()  # column-major rows
    check_kernel(moe, torch.float32)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_experts, top_k", [(8, 2), (32, 4), (128, 8), (60, 4)])
@pytest.mark.parametrize("scoring, renormalize, round_weights", [("softmax", True, True), ("softmax", False, False),
                                                                ("softmax", True, False), ("topk_softmax", True, True)])
def test_routing_kernel_matches_the_torch_routing(dtype, num_experts, top_k, scoring, renormalize, round_weights):
    """The one-kernel routing (softmax and top-k, or top-k and softmax) picks the torch path's experts in
    its order (distinct logits: no ties) with its weights, for expert counts that are not powers of two too."""
    from kvforge.layers.moe import select_experts, select_experts_ref

    g = torch.Generator().manual_seed(num_experts + top_k)
    # distinct in every dtype: a permutation of evenly spaced values
    logits = torch.stack([torch.randperm(num_experts, generator=g) for _ in range(9)]).float() * 0.0625 - 2.0
    logits = logits.to(dtype)
    want_w, want_ids = select_experts_ref(logits, top_k, scoring, renormalize, round_weights)
    got_w, got_ids = select_experts(logits, top_k, scoring, renormalize, round_weights)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)
    if renormalize or scoring == "topk_softmax":
        torch.testing.assert_close(got_w.sum(-1), torch.ones(9), rtol=1e-2, atol=1e-2)
