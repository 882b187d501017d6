"""The mixture-of-experts layer: routing, the experts' weights (and how a checkpoint fills them), and
the expert computation (``kvforge.layers.fused_moe``: a fused Triton kernel on CUDA, torch on the CPU).

Weights, per layer: ``w13`` [E, 2 * I_rank, H] (each expert's gate rows, then its up rows) and ``w2``
[E, H, I_rank], optional biases ``w13_bias`` [E, 2 * I_rank] and ``w2_bias`` [E, H]. Under tensor
parallelism every rank holds every expert and the same slice ``I_rank`` of each expert's intermediate
dimension (gate/up rows, down columns), and the partial outputs are summed over the ranks, as a
column-parallel then row-parallel MLP would be (docs/models.md#moe). Expert parallelism (each rank
holding whole experts) is the documented next step; the loaders take an expert index, so it changes
only which experts a rank keeps.

A checkpoint names each expert's projections (``experts.3.gate_proj``, Mixtral's ``w1``/``w3``/``w2``)
or stacks them (gpt-oss's ``gate_up_proj`` [E, H, 2I], gate and up interleaved); the model file maps
its names onto ``weight_loader(param, tensor, shard_id)`` with ``shard_id`` = (expert, "w1" | "w3" |
"w2"), or (None, "w13_interleaved" | "w2_transposed") for a stacked tensor, or None for the whole
parameter as one rank holds it unsplit (dummy weights).
"""
from __future__ import annotations

import torch
from torch import nn

from kvforge.layers.weights import ShardId, check_shape, full_shape, set_loader
from kvforge.rank import parallel_state

#: how router logits become (weights, experts): "softmax": softmax over all experts, then the top k
#: (Mixtral, Qwen-MoE), renormalised when ``renormalize``; "topk_softmax": the top k logits, then a
#: softmax over them (gpt-oss)
SCORING = ("softmax", "topk_softmax")


def select_experts(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax",
                   renormalize: bool = True, round_weights: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int64), as transformers
    computes them (float32 softmax for "softmax", the weights rounded to the logits' dtype when
    ``round_weights``, as Qwen-MoE does and Mixtral does not; the logits' dtype for "topk_softmax").
    On CUDA one Triton kernel computes it (:func:`kvforge.layers.fused_moe.route`)."""
    if scoring not in SCORING:
        raise ValueError(f"MoE scoring {scoring!r} is not one of {', '.join(SCORING)}")
    from kvforge.layers.fused_moe import route, use_triton

    if use_triton(router_logits) and router_logits.dim() == 2 and router_logits.stride(-1) == 1:
        return route(router_logits, top_k, scoring == "softmax", renormalize, round_weights)
    return select_experts_ref(router_logits, top_k, scoring, renormalize, round_weights)


def select_experts_ref(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax",
                       renormalize: bool = True, round_weights: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select_experts` in torch ops (the CPU path and the kernel's reference)."""
    if scoring == "softmax":
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(router_logits.dtype).float() if round_weights else weights), ids
    if scoring == "topk_softmax":
        values, ids = torch.topk(router_logits, top_k, dim=-1)
        return torch.softmax(values, dim=-1, dtype=values.dtype).float(), ids
    raise ValueError(f"MoE scoring {scoring!r} is not one of {', '.join(SCORING)}")


class FusedMoE(nn.Module):
    """``num_experts`` gated MLPs of which each token uses ``top_k``; ``forward(x, router_logits)``."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 bias: bool = False, activation: str = "silu", scoring: str = "softmax",
                 renormalize: bool = True, round_weights: bool = True, swiglu_alpha: float = 1.702,
                 swiglu_limit: float = 7.0):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if scoring not in SCORING:
            raise ValueError(f"MoE scoring {scoring!r} is not one of {', '.join(SCORING)}")
        self.tp = parallel_state.current()
        self.start, self.count = parallel_state.split(intermediate_size, self.tp.size, self.tp.rank)
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation, self.scoring, self.renormalize = activation, scoring, renormalize
        self.round_weights = round_weights
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        e, h, i, n = num_experts, hidden_size, intermediate_size, self.count
        self.w13 = self._param((e, 2 * n, h), (e, 2 * i, h))
        self.w2 = self._param((e, h, n), (e, h, i))
        self.w13_bias = self._param((e, 2 * n), (e, 2 * i)) if bias else None
        self.w2_bias = self._param((e, h), (e, h)) if bias else None
        from kvforge.model import quantization

        method = quantization.current()
        self.quant_method = method.moe_method(self) if method is not None else None  # ValueError if unsupported
        if self.quant_method is not None:
            self.quant_method.create_weights(self)

    def _param(self, shape: tuple[int, ...], full: tuple[int, ...]) -> nn.Parameter:
        # full: as one rank holds it unsplit (kvforge.layers.weights.full_shape)
        return set_loader(nn.Parameter(torch.empty(shape), requires_grad=False), self.weight_loader, full)

    # -- loading -----------------------------------------------------------------------------------
    def checkpoint_shards(self, param: nn.Parameter) -> list[ShardId]:
        """The (expert, projection) parts a checkpoint fills ``param`` from, one tensor each (what
        ``kvforge.layers.weight_map.load_weights`` expects to see loaded)."""
        parts = ("w1", "w3") if param is self.w13 or param is self.w13_bias else ("w2",)
        return [(e, part) for e in range(self.num_experts) for part in parts]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """Copy this rank's part of ``loaded`` into ``param`` (see the module docstring for ``shard_id``)."""
        i, s, n = self.intermediate_size, self.start, self.count
        is_w13 = param is self.w13 or param is self.w13_bias
        if shard_id is None:  # the whole parameter, [E, 2I, ...] gate rows then up rows / [E, H, I]
            check_shape("the tensor", loaded, full_shape(param))
            if is_w13:
                param.data.copy_(torch.cat([loaded[:, s:s + n], loaded[:, i + s:i + s + n]], dim=1))
            else:
                param.data.copy_(loaded[:, :, s:s + n] if param is self.w2 else loaded)
            return
        if not isinstance(shard_id, tuple):
            raise ValueError(f"MoE shard {shard_id!r} is not (expert, projection)")
        expert, part = shard_id
        if expert is None:  # a stacked checkpoint tensor (gpt-oss)
            if part == "w13_interleaved":  # [E, H, 2I] weight or [E, 2I] bias, gate/up in even/odd columns
                t = loaded.transpose(1, 2) if loaded.dim() == 3 else loaded
                check_shape("the tensor (as [E, 2I, H])", t, full_shape(param))
                self.weight_loader(param, torch.cat([t[:, 0::2], t[:, 1::2]], dim=1), None)
            elif part == "w2_transposed":  # [E, I, H] weight, or [E, H] bias as is
                t = loaded.transpose(1, 2) if loaded.dim() == 3 else loaded
                self.weight_loader(param, t, None)
            else:
                raise ValueError(f"unknown stacked MoE tensor kind {part!r}")
            return
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range (the layer has {self.num_experts})")
        if part in ("w1", "w3"):  # one expert's gate / up projection, [I, H] (or [I] bias)
            check_shape(f"expert {expert}'s {part}", loaded, (i, *full_shape(param)[2:]))
            rows = slice(0, n) if part == "w1" else slice(n, 2 * n)
            param.data[expert, rows].copy_(loaded[s:s + n])
        elif part == "w2":  # one expert's down projection, [H, I] (or [H] bias)
            check_shape(f"expert {expert}'s w2", loaded, full_shape(param)[1:])
            param.data[expert].copy_(loaded[:, s:s + n] if loaded.dim() == 2 and param is self.w2 else loaded)
        else:
            raise ValueError(f"unknown MoE shard {part!r}: expected 'w1', 'w3' or 'w2'")

    # -- compute -----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H], router_logits [T, E] -> [T, H] (summed over the tensor-parallel ranks)."""
        weights, ids = select_experts(router_logits, self.top_k, self.scoring, self.renormalize, self.round_weights)
        if self.quant_method is not None:
            y = self.quant_method.apply(self, x, weights, ids)
            return self.tp.all_reduce(y) if self.tp.size > 1 else y
        from kvforge.layers.fused_moe import fused_experts

        y = fused_experts(x, self.w13, self.w2, weights, ids, activation=self.activation,
                          w13_bias=self.w13_bias, w2_bias=self.w2_bias if self.tp.rank == 0 else None,
                          swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit)
        return self.tp.all_reduce(y) if self.tp.size > 1 else y


def expert_weight_names(num_experts: int, prefix: str, names: dict[str, str]) -> dict[str, tuple[int, str]]:
    """Checkpoint module name -> (expert, shard) for per-expert checkpoints: ``names`` maps each
    projection's name to "w1" (gate), "w3" (up) or "w2" (down), e.g. ``{"gate_proj": "w1", ...}``;
    keys look like ``f"{prefix}.{expert}.{name}"``."""
    return {f"{prefix}.{e}.{name}": (e, shard) for e in range(num_experts) for name, shard in names.items()}
