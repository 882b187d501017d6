"""The batched LoRA kernels (``kvforge.kernels.lora``) on the GPU at a real layer's shapes (hidden
4096, rank 16 on each of q/k/v = 48 shrink columns, a 6144-wide qkv output in bf16) against the torch
path; and a CUDA graph of a shrink + expand captured with one grouping and replayed with others copied
into the same buffers.

The CPU interpreter checks the same kernels at tiny shapes (tests/core/test_lora_ops.py); here the real
tiles, the split-K shrink at decode sizes and the tensor cores run.
"""
import numpy as np
import pytest
import torch

from kvforge.lora.ops import LoRABatch, group_rows, pick_tiles, segmented_matmul, tile_capacity, tile_grouping

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HIDDEN, RANK, QKV = 4096, 48, 6144
NUM_SLOTS = 8


def make_layer(seed: int = 0) -> dict:
    """bf16 LoRA weights with outputs of order one: A [S, 48, 4096], B [S, 6144, 48]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return dict(a=(torch.randn(NUM_SLOTS, RANK, HIDDEN, generator=g, device="cuda") * HIDDEN ** -0.5).bfloat16(),
                b=(torch.randn(NUM_SLOTS, QKV, RANK, generator=g, device="cuda") * RANK ** -0.5).bfloat16())


def random_slots(num_rows: int, seed: int) -> np.ndarray:
    """Slots 0..7 and base rows (-1), slot 5 empty."""
    row_slots = np.random.default_rng(seed).integers(-1, NUM_SLOTS, num_rows)
    row_slots[row_slots == 5] = -1
    return row_slots


def lora_forward(x, layer, batch, h, y, impl):
    """The LoRA part of one layer: h = x @ A[slot].T (bf16, as the engine's scratch), y += h @ B[slot].T
    (y: a view)."""
    segmented_matmul(x, layer["a"], batch, h, accumulate=False, impl=impl)
    segmented_matmul(h, layer["b"], batch, y, accumulate=True, impl=impl)


#: (rows, padded): with ``padded`` the work list is sized for the row count, as under a CUDA graph
@pytest.mark.parametrize("num_rows, padded", [(5, False), (64, False), (256, False), (256, True)])
def test_triton_matches_torch_at_real_shapes(num_rows, padded):
    """Shrink: the same exact products, float32 sums in another order, rounded to bf16 (within a bf16
    step). Expand: then both round to bf16 once, so within a bf16 step of the output's scale. Base rows:
    untouched, exactly."""
    layer = make_layer()
    row_slots = random_slots(num_rows, seed=num_rows)
    order, starts = group_rows(row_slots, NUM_SLOTS)
    batch = LoRABatch.from_grouping(order, starts, device="cuda",
                                    tiles=tile_capacity(num_rows, NUM_SLOTS) if padded else None)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(num_rows, HIDDEN + 64, generator=g, device="cuda").bfloat16()[:, 64:]  # a strided view
    qkv = torch.randn(num_rows, QKV + 1024, generator=g, device="cuda").bfloat16()  # the layer's output
    results = {}
    for impl in ("torch", "triton"):
        h = torch.zeros(num_rows, RANK, device="cuda", dtype=torch.bfloat16)
        wide = qkv.clone()
        lora_forward(x, layer, batch, h, wide[:, 512:512 + QKV], impl)
        results[impl] = h, wide
    (h_want, want), (h_got, got) = results["torch"], results["triton"]
    torch.testing.assert_close(h_got.float(), h_want.float(), rtol=2 ** -7, atol=2 ** -7 * h_want.float().abs().max().item())
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7 * scale)
    base = torch.from_numpy(row_slots < 0).cuda()
    assert torch.equal(got[base], qkv[base]) and torch.equal(h_got[base], torch.zeros_like(h_got[base]))
    assert torch.equal(got[:, :512], qkv[:, :512]) and torch.equal(got[:, 512 + QKV:], qkv[:, 512 + QKV:])
    assert pick_tiles(batch.tiles.shape[0], RANK, HIDDEN, fp32=False).split_k == 8  # decode sizes: split K


def test_graph_replay_with_new_groupings_matches_torch():
    """Captured once (a work list sized for the padded token count, no host starts), replayed after new
    groupings are copied into the same order/starts/tiles buffers: each replay equals an eager Triton call on the same
    buffers bit for bit (deterministic: no atomics), and the torch path of the new grouping within
    tolerance."""
    num_rows = 64
    layer = make_layer(seed=2)
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(num_rows, HIDDEN, generator=g, device="cuda").bfloat16()
    base_out = torch.randn(num_rows, QKV, generator=g, device="cuda").bfloat16()
    h = torch.zeros(num_rows, RANK, device="cuda", dtype=torch.bfloat16)
    y = base_out.clone()
    order, starts = group_rows(random_slots(num_rows, seed=4), NUM_SLOTS)
    padded = np.zeros(num_rows, dtype=np.int32)
    padded[:len(order)] = order
    capacity = tile_capacity(num_rows, NUM_SLOTS)
    static = LoRABatch(order=torch.from_numpy(padded).cuda(), starts=torch.from_numpy(starts).cuda(),
                       tiles=torch.from_numpy(tile_grouping(starts, capacity)).cuda(), num_slots=NUM_SLOTS,
                       host_starts=None)
    lora_forward(x, layer, static, h, y, "triton")  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_forward(x, layer, static, h, y, "triton")
    for seed in (5, 6, 7):
        row_slots = random_slots(num_rows, seed=seed)
        if seed == 7:
            row_slots[:] = 3  # every row on one slot: all tiles on one segment
        order, starts = group_rows(row_slots, NUM_SLOTS)
        padded[:] = 0
        padded[:len(order)] = order
        static.order.copy_(torch.from_numpy(padded))
        static.starts.copy_(torch.from_numpy(starts))
        static.tiles.copy_(torch.from_numpy(tile_grouping(starts, capacity)))
        y.copy_(base_out)
        graph.replay()
        replayed = y.clone()
        y.copy_(base_out)
        lora_forward(x, layer, static, h, y, "triton")
        assert torch.equal(replayed, y)
        want = base_out.clone()
        fresh = LoRABatch.from_grouping(order, starts, device="cuda")
        lora_forward(x, layer, fresh, torch.zeros(num_rows, RANK, device="cuda", dtype=torch.bfloat16), want, "torch")
        scale = want.float().abs().max().item()
        torch.testing.assert_close(replayed.float(), want.float(), rtol=2 ** -7, atol=2 ** -7 * scale)
        base = torch.from_numpy(row_slots < 0).cuda()
        assert torch.equal(replayed[base], base_out[base])
