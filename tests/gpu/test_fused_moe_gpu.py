"""The fused MoE Triton kernels (``kvforge.layers.fused_moe``) on the GPU in bf16, at the expert shapes of
Qwen3-30B-A3B and gpt-oss-20b, against the float32 reference on the same bf16 operands; and a CUDA
graph of the kernels replayed with new inputs and routings, equal to eager bit for bit.

The CPU interpreter checks the same kernels at tiny shapes (tests/core/test_fused_moe.py); here the
real tile sizes, masks on H = 2880 (not a multiple of 128) and the tensor cores run.
"""
import pytest
import torch

from kvforge.layers.fused_moe import fused_experts, fused_experts_ref, pick_tiles, use_triton

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

#: model -> (experts, top_k, hidden, intermediate, biases, activation)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768, False, "silu"),
          "gpt-oss-20b": (32, 4, 2880, 2880, True, "swigluoai")}


def make_moe(model: str, num_tokens: int, seed: int = 0) -> dict:
    """bf16 operands with outputs of order one, routed as the models' routers do (softmax, top k)."""
    experts, top_k, hidden, inter, bias, activation = SHAPES[model]
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    weights, ids = torch.softmax(torch.randn(num_tokens, experts, generator=g, device="cuda"), dim=-1).topk(top_k)
    return dict(x=randn(num_tokens, hidden), w13=randn(experts, 2 * inter, hidden, scale=hidden ** -0.5),
                w2=randn(experts, hidden, inter, scale=inter ** -0.5), topk_weights=weights / weights.sum(-1, True),
                topk_ids=ids, w13_bias=randn(experts, 2 * inter, scale=0.5) if bias else None,
                w2_bias=randn(experts, hidden, scale=0.5) if bias else None, activation=activation)


def call(fn, moe: dict) -> torch.Tensor:
    return fn(moe["x"], moe["w13"], moe["w2"], moe["topk_weights"], moe["topk_ids"], activation=moe["activation"],
              w13_bias=moe["w13_bias"], w2_bias=moe["w2_bias"])


def as_float32(moe: dict) -> dict:
    return {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in moe.items()}


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 256, 512, 4096])  # every MOE_TILES bucket
@pytest.mark.parametrize("model", list(SHAPES))
def test_bf16_kernels_match_the_float32_reference(model, num_tokens):
    """Within a bf16 step of the output's scale (2**-6 of its largest magnitude, elementwise), and no
    further from the float32 result, in norm, than torch's bf16 computation of the same operands."""
    moe = make_moe(model, num_tokens)
    assert use_triton(moe["x"])
    got = call(fused_experts, moe)
    assert got.dtype == torch.bfloat16 and got.shape == moe["x"].shape
    exact = call(fused_experts_ref, as_float32(moe))
    scale = exact.abs().max().item()
    torch.testing.assert_close(got.float(), exact, rtol=2 ** -6, atol=2 ** -6 * scale)
    torch_bf16 = call(fused_experts_ref, moe).float()
    error, torch_error = (got.float() - exact).norm(), (torch_bf16 - exact).norm()
    assert error <= 1.1 * torch_error, (error / exact.norm(), torch_error / exact.norm())


@pytest.mark.parametrize("model, num_tokens", [("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 7), ("qwen3-30b-a3b", 512),
                                               ("gpt-oss-20b", 64)])
def test_graph_replay_matches_eager_exactly(model, num_tokens):
    """Captured once, replayed with new tokens and new routings (the alignment is on the device, sized
    by shapes only): each replay equals an eager call bit for bit."""
    static = make_moe(model, num_tokens, seed=1)
    call(fused_experts, static)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(fused_experts, static)
    for seed in (2, 3):
        fresh = make_moe(model, num_tokens, seed=seed)
        for name in ("x", "topk_weights", "topk_ids"):
            static[name].copy_(fresh[name])
        graph.replay()
        assert torch.equal(out, call(fused_experts, static))
    tiles = pick_tiles(static["topk_ids"].numel(), static["w13"].shape[0])
    assert tiles.block_m == (16 if num_tokens <= 64 else 64)


@pytest.mark.parametrize("model", sorted(SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 256, 4096])
def test_routing_kernel_matches_the_torch_routing_on_the_gpu(model, num_tokens):
    """The one-kernel routing on CUDA against the torch ops (float32 logits: no ties), with the models'
    own scoring (Qwen3: softmax, top k, renormalised and rounded; gpt-oss: top k logits, softmax), and
    inside a CUDA graph replayed on new logits."""
    from kvforge.layers.moe import select_experts, select_experts_ref

    experts, top_k = SHAPES[model][:2]
    scoring = "softmax" if model.startswith("qwen") else "topk_softmax"
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    logits = torch.randn(num_tokens, experts, generator=g, device="cuda")
    want = select_experts_ref(logits, top_k, scoring)
    got = select_experts(logits, top_k, scoring)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    static = logits.clone()
    select_experts(static, top_k, scoring)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_w, out_ids = select_experts(static, top_k, scoring)
    static.copy_(torch.randn(num_tokens, experts, generator=g, device="cuda"))
    graph.replay()
    want = select_experts_ref(static, top_k, scoring)
    assert torch.equal(out_ids, want[1])
    torch.testing.assert_close(out_w, want[0], rtol=1e-5, atol=1e-6)
