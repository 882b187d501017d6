"""Components that do what the built-ins do and count their calls, so tests can see them used."""
from dataclasses import dataclass

import torch

from kvforge.attention import PLAIN_LAYER, as_bytes
from kvforge.drafter import DraftBatch, Drafter, DraftProposal
from kvforge.executor import UniExecutor
from kvforge.kv_connector import KVConnector, TierStore
from kvforge.kv_tier import TierIndex
from kvforge.plugins.attention.torch_backend import TorchAttentionBackend
from kvforge.plugins.scheduling.fcfs import FCFSScheduler
from kvforge.quantization import LinearMethod, MoEMethod, QuantizationMethod
from kvforge.rank.swap import copy_blocks
from kvforge.sampler import LogitsProcessor


class CountingAttention(TorchAttentionBackend):
    name = "dummy_attn"
    forward_calls = 0

    def forward(self, q, k, v, kv_cache, meta, layer=PLAIN_LAYER):
        type(self).forward_calls += 1
        return super().forward(q, k, v, kv_cache, meta, layer)


@dataclass
class CountingOptions:
    label: str = "none"


class CountingScheduler(FCFSScheduler):
    name = "dummy_sched"
    Options = CountingOptions
    schedule_calls = 0
    last_label = None

    def __init__(self, *, label: str = "none", **kwargs):
        super().__init__(**kwargs)
        type(self).last_label = label

    def schedule(self):
        type(self).schedule_calls += 1
        return super().schedule()


class FaultInjector(LogitsProcessor):
    """Fault injection for the reliability tests, chosen by the request's prompt text: ``FAULT:request``
    refuses that request (``ValueError``: it must fail alone, with a 400); ``FAULT:device`` raises what a
    broken GPU raises (the engine must stop, failing every request at once). Otherwise the identity."""

    name = "fault"

    def apply(self, logits, requests):
        for r in requests:
            text = r.prompt or ""
            if "FAULT:device" in text:
                raise RuntimeError("CUDA error: an illegal memory access was encountered (injected by "
                                   "kvforge_dummy_plugin)")
            if "FAULT:request" in text:
                raise ValueError("injected by kvforge_dummy_plugin: this request is refused")
        return logits


@dataclass
class BanOptions:
    ban_token_id: int | None = None  # the token this request never samples
    ban_reason: str = ""  # free text, for tests of a second key

    def __post_init__(self):
        if self.ban_token_id is not None and (not isinstance(self.ban_token_id, int) or isinstance(self.ban_token_id, bool)
                                              or self.ban_token_id < 0):
            raise ValueError(f"ban_token_id must be a token id (an integer >= 0), got {self.ban_token_id!r}")
        if not isinstance(self.ban_reason, str):
            raise ValueError(f"ban_reason must be a string, got {self.ban_reason!r}")


class TokenBan(LogitsProcessor):
    """Bans one token per request, named by the request's ``extra_args`` (``vllm_xargs`` over HTTP)."""

    name = "dummy_ban"
    request_options = BanOptions

    def apply(self, logits, requests):
        for row, r in enumerate(requests):
            token = self.options_of(r).ban_token_id
            if token is not None and token < logits.shape[1]:
                logits[row, token] = float("-inf")
        return logits


@dataclass
class ScriptOptions:
    script_token_ids: list | None = None  # the output, token by token (then the model goes on)

    def __post_init__(self):
        ids = self.script_token_ids
        if ids is not None and (not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids)):
            raise ValueError(f"script_token_ids must be a list of token ids, got {ids!r}")


class Script(LogitsProcessor):
    """Makes a request's output the tokens its ``extra_args`` script: a test-only way to get a fixed model text
    (tool calls, reasoning) out of any model through the real serving path."""

    name = "dummy_script"
    request_options = ScriptOptions

    def apply(self, logits, requests):
        for row, r in enumerate(requests):
            script = self.options_of(r).script_token_ids or []
            n = len(r.output_token_ids)
            if n < len(script):
                token = script[n]
                logits[row] = float("-inf")
                logits[row, token] = 0.0
        return logits


@dataclass
class RepeatOptions:
    times: int = 8  # the most drafts per request

    def __post_init__(self):
        if not isinstance(self.times, int) or self.times < 1:
            raise ValueError(f"times must be an integer >= 1, got {self.times!r}")


class RepeatDrafter(Drafter):
    """Drafts the request's last token again (random tiny models repeat themselves a lot)."""

    name = "dummy_repeat"
    Options = RepeatOptions
    propose_calls = 0

    def __init__(self, *, times: int = 8, **kwargs):
        super().__init__(**kwargs)
        self.times = times

    def propose(self, batch: DraftBatch) -> DraftProposal:
        type(self).propose_calls += 1
        return DraftProposal([[r.all_token_ids[-1]] * min(k, self.times)
                              for r, k in zip(batch.requests, batch.num_draft_tokens)])


@dataclass
class CountingExecutorOptions:
    label: str = "none"


class CountingExecutor(UniExecutor):
    """The in-process executor, counting the steps and control calls that go through it."""

    name = "dummy_counting"
    Options = CountingExecutorOptions
    execute_calls = 0
    rpc_calls: list = []
    last_label = None

    def __init__(self, spec, *, label: str = "none"):
        super().__init__(spec)
        type(self).last_label = label

    def collective_rpc(self, method, *args, **kwargs):
        type(self).rpc_calls.append(method)
        return super().collective_rpc(method, *args, **kwargs)

    def execute_model(self, step, prev_tokens=None, prompt_sink=None):
        type(self).execute_calls += 1
        return super().execute_model(step, prev_tokens, prompt_sink)


class _Int8Linear(LinearMethod):
    def __init__(self, checkpoint=False):
        self.checkpoint = checkpoint  # a "dummy_int8" checkpoint: int8 weight and weight_scale stored

    def create_weights(self, layer):
        if not self.checkpoint:
            layer.materialize_weight()
            return
        # the checkpoint's layout, sliced under tensor parallelism by the layer's own loaders
        layer.weight = layer.make_param((("out", 1), ("in", 1)), torch.int8)
        layer.weight_scale = layer.make_param((("out", 1), 1), torch.float32)

    def process_weights_after_loading(self, layer):
        Int8WeightOnly.processed += 1
        if self.checkpoint:
            return
        w = layer.weight.data.float()
        scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
        layer.weight = torch.nn.Parameter((w / scale).round().clamp(-127, 127).to(torch.int8), requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)

    def apply(self, layer, x):
        Int8WeightOnly.applied += 1
        return (x.float() @ (layer.weight.float() * layer.weight_scale).t()).to(x.dtype)


class _Int8Experts(MoEMethod):
    """An MoE layer's experts in int8, a scale per expert row, quantized once loaded: the contract only
    (the layer's ``w13`` [E, 2I, H] / ``w2`` [E, H, I] load as they are, then are replaced)."""

    def create_weights(self, layer):
        pass  # the model-dtype experts load through the layer's own loaders

    def process_weights_after_loading(self, layer):
        Int8WeightOnly.processed += 1
        for name in ("w13", "w2"):
            w = getattr(layer, name).data.float()
            scale = (w.abs().amax(dim=2, keepdim=True) / 127).clamp(min=1e-12)  # [E, rows, 1]
            setattr(layer, name, torch.nn.Parameter((w / scale).round().to(torch.int8), requires_grad=False))
            setattr(layer, f"{name}_scale", torch.nn.Parameter(scale, requires_grad=False))

    def apply(self, layer, x, topk_weights, topk_ids):
        from kvforge.layers.fused_moe import fused_experts

        Int8WeightOnly.applied += 1
        w13, w2 = layer.w13.float() * layer.w13_scale, layer.w2.float() * layer.w2_scale
        b13 = layer.w13_bias.float() if layer.w13_bias is not None else None
        b2 = layer.w2_bias.float() if layer.w2_bias is not None and layer.tp.rank == 0 else None
        return fused_experts(x.float(), w13, w2, topk_weights, topk_ids, activation=layer.activation,
                             w13_bias=b13, w2_bias=b2, swiglu_alpha=layer.swiglu_alpha,
                             swiglu_limit=layer.swiglu_limit).to(x.dtype)


@dataclass
class Int8Options:
    skip: str = ""  # layers whose class name is this stay in the model dtype


class Int8WeightOnly(QuantizationMethod):
    """Weight-only int8 with a scale per output channel: a format a third-party package adds."""

    name = "dummy_int8"
    checkpoint_formats = ("dummy_int8",)  # config.json quantization_config {"quant_method": "dummy_int8"}
    Options = Int8Options
    processed = 0
    applied = 0

    def __init__(self, *, engine_config=None, model_config=None, skip: str = ""):
        super().__init__(engine_config=engine_config, model_config=model_config)
        self.skip = skip

    def linear_method(self, layer, names):
        return None if type(layer).__name__ == self.skip else _Int8Linear(self.checkpoint_config is not None)

    def moe_method(self, layer):
        if self.checkpoint_config is not None:
            raise ValueError("dummy_int8 checkpoints store no experts; quantize an MoE model on load")
        return None if type(layer).__name__ == self.skip else _Int8Experts()



@dataclass
class CountingTierOptions:
    max_slots: int = 0  # at most this many blocks a rank keeps (0: what gib holds)


class _HostStore(TierStore):
    """A rank's blocks, plain host tensors in the layer cache's layout, read and written one step at a time."""

    def __init__(self, attn, num_layers: int, slots: int):
        self.attn, self.num_layers, self.slots, self.caches = attn, num_layers, slots, []

    def ready(self) -> list:
        if not self.caches:
            shape = self.attn.kv_cache_shape(self.slots)
            self.caches = [torch.zeros(shape, dtype=self.attn.kv_cache_dtype) for _ in range(self.num_layers)]
        return self.caches

    def read(self, layer, keys, like):
        block = like.new_empty((like.shape[0], len(keys), *like.shape[2:]))
        copy_blocks(block, range(len(keys)), as_bytes(self.ready()[layer]), keys)
        return block

    def write(self, layer, keys, src, src_ids):
        copy_blocks(as_bytes(self.ready()[layer]), keys, src, src_ids)


class _CountingIndex(TierIndex):
    def take(self, block_hash: int) -> int:
        CountingTier.loads += 1
        return super().take(block_hash)


class CountingTier(KVConnector):
    """A KV connector written against the contract only: host tensors of its own, a cap on its slots (an
    option), and an index that counts the blocks it loads."""

    name = "dummy_tier"
    medium = "CPU"
    Options = CountingTierOptions
    loads = 0  # blocks loaded, all instances

    def __init__(self, *, config, max_slots: int = 0):
        super().__init__(config=config)
        self.max_slots = max_slots

    def slots(self, bytes_per_block: int) -> int:
        n = int(self.config.kv_offload_cpu_gib * (1 << 30)) // bytes_per_block
        return min(n, self.max_slots) if self.max_slots else n

    def store(self, attn, num_layers: int, slots: int, rank: int) -> _HostStore:
        return _HostStore(attn, num_layers, slots)

    def index(self, slots: int) -> TierIndex:
        return _CountingIndex(slots, medium=self.medium)
