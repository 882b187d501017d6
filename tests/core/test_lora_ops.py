"""The batched LoRA matmul (kvforge.lora.ops): the grouping of rows by slot against a plain Python
grouping; the torch path against a per-row loop; the Triton kernels in the CPU interpreter against the
torch path, at shrink-like (small N, larger K) and expand-like (small K, larger N) shapes.

As in tests/core/test_fused_moe.py, the interpreter must be on before triton is first imported, so the
kernel tests run in a subprocess with TRITON_INTERPRET=1 (test_kernels_in_interpreter).
"""
import importlib.util

import numpy as np
import pytest
import torch

from kvforge.lora import ops
from kvforge.lora.ops import (
    TILE_ROWS,
    LoRABatch,
    group_request_rows,
    group_rows,
    segmented_matmul,
    tile_capacity,
    tile_grouping,
)
from testing_support import IN_INTERPRETER, interpreted

outside_interpreter = pytest.mark.skipif(IN_INTERPRETER, reason="outside the interpreter only")


def python_grouping(row_slots, num_slots):
    rows = [[r for r, s in enumerate(row_slots) if s == slot] for slot in range(num_slots)]
    starts = [0]
    for slot_rows in rows:
        starts.append(starts[-1] + len(slot_rows))
    return [r for slot_rows in rows for r in slot_rows], starts


def make_case(num_rows, k, n, num_slots, row_slots, *, x_dtype, w_dtype, out_dtype, views=False, seed=0):
    """x [T, K], weights [S, N, K] with outputs of order one, out [T, N] random (the old values). With
    ``views``: x a strided row view of a wider tensor, out a column slice of one (stride(1) == 1)."""
    g = torch.Generator().manual_seed(seed)
    weights = (torch.randn(num_slots, n, k, generator=g) / k ** 0.5).to(w_dtype)
    if views:
        x = torch.randn(2 * num_rows, k + 5, generator=g).to(x_dtype)[::2, 2:2 + k]
        wide = torch.randn(num_rows, n + 7, generator=g).to(out_dtype)
        out = wide[:, 4:4 + n]
        assert x.stride(1) == 1 and not x.is_contiguous() and out.stride(1) == 1 and not out.is_contiguous()
    else:
        x = torch.randn(num_rows, k, generator=g).to(x_dtype)
        wide = out = torch.randn(num_rows, n, generator=g).to(out_dtype)
    order, starts = group_rows(np.asarray(row_slots), num_slots)
    return x, weights, out, wide, order, starts


def per_row(x, weights, row_slots, before, accumulate):
    """The contract, row by row: x[r] @ W[slot].T in float32 (+ the old row), rounded once."""
    want = before.clone()
    for r, slot in enumerate(row_slots):
        if slot >= 0:
            y = x[r].float() @ weights[slot].float().t()
            want[r] = (before[r].float() + y if accumulate else y).to(want.dtype)
    return want


def close(got, want):
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # a 16-bit step apart: the sums' order differs, then both round
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7 * scale)


# ---- the grouping --------------------------------------------------------------------------------------

@outside_interpreter
@pytest.mark.parametrize("num_rows, num_slots, seed", [(0, 3, 0), (1, 1, 1), (40, 5, 2), (200, 16, 3), (7, 0, 4)])
def test_group_rows_matches_a_python_grouping(num_rows, num_slots, seed):
    row_slots = np.random.default_rng(seed).integers(-1, num_slots, num_rows)
    order, starts = group_rows(row_slots, num_slots)
    want_order, want_starts = python_grouping(row_slots.tolist(), num_slots)
    assert order.dtype == np.int32 and starts.dtype == np.int32
    assert order.tolist() == want_order and starts.tolist() == want_starts


@outside_interpreter
@pytest.mark.parametrize("seed", range(5))
def test_group_request_rows_equals_group_rows_on_the_repeat(seed):
    rng = np.random.default_rng(seed)
    num_requests, num_slots = int(rng.integers(0, 12)), int(rng.integers(1, 6))
    req_slots = rng.integers(-1, num_slots, num_requests)
    query_lens = rng.integers(0, 9, num_requests)  # decode (1), prefill chunks, and empty requests
    order, starts = group_request_rows(req_slots, query_lens, num_slots)
    want_order, want_starts = group_rows(np.repeat(req_slots, query_lens), num_slots)
    assert order.dtype == np.int32 and starts.dtype == np.int32
    assert np.array_equal(order, want_order) and np.array_equal(starts, want_starts)


@outside_interpreter
def test_bad_groupings_are_value_errors_naming_the_field():
    with pytest.raises(ValueError, match=r"row_slots must lie in \[-1, 3\).*\[-1, 3\]"):
        group_rows(np.array([0, 3, -1]), 3)
    with pytest.raises(ValueError, match="query_lens must be integers >= 0"):
        group_request_rows(np.array([0, 1]), np.array([2, -1]), 2)
    order, starts = group_rows(np.array([0] * 33 + [1]), 2)  # slot 0: two tiles, slot 1: one
    with pytest.raises(ValueError, match=r"the grouping needs 3 row tiles; the capacity is 2"):
        LoRABatch.from_grouping(order, starts, device="cpu", tiles=2)


# ---- the torch path ----------------------------------------------------------------------------------

@outside_interpreter
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("views", [False, True])
def test_torch_path_matches_a_per_row_loop(accumulate, dtype, views):
    row_slots = np.random.default_rng(5).integers(-1, 4, 23)
    row_slots[row_slots == 2] = 0  # slot 2 gets no rows
    x, weights, out, wide, order, starts = make_case(23, 40, 12, 4, row_slots, x_dtype=dtype, w_dtype=dtype,
                                                     out_dtype=dtype, views=views)
    before, wide_before = out.clone(), wide.clone()
    batch = LoRABatch.from_grouping(order, starts, device="cpu")
    segmented_matmul(x, weights, batch, out, accumulate=accumulate)
    close(out, per_row(x, weights, row_slots, before, accumulate))
    base = torch.from_numpy(row_slots < 0)
    assert base.any() and torch.equal(out[base], before[base])  # rows of no slot: untouched, exactly
    if views:  # the wider tensor's other columns too
        assert torch.equal(wide[:, :4], wide_before[:, :4]) and torch.equal(wide[:, 16:], wide_before[:, 16:])


@outside_interpreter
def test_torch_path_without_host_starts_reads_the_device_starts():
    row_slots = np.array([1, -1, 0, 1, 1])
    x, weights, out, _, order, starts = make_case(5, 16, 8, 2, row_slots, x_dtype=torch.float32,
                                                  w_dtype=torch.float32, out_dtype=torch.float32)
    before = out.clone()
    batch = LoRABatch.from_grouping(order, starts, device="cpu", capacity=9, tiles=tile_capacity(9, 2))
    batch.host_starts = None
    segmented_matmul(x, weights, batch, out, accumulate=True, impl="torch")
    close(out, per_row(x, weights, row_slots, before, True))


@outside_interpreter
def test_auto_runs_torch_on_the_cpu(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton path ran for CPU tensors")
    monkeypatch.setattr(ops, "segmented_matmul_triton", refuse)
    x, weights, out, _, order, starts = make_case(3, 16, 8, 1, [0, -1, 0], x_dtype=torch.float32,
                                                  w_dtype=torch.float32, out_dtype=torch.float32)
    segmented_matmul(x, weights, LoRABatch.from_grouping(order, starts, device="cpu"), out, accumulate=False)


@outside_interpreter
def test_bad_arguments_are_value_errors():
    x, weights, out, _, order, starts = make_case(3, 16, 8, 2, [0, -1, 1], x_dtype=torch.float32,
                                                  w_dtype=torch.float32, out_dtype=torch.float32)
    batch = LoRABatch.from_grouping(order, starts, device="cpu")
    with pytest.raises(ValueError, match="impl 'cuda' is not one of auto, torch, triton"):
        segmented_matmul(x, weights, batch, out, accumulate=False, impl="cuda")
    with pytest.raises(ValueError, match="do not fit"):
        segmented_matmul(x, weights, batch, out[:, :4], accumulate=False)
    with pytest.raises(ValueError, match="the batch has 2 slots, weights only 1"):
        segmented_matmul(x, weights[:1], batch, out, accumulate=False)


# ---- the Triton kernels in the interpreter -------------------------------------------------------------

@outside_interpreter
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernels_in_interpreter(run_in_triton_interpreter):
    run_in_triton_interpreter(__file__)


@pytest.fixture
def interpreter_dot_widens_bf16(monkeypatch):
    """Triton 3.9's interpreter multiplies bf16 ``tl.dot`` operands as their raw uint16 bits
    (tests/core/test_fused_moe.py), so they are widened to float32 first: exact, as the GPU's products."""
    import triton.language as tl
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", dot)


#: (K, N): shrink-like (N < K) and expand-like (K < N); 1024 x 16 splits K over 2 programs
SHAPES = {"shrink": (64, 24), "expand": (24, 80), "split_k": (1024, 16)}
#: slot 2 gets no rows; -1 rows are the base model's
ROW_SLOTS = [0, -1, 1, 1, 3, 0, -1, 3, 3, 1, 0, 0, -1, 4, 0, 3, 1, 1, 0, -1, 0]


def check_kernel(shape, x_dtype, w_dtype, out_dtype, accumulate, *, row_slots=ROW_SLOTS, views=True, **batch_args):
    k, n = SHAPES[shape]
    x, weights, out, wide, order, starts = make_case(len(row_slots), k, n, 5, row_slots, x_dtype=x_dtype,
                                                     w_dtype=w_dtype, out_dtype=out_dtype, views=views, seed=k + n)
    batch = LoRABatch.from_grouping(order, starts, device="cpu", **batch_args)
    want, wide_before = out.clone(), wide.clone()
    segmented_matmul(x, weights, batch, want, accumulate=accumulate, impl="torch")
    segmented_matmul(x, weights, batch, out, accumulate=accumulate, impl="triton")
    close(out, want)
    base = torch.from_numpy(np.asarray(row_slots) < 0)
    assert torch.equal(out[base], wide_before[:, 4:4 + n][base] if views else wide_before[base])
    if views:
        assert torch.equal(wide[:, :4], wide_before[:, :4]) and torch.equal(wide[:, 4 + n:], wide_before[:, 4 + n:])


@interpreted
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_matches_torch_in_float32(shape, accumulate):
    check_kernel(shape, torch.float32, torch.float32, torch.float32, accumulate)


@interpreted
@pytest.mark.parametrize("shape", ["shrink", "split_k"])
def test_bf16_shrink_into_float32_matches_torch(shape, interpreter_dot_widens_bf16):
    check_kernel(shape, torch.bfloat16, torch.bfloat16, torch.float32, False)


@interpreted
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_expand_of_float32_rows_with_16bit_weights_matches_torch(out_dtype):
    """The LoRA expand: float32 shrink output, 16-bit B, added to the 16-bit layer output."""
    check_kernel("expand", torch.float32, out_dtype, out_dtype, True)


@interpreted
@pytest.mark.parametrize("shape", ["expand", "split_k"])
def test_kernel_with_a_graph_sized_batch(shape):
    """As under a CUDA graph: the work list is sized for a padded token count (unused entries) and order
    has spare capacity."""
    check_kernel(shape, torch.float32, torch.float32, torch.float32, True, tiles=tile_capacity(40, 5), capacity=32)


@interpreted
def test_kernel_with_several_row_tiles_in_a_slot():
    row_slots = [0] * 70 + [-1, 1, 1, -1, 3]  # slot 0: 70 rows, three 32-row tiles
    check_kernel("expand", torch.float32, torch.float32, torch.float32, True, row_slots=row_slots, views=False)
    assert ops.pick_tiles(5, 80, 24, fp32=True).block_m == TILE_ROWS == 32


@outside_interpreter
def test_tiles_follow_the_shape():
    shrink_decode = ops.pick_tiles(24, 48, 4096, fp32=False)  # a 512-row graph over 8 slots
    assert (shrink_decode.block_n, shrink_decode.block_k, shrink_decode.split_k) == (64, 128, 8)
    assert ops.pick_tiles(24, 16, 14336, fp32=False).split_k == 16  # down_proj: capped
    assert ops.pick_tiles(256, 48, 4096, fp32=False).split_k == 1  # prefill: enough row tiles
    expand = ops.pick_tiles(24, 6144, 48, fp32=False)
    assert (expand.block_m, expand.block_n, expand.block_k, expand.split_k) == (32, 128, 64, 1)
    assert ops.pick_tiles(4, 6144, 8, fp32=True).block_k == 16  # tl.dot's minimum
    assert ops.IMPLS == ("auto", "torch", "triton")


@outside_interpreter
def test_work_list_cuts_each_slot_into_tiles():
    counts = [70, 0, 3, 32, 33]
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    tiles = tile_grouping(starts, tile_capacity(sum(counts), len(counts)))
    want = []
    for slot, c in enumerate(counts):
        for first in range(0, c, TILE_ROWS):
            want.append([slot, starts[slot] + first, min(TILE_ROWS, c - first)])
    assert tiles.dtype == np.int32 and tiles.shape == (tile_capacity(138, 5), 3)
    assert tiles[:len(want)].tolist() == want and not tiles[len(want):].any()  # unused entries: zero rows
