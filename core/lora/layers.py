"""LoRA wraps the model's projections: ``y = base(x) + B_s (A_s x)`` with s the row's adapter slot.

Each wrapped layer holds, for every device slot, its adapters' weights padded to ``max_lora_rank``
per part and stacked over the parts of a fused layer (q/k/v, gate/up)::

    lora_a: [max_loras, parts * max_rank, in_features on this rank]
    lora_b: [max_loras, out_features on this rank, parts * max_rank]   (block-diagonal over the parts)

so one shrink and one expand (``kvforge.lora.ops.segmented_matmul``) cover a fused layer: part p's
outputs only read columns ``p * max_rank ...`` of B. PEFT's scaling is folded into B.

Under tensor parallelism a column-parallel layer keeps A whole and its rows of B; a row-parallel
layer keeps its columns of A and B whole, and adds its partial ``B (A_r x_r)`` to its partial
product before the all-reduce (the sum over ranks is the whole delta, by linearity).
Model files never see any of this: :func:`wrap_model` swaps the modules after loading.
"""
from __future__ import annotations

import torch
from torch import nn

from kvforge.layers.linear import ColumnParallelLinear, RowParallelLinear
from kvforge.layers.weights import ShardId
from kvforge.lora.ops import LoRABatch, segmented_matmul, tile_capacity

#: the fused module names the Llama family's layers use; a checkpoint module maps onto them by the
#: model's ``param_for`` (q_proj -> qkv_proj part "q")
WRAPPED_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoRAContext:
    """The step's adapter rows, shared by every wrapped layer of one model (not a global: the
    worker that owns the model owns it). ``batch`` lives in static device buffers, so a captured
    CUDA graph reads each step's grouping after the worker copies it in."""

    def __init__(self, *, max_loras: int, max_rank: int, max_parts: int, max_tokens: int,
                 device: torch.device, dtype: torch.dtype):
        self.max_loras, self.max_rank, self.max_parts, self.dtype = max_loras, max_rank, max_parts, dtype
        self.active = False  # False: no row has an adapter (eager steps skip the LoRA kernels)
        self.starts = torch.zeros(max_loras + 1, dtype=torch.int32, device=device)
        self.batch: LoRABatch | None = None
        self._alloc(max_tokens, device)

    def _alloc(self, num_rows: int, device: torch.device) -> None:
        self.order = torch.zeros(num_rows, dtype=torch.int32, device=device)  # rows grouped by slot
        self.tiles = torch.zeros(tile_capacity(num_rows, self.max_loras), 3, dtype=torch.int32, device=device)
        # the shrink's output, reused by every layer in turn: [rows, parts * max_rank] in the model's
        # dtype (rounded once, as peft's lora_A output is; 16-bit operands keep the expand on tensor cores)
        self.scratch = torch.zeros(num_rows, self.max_parts * self.max_rank, dtype=self.dtype, device=device)

    def grow(self, num_rows: int) -> None:
        """Room for a step of ``num_rows`` rows (eager steps only: graphs never outgrow their capture)."""
        if num_rows > self.order.shape[0]:
            self._alloc(num_rows, self.order.device)


class LoRALinear(nn.Module):
    """A column- or row-parallel linear layer with per-slot LoRA weights."""

    def __init__(self, base: ColumnParallelLinear | RowParallelLinear, ctx: LoRAContext, name: str):
        super().__init__()
        self.base, self.ctx, self.name = base, ctx, name
        self.row_parallel = isinstance(base, RowParallelLinear)
        self.part_ids: list[ShardId] = []
        # (rows of B this rank keeps from the checkpoint part, where they go in the output)
        self.out_slices: list[tuple[int, int, int, int]] = []
        if isinstance(base, RowParallelLinear):
            self.part_ids.append(None)
            self.out_slices.append((0, base.output_size, 0, base.output_size))
            in_features = base.count  # this rank's columns of A
        else:
            offset = 0
            for p in base.parts:
                self.part_ids.append(p.shard_id)
                self.out_slices.append((p.start, p.count, offset, p.full))
                offset += p.count
            in_features = base.input_size
        r = ctx.max_rank * len(self.part_ids)
        dtype, device = base.params_dtype, ctx.scratch.device
        self.lora_a = torch.zeros(ctx.max_loras, r, in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(ctx.max_loras, base.output_size, r, dtype=dtype, device=device)

    @property
    def in_full(self) -> int:
        return self.base.input_size

    def slot_image(self, parts: dict[ShardId, tuple[torch.Tensor, torch.Tensor]]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's padded (A, B) for one slot from an adapter's ``{part id: (A [r, in], B [out, r])}``
        (checkpoint shapes, scaled); parts the adapter does not adapt stay zero. ``ValueError`` on a
        shape that does not fit the layer."""
        mr, base = self.ctx.max_rank, self.base
        a_img = torch.zeros(self.lora_a.shape[1:], dtype=self.lora_a.dtype)
        b_img = torch.zeros(self.lora_b.shape[1:], dtype=self.lora_b.dtype)
        for i, pid in enumerate(self.part_ids):
            if pid not in parts:
                continue
            a, b = parts[pid]
            r = a.shape[0]
            src, count, dst, full = self.out_slices[i]
            if a.shape[1] != self.in_full or b.shape[0] != full:
                raise ValueError(f"lora_request.lora_path: {self.name}{'' if pid is None else f'[{pid}]'}: lora_A "
                                 f"{tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the layer "
                                 f"({self.in_full} in, {full} out)")
            if isinstance(base, RowParallelLinear):
                a = a[:, base.start:base.start + base.count]
            a_img[i * mr:i * mr + r] = a.to(a_img.dtype)
            b_img[dst:dst + count, i * mr:i * mr + r] = b[src:src + count].to(b_img.dtype)
        return a_img, b_img

    def load_slot(self, slot: int, image: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Copy a slot image in (queued on the stream: a step in flight that reads the old slot runs first)."""
        self.lora_a[slot].copy_(image[0], non_blocking=True)
        self.lora_b[slot].copy_(image[1], non_blocking=True)

    def _delta(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[rows of slot s] += B_s (A_s x) for every slot s."""
        ctx, batch = self.ctx, self.ctx.batch
        if batch is None:  # NOTE: the worker sets the batch before the first step with adapters
            raise RuntimeError(f"{self.name}: a LoRA step without the step's adapter rows")
        s = ctx.scratch[:x.shape[0], :self.lora_a.shape[1]]  # [T, parts * max_rank]
        segmented_matmul(x, self.lora_a, batch, s, accumulate=False)
        segmented_matmul(s, self.lora_b, batch, y, accumulate=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        if not self.ctx.active:
            return base(x)
        if not isinstance(base, RowParallelLinear):
            y = base(x)
            self._delta(x, y)
            return y
        y = base._matmul(x)  # this rank's partial product
        self._delta(x, y)
        if base.tp.size > 1:
            y = base.tp.all_reduce(y)
        return y if base.bias is None else y.add_(base.bias)


def wrap_model(model: nn.Module, ctx: LoRAContext) -> dict[str, LoRALinear]:
    """Replace every adaptable projection of ``model`` with a :class:`LoRALinear`; returns them by
    module name (``model.layers.3.self_attn.qkv_proj``)."""
    wrapped: dict[str, LoRALinear] = {}
    targets = [(name, m) for name, m in model.named_modules()
               if name.rsplit(".", 1)[-1] in WRAPPED_MODULES and isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        layer = LoRALinear(module, ctx, name)
        setattr(model.get_submodule(parent_name), attr, layer)
        wrapped[name] = layer
    return wrapped
