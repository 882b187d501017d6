"""Llama-family causal LM (Llama 2/3, Mistral, Qwen2, Qwen3) over a flat varlen batch and a paged KV cache.

The numerics follow Hugging Face's implementation (RMSNorm in float32, neox-style RoPE from a float32
cos/sin cache, residual adds in the model dtype) so that logits match ``transformers`` to float noise.
Q/K/V and gate/up projections are fused; :data:`LLAMA_WEIGHTS` says where each checkpoint tensor goes
(``kvforge.layers.weight_map``). The layers are ``kvforge.layers``' parallel ones, which own their
weight loading and split themselves over the tensor-parallel group the model is built in: this
file never branches on tensor parallelism.

The family's config rules are here too (:meth:`LlamaForCausalLM.config_from_hf`): Qwen2's q/k/v biases,
Qwen3's q/k norms, Qwen's window that is off unless ``use_sliding_window``; and its GGUF architectures
and presets (``LlamaForCausalLM.family``). Other families subclass these classes where they compute
differently and replace the data where they only name things differently.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from kvforge.attention import AttentionBackend, AttentionMetadata
from kvforge.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from kvforge.layers.rotary import RotaryCache
from kvforge.layers.vocab import vocab_parallel_logits
from kvforge.layers.weight_map import WeightMap
from kvforge.layers.weight_map import load_weights as load_mapped_weights
from kvforge.layers.weights import ShardId
from kvforge.model.config import FULL, SLIDING, ConfigFields, GGUFArchitecture, HFConfig, ModelConfig, windowed_layers
from kvforge.model.hidden_capture import HiddenStateCapture
from kvforge.model.interface import ModelCapabilities, ModelFamily
from kvforge.plugins.models import fused_ops
from kvforge.rank import parallel_state

#: where a Llama-shaped checkpoint's tensors go: Q/K/V and gate/up fused (as shards "q"/"k"/"v" and 0/1),
#: an MoE layer's experts by their HF projection names (what the MoE families start from)
LLAMA_WEIGHTS = WeightMap(
    fused={"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)},
    expert_projections={"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
)
#: ``rope(q, k) -> (q, k)`` for one forward's tokens (:meth:`RotaryEmbedding.bind`)
Rope = Callable[[torch.Tensor, torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)`` (float32 statistics, cast back before the weight multiply, as HF does); with
        ``residual``: adds ``x`` into it in place and returns ``(norm(residual), residual)``."""
        return fused_ops.rms_norm(x, self.weight, self.eps, residual)


class RotaryEmbedding(RotaryCache):
    """Neox-style RoPE (rotate_half) from the config's cos/sin cache (``kvforge.layers.rotary``), over the
    first ``rotary_dim`` dims of each head: the fused kernel where it runs, torch ops otherwise."""

    def bind(self, positions: torch.Tensor, like: torch.Tensor, meta: AttentionMetadata) -> Rope:
        """``rope(q, k)`` for this forward's tokens: the cache rows are gathered once and shared by every
        layer (torch path), or read by the fused kernel."""
        index = self.rows(positions, meta)
        tables = None
        if not (fused_ops.use_fused(like) and self.rot_dim == self.head_dim):
            tables = fused_ops.rope_tables(index, self.cos, self.sin, like.dtype)
        return functools.partial(self.forward, index, tables=tables)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] cache rows; q: [T, heads, head_dim]; k: [T, kv_heads, head_dim] (rotated in place when fused)
        if tables is None:
            return fused_ops.rope(positions, q, k, self.cos, self.sin)
        if self.rot_dim == self.head_dim:
            return fused_ops.rope_with_tables(q, k, *tables)
        r = self.rot_dim
        q_rot, k_rot = fused_ops.rope_with_tables(q[..., :r], k[..., :r], *tables)
        return torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, attn: AttentionBackend, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn = attn  # shared by all layers; not a module
        hd = self.head_dim = config.head_dim
        # rows: q | k | v of this rank's heads (kvforge.rank.parallel_state.head_shard)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, hd, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        shard = self.qkv_proj.shard
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.q_size = self.num_heads * hd
        self.kv_size = self.num_kv_heads * hd
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, config.hidden_size,
                                        bias=config.attention_out_bias, input_part=(shard.q_start * hd, self.q_size))
        self.q_norm = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None
        self.attn_layer = attn.layer(layer_idx, sliding_window=config.window_of(layer_idx))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, rope: Rope,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``rope(q, k)``: :meth:`RotaryEmbedding.bind` for this forward's tokens."""
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)  # [T, heads, head_dim]
        k = k.reshape(n, self.num_kv_heads, self.head_dim)  # [T, kv_heads, head_dim]
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = fused_ops.qk_rms_norm(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        q, k = rope(q, k)
        o = self.attn.forward(q, k, v, kv_cache, meta, self.attn_layer)  # [T, heads, head_dim]
        return self.o_proj(o.reshape(n, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        # rows: gate | up (this rank's part of each)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter] * 2)
        self.down_proj = RowParallelLinear(inter, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused_ops.silu_and_mul(self.gate_up_proj(x)))  # gate_up: [T, 2 * intermediate]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention then MLP. Subclasses override :attr:`attention_cls` and :meth:`make_mlp`."""

    attention_cls: type[nn.Module] = LlamaAttention

    def __init__(self, config: ModelConfig, attn: AttentionBackend, layer_idx: int):
        super().__init__()
        self.self_attn = self.attention_cls(config, attn, layer_idx)
        self.mlp = self.make_mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                rope: Rope, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried separately so that each residual add is fused into the next
        norm: returns (this layer's MLP output, the residual stream before it is added)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, rope, kv_cache, meta)
        hidden, stream = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), stream

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return LlamaMLP(config)


class LlamaModel(nn.Module):
    """The decoder stack, or one pipeline stage of it (``parallel_state.current_stage()``): the first
    stage embeds, the last one norms; layers outside the stage are ``MissingLayer``s, so parameter
    names keep their global layer index."""

    layer_cls: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, attn: AttentionBackend):
        super().__init__()
        stage = parallel_state.current_stage()
        self.config = config
        self.start, self.end = stage.layers(config.num_hidden_layers)
        self.is_first, self.is_last = stage.is_first, stage.is_last
        # the last stage of a tied model computes its logits with the embedding
        wants_embed = stage.is_first or (stage.is_last and config.tie_word_embeddings)
        self.embed_tokens: VocabParallelEmbedding | None = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size) if wants_embed else None)
        self.layers = nn.ModuleList(self.layer_cls(config, attn, i) if self.start <= i < self.end else MissingLayer()
                                    for i in range(config.num_hidden_layers))
        self.norm: nn.Module | None = RMSNorm(config.hidden_size, config.rms_norm_eps) if stage.is_last else None
        self.rotary_emb = RotaryEmbedding(config)
        #: the layers' hidden states each forward writes (``LlamaForCausalLM.capture_hidden_states``)
        self.capture: HiddenStateCapture | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_meta: AttentionMetadata, intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``kv_caches[i]`` is the cache of this stage's i-th layer. The first stage embeds
        ``input_ids`` (or takes ``inputs_embeds``: a multimodal model's, images merged in); a later one
        continues from ``intermediate`` = (hidden, residual) of the stage before. The last stage returns
        the normed hidden states, the others (hidden, residual)."""
        if self.is_first:
            hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds  # [T, hidden]
            residual = None
        elif intermediate is None:
            raise ValueError("a pipeline stage after the first needs the previous stage's (hidden, residual)")
        else:
            hidden, residual = intermediate
        rope = self.rotary_emb.bind(positions, hidden, attn_meta)
        capture = self.capture
        for i in range(self.start, self.end):
            if capture is not None:  # the stream entering layer i (transformers' hidden_states[i])
                capture.record(i, hidden, residual)
            hidden, residual = self.layers[i](positions, hidden, residual, rope, kv_caches[i - self.start], attn_meta)
        if not self.is_last:  # (a stage without layers hands on a zero residual)
            return hidden, residual if residual is not None else torch.zeros_like(hidden)
        if self.norm is None:
            raise RuntimeError("the last pipeline stage holds the final norm")
        out = self.norm(hidden, residual)[0]
        if capture is not None:
            capture.record_final(out)
        return out

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's input embeddings (a family that scales them overrides this)."""
        if self.embed_tokens is None:
            raise RuntimeError("embed runs on the first pipeline stage, which holds the embeddings")
        return self.embed_tokens(input_ids)


class MissingLayer(nn.Identity):
    """A layer another pipeline stage holds."""


# -- the family's configs -------------------------------------------------------------------------
def require_silu(hf: HFConfig) -> None:
    """``ValueError`` unless the MLP is silu(gate) * up (the activation these families' MLPs compute)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json field 'hidden_act' is {hf['hidden_act']!r}; only 'silu' is supported")


def qwen_windows(fields: ConfigFields, hf: HFConfig, sliding: Optional[Callable[[int, int], bool]]) -> None:
    """Qwen configs carry a window that is off unless ``use_sliding_window``; with it on and no
    ``layer_types``, ``sliding(layer, max_window_layers)`` says which layers use it as transformers
    does (None: every layer)."""
    if not hf.get("use_sliding_window", False):
        fields["sliding_window"] = fields["layer_types"] = None
        return
    window = fields.get("sliding_window")
    if sliding is None or window is None or hf.get("layer_types"):
        return
    limit = int(hf.get("max_window_layers", 28))
    types = [SLIDING if sliding(i, limit) else FULL for i in range(fields["num_hidden_layers"])]
    fields["layer_types"] = windowed_layers(types, window)


#: named dummy architectures matching the real checkpoints (``dummy:<name>``)
LLAMA_PRESETS: dict[str, ModelConfig] = {
    "llama-3-8b": ModelConfig(
        architecture="LlamaForCausalLM", model_type="llama", vocab_size=128256, bos_token_id=128000,
        eos_token_ids=[128001], hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=8192, tie_word_embeddings=False, torch_dtype="bfloat16"),
    "llama-3-70b": ModelConfig(
        architecture="LlamaForCausalLM", model_type="llama", vocab_size=128256, bos_token_id=128000,
        eos_token_ids=[128001], hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=8192, tie_word_embeddings=False, torch_dtype="bfloat16"),
    "llama-3.2-1b": ModelConfig(
        architecture="LlamaForCausalLM", model_type="llama", vocab_size=128256, bos_token_id=128000,
        eos_token_ids=[128001], hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        tie_word_embeddings=True, torch_dtype="bfloat16"),
    "smollm2-135m": ModelConfig(
        architecture="LlamaForCausalLM", model_type="llama", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=[2], torch_dtype="bfloat16"),
    "tiny": ModelConfig(
        architecture="LlamaForCausalLM", model_type="llama", vocab_size=49152, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=[2], torch_dtype="float32"),
}


class LlamaForCausalLM(nn.Module):
    """The model plugin for LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM;
    the base of the other families' (they swap :attr:`model_cls` / its ``layer_cls``, and their data:
    :attr:`weight_map`, :attr:`family`, :attr:`config_class`)."""

    model_cls: type[LlamaModel] = LlamaModel
    #: where each checkpoint tensor goes (``kvforge.layers.weight_map``)
    weight_map: WeightMap = LLAMA_WEIGHTS
    #: the configs it reads (``kvforge.model.interface.ModelFamily``)
    family = ModelFamily(
        model_types={"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "qwen3": "Qwen3ForCausalLM"},
        # llama.cpp stores Mistral as "llama" and permutes its Q/K rows (its LlamaModel converter)
        gguf_architectures={"llama": GGUFArchitecture("llama", permuted_qk=True), "qwen2": GGUFArchitecture("qwen2"),
                            "qwen3": GGUFArchitecture("qwen3")},
        presets=LLAMA_PRESETS,
    )
    config_class: type[ModelConfig] = ModelConfig
    capabilities = ModelCapabilities(sliding_window=True, notes="Llama 2/3, Mistral, Qwen2, Qwen3")

    def __init__(self, config: ModelConfig, attn: AttentionBackend):
        super().__init__()
        self.config = config
        self.attn = attn  # shared by all layers; receives the checkpoint's KV-cache scales
        self.model = self.model_cls(config, attn)
        # tied: logits use embed_tokens.weight and the checkpoint's lm_head.weight (if any) is skipped
        last = parallel_state.current_stage().is_last
        self.lm_head = (ParallelLMHead(config.vocab_size, config.hidden_size)
                        if last and not config.tie_word_embeddings else None)

    @classmethod
    def config_from_hf(cls, fields: ConfigFields, hf: HFConfig) -> ModelConfig:
        """The family's rules over the general fields: an MLP of silu; Qwen2's q/k/v biases (never on
        o_proj, nor Mistral's); Qwen3's q/k norms; Qwen's window, off unless ``use_sliding_window`` and
        then from ``max_window_layers`` on."""
        model_type = fields["model_type"]
        if model_type in cls.family.model_types:
            require_silu(hf)
        if model_type == "qwen2":
            fields["attention_bias"], fields["attention_out_bias"] = True, False
        elif model_type == "mistral":
            fields["attention_out_bias"] = False
        elif model_type == "qwen3":
            fields["qk_norm"] = True
        if model_type in ("qwen2", "qwen3"):
            qwen_windows(fields, hf, lambda layer, limit: layer >= limit)
        return cls.config_class(**fields)

    @property
    def packed_modules_mapping(self) -> dict[str, list[str]]:
        """Fused module -> the checkpoint modules it holds (quantization formats name those)."""
        return self.weight_map.packed_modules()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_meta: AttentionMetadata, intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions: [num_tokens] int64 (flat varlen batch) -> hidden [num_tokens, hidden_size]
        (a pipeline stage other than the last: (hidden, residual) for the next one). ``inputs_embeds``:
        the first stage's input embeddings instead of ``input_ids``' (a multimodal model's, images merged)."""
        return self.model(input_ids, positions, kv_caches, attn_meta, intermediate, inputs_embeds)

    def capture_hidden_states(self, capture: HiddenStateCapture | None) -> None:
        """From now on every forward writes ``capture``'s layers' hidden states of its tokens into
        ``capture.buffer`` (``kvforge.model.hidden_capture``: ids as transformers' ``output_hidden_states``);
        None stops. Every family built on this class inherits it (their stacks are ``LlamaModel``s)."""
        self.model.capture = capture

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> float32 logits [n, vocab_size] (on every tensor-parallel rank)."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        if head is None:
            raise RuntimeError("compute_logits runs on the last pipeline stage, which holds the LM head")
        return vocab_parallel_logits(hidden, head)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into the (fused) parameters as :attr:`weight_map` says; ValueError
        on an unknown name, a shape mismatch, or parameters left unfilled."""
        load_mapped_weights(self, weights, self.weight_map, holds=self.holds, kv_scales=self.attn)

    def param_for(self, name: str, w: torch.Tensor | None = None) -> tuple[str, ShardId]:
        """(parameter name, shard id) that the checkpoint tensor ``name`` loads into (LoRA adapters name
        modules the same way)."""
        return self.weight_map.target(name)

    def holds(self, name: str) -> bool:
        """Whether this model holds the checkpoint tensor ``name``: its pipeline stage's layers, the
        embeddings and final norm where this stage has them, the LM head unless tied or elsewhere."""
        m = self.model
        if name == "lm_head.weight":
            return self.lm_head is not None
        if name.startswith("model.layers."):
            return m.start <= int(name.split(".")[2]) < m.end
        if name.startswith("model.embed_tokens."):
            return m.embed_tokens is not None
        if name.startswith("model.norm."):
            return m.norm is not None
        return True
