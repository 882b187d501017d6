"""``EngineConfig``: every engine option in one dataclass, checked on creation; config files.

Precedence: dataclass defaults < config file (TOML or YAML) < keyword arguments / CLI flags.
A config file holds engine options at its top level and one ``[plugins.<name>]`` table per plugin
component whose options it sets::

    model = "dummy:tiny"   # or an HF directory, a .gguf file, a hub id; leave it out for the default model
    attention_backend = "torch"
    scheduler = "fcfs"
    max_num_batched_tokens = 4096

    [plugins.fcfs]
    long_prefill_token_threshold = 512

``examples/kvforge.toml`` is a complete file that runs as is.
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
from dataclasses import dataclass, field, fields
from typing import Any

import torch

_DTYPES = {"auto": None, "float32": torch.float32, "float": torch.float32, "float16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16}
#: ``kv_cache_dtype`` values -> the KV cache's element type (None: the model dtype); ``fp8_e4m3`` is
#: vLLM's alias of ``fp8``
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass
class EngineConfig:
    """Engine options (names as vLLM's where the meaning is the same).

    model: HF directory, ``.gguf`` file, hub id, ``dummy:<preset>``, or None for the default model.
    tokenizer: tokenizer path if not the model's own.
    load_format: ``auto``, ``safetensors``, ``gguf`` or ``dummy`` (random weights of the model's shape).
    dtype: ``auto`` (float32 on CPU, bfloat16 on CUDA), ``float32``, ``float16``, ``bfloat16``.
    device: ``auto`` (CUDA if available), ``cpu`` or ``cuda[:N]``.
    seed: seed of dummy weights and of unseeded sampling.
    max_model_len: context length (prompt + output); default the model's, capped by the KV pool.
    block_size: tokens per KV-cache block.
    gpu_memory_utilization: fraction of GPU memory the engine may use in total (CUDA).
    kv_cache_memory_gib: KV pool size on CPU in GiB (CUDA: overrides the profiled size).
    num_gpu_blocks_override: exact number of KV blocks (any device); wins over the two above.
    swap_space: GiB of host memory for KV blocks of requests preempted by swapping (a scheduler
        option such as ``priority``'s ``preemption_mode = "swap"``); allocated on the first swap,
        pinned on CUDA. 0 disables swapping (preemption recomputes).
    kv_offload_cpu_gib: GiB of host memory per rank for prefix-cached KV blocks the device pool reuses
        (a tier beyond the GPU: a later request with the same prefix loads them instead of computing
        them; docs/kv_cache.md); allocated on first use, pinned on CUDA. 0: off. Needs prefix caching.
    kv_connector: the tier those blocks go to, a registered ``kv_connector`` plugin (None: ``cpu`` when
        ``kv_offload_cpu_gib`` is set, else none); it reads its options in this config and its
        ``[plugins.<name>]`` table.
    kv_offload_dir: a directory for prefix-cached KV blocks on disk (the built-in ``disk`` tier: one file
        per block and rank, kept across restarts of the engine); with a host tier it sits behind it (the
        host tier's evictions go to disk), alone it is the only tier. None: no disk tier.
    kv_offload_disk_gib: GiB of disk per rank the ``disk`` tier may fill (its least recently used blocks go).
    enable_kv_events: record which prefix-cached blocks each tier stores and removes (``kvforge.kv_events``,
        vLLM's event shape), readable at the server's ``GET /kv_events``; off: the KV manager records nothing.
    kv_events_endpoint: also publish them on a ZMQ PUB socket bound there (``tcp://127.0.0.1:5557``);
        setting it turns ``enable_kv_events`` on. None: no socket.
    max_num_seqs: most requests running in one step (``LLM`` on a GPU of 70 GiB or more: 1024 unless
        set, as vLLM's offline default there; see :data:`LARGE_GPU_OFFLINE`).
    max_num_batched_tokens: token budget of one step (prompt chunks + decode tokens; ``LLM`` on a GPU
        of 70 GiB or more: 16384 unless set).
    enable_prefix_caching: reuse KV blocks of identical prompt prefixes.
    max_logprobs: the most ``logprobs`` / ``prompt_logprobs`` a request may ask for.
    max_n: the most samples (``n``) one request may ask for (also capped by ``max_num_seqs``).
    grammar_compile_timeout: seconds a structured-output constraint may take to compile; a request
        whose constraint takes longer fails alone (HTTP 400), and the same constraint fails at once later.
    grammar_cache_size: compiled structured-output constraints kept for reuse (least recently used go).
    enforce_eager: never use CUDA graphs (by default decode-only steps replay graphs captured at
        batch sizes 1, 2, 4, 8, 16, 24, ... up to ``max_num_seqs``, when the attention backend allows,
        and mixed steps replay piecewise graphs: see ``max_piecewise_graph_tokens``).
    max_piecewise_graph_tokens: the largest step carrying prompt tokens that replays piecewise CUDA
        graphs (everything but attention captured per token bucket, attention eager between the pieces;
        docs/model_runner.md); larger steps run eagerly. None (the default): 2048 (at most
        ``max_num_batched_tokens``) for one rank without LoRA, else 0; 0: off. Pipeline stages and
        LoRA keep mixed steps eager whatever it says.
    async_scheduling: schedule and lay out the next step while the GPU runs the current one (the
        next step's tokens come from the device). None (the default): on for CUDA, off on the CPU,
        where torch runs every op in the calling thread and nothing could overlap; True forces it
        on (tests use that on the CPU). A step whose requests need their sampled tokens
        on the host first (structured outputs, penalties, bad words, min_tokens, logits processors,
        n > 1 before the fork, beam search) is waited for before the next one is scheduled.
    attention_backend / scheduler / sampler / kv_cache_manager: plugin names.
    speculative_config: speculative decoding, vLLM's keys: ``{"method": "ngram",
        "num_speculative_tokens": 4, ...}`` (a ``[speculative]`` table in a config file); ``method``
        names a registered drafter, the other keys are described in docs/speculative.md. None: off.
    tensor_parallel_size: ranks each layer is split over (attention heads, MLP columns, vocabulary).
    pipeline_parallel_size: pipeline stages the layers are split into.
    distributed_executor_backend: how the engine reaches its ranks, a registered executor: ``uni``
        (one rank, in process), ``mp`` (processes spawned on this node), ``ray`` (Ray actors, across
        nodes). None (the default): ``uni`` for one rank, ``ray`` when a Ray cluster is running or the
        ranks outnumber this node's GPUs, else ``mp`` (docs/distributed.md).
    disable_custom_all_reduce: send every tensor-parallel all-reduce to NCCL (by default, on CUDA,
        messages of at most 4 MiB go over the GPUs' peer memory: ``kvforge.rank.peer_all_reduce``).
    quantization: a registered quantization method for the linear layers (built in: ``fp8`` and
        ``int4`` quantize on load; ``fp8``, ``awq``, ``gptq`` and ``compressed-tensors`` load
        pre-quantized checkpoints); None: the method that loads the checkpoint's
        ``quantization_config``, else the model dtype (docs/quantization.md).
    kv_cache_dtype: ``auto`` (the model dtype) or ``fp8`` (alias ``fp8_e4m3``): K/V stored as FP8 e4m3
        with a float32 scale per layer for K and one for V (from the checkpoint, else 1.0), half the
        bytes of a bf16 cache, so twice the blocks in the same memory (docs/quantization.md#fp8-kv-cache).
    enable_lora: serve LoRA adapters (``LoRARequest``) next to the base model (docs/lora.md).
    max_loras: the most adapters one step may run (device slots for adapter weights; the scheduler
        admits no request whose adapter would make more).
    max_lora_rank: the largest adapter rank accepted (the slots are sized for it).
    max_cpu_loras: adapters kept in host memory for quick return to a slot (least recently used go);
        None: ``max_loras``.
    limit_mm_per_prompt: a multimodal model's items per prompt, by modality (``{"image": 2}``); a
        modality left out: at most 1 (docs/multimodal.md). A text-only model ignores it.
    plugins: ``{component name: {option: value}}`` validated by each component's ``Options``.
    """

    model: str | None = None
    tokenizer: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_gib: float | None = None
    num_gpu_blocks_override: int | None = None
    swap_space: float = 4.0
    kv_offload_cpu_gib: float = 0.0
    kv_connector: str | None = None
    kv_offload_dir: str | None = None
    kv_offload_disk_gib: float = 16.0
    enable_kv_events: bool = False
    kv_events_endpoint: str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    max_n: int = 128
    grammar_compile_timeout: float = 10.0
    grammar_cache_size: int = 256
    enforce_eager: bool = False
    max_piecewise_graph_tokens: int | None = None
    async_scheduling: bool | None = None
    attention_backend: str = "auto"
    scheduler: str = "fcfs"
    sampler: str = "default"
    kv_cache_manager: str = "paged"
    trust_remote_code: bool = False
    speculative_config: dict[str, Any] | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    disable_custom_all_reduce: bool = False
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    limit_mm_per_prompt: dict[str, int] | None = None
    plugins: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def positive_int(name: str, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")

        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_logprobs", "max_n",
                     "grammar_cache_size", "tensor_parallel_size", "pipeline_parallel_size", "max_loras",
                     "max_lora_rank"):
            positive_int(name)
        positive_int("max_cpu_loras", allow_none=True)
        pw = self.max_piecewise_graph_tokens
        if pw is not None and (not isinstance(pw, int) or isinstance(pw, bool) or pw < 0):
            raise ValueError(f"max_piecewise_graph_tokens must be an integer >= 0 (0: off), got {pw!r}")
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be true or false, got {self.enable_lora!r}")
        limits = self.limit_mm_per_prompt
        if limits is not None and not (isinstance(limits, dict) and all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for k, v in limits.items())):
            raise ValueError(f"limit_mm_per_prompt must map modality names to integers >= 0, got {limits!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.distributed_executor_backend is not None and not isinstance(self.distributed_executor_backend, str):
            raise ValueError(f"distributed_executor_backend must be an executor name, got "
                             f"{self.distributed_executor_backend!r}")
        positive_int("max_model_len", allow_none=True)
        positive_int("num_gpu_blocks_override", allow_none=True)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(f"load_format must be one of auto, safetensors, gguf, dummy; got {self.load_format!r}")
        def number(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not number(self.gpu_memory_utilization) or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_cache_memory_gib is not None and (not number(self.kv_cache_memory_gib)
                                                     or not self.kv_cache_memory_gib > 0):
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib!r}")
        if not number(self.grammar_compile_timeout) or not 0 < self.grammar_compile_timeout < float("inf"):
            raise ValueError(f"grammar_compile_timeout must be a number of seconds > 0, got {self.grammar_compile_timeout!r}")
        if not number(self.swap_space) or not 0 <= self.swap_space < float("inf"):
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}")
        if not number(self.kv_offload_cpu_gib) or not 0 <= self.kv_offload_cpu_gib < float("inf"):
            raise ValueError(f"kv_offload_cpu_gib must be a number of GiB >= 0, got {self.kv_offload_cpu_gib!r}")
        if self.kv_connector is not None and (not isinstance(self.kv_connector, str) or not self.kv_connector):
            raise ValueError(f"kv_connector must be a connector's name or None, got {self.kv_connector!r}")
        if isinstance(self.kv_offload_dir, os.PathLike):
            self.kv_offload_dir = os.fspath(self.kv_offload_dir)
        if self.kv_offload_dir is not None and (not isinstance(self.kv_offload_dir, str) or not self.kv_offload_dir):
            raise ValueError(f"kv_offload_dir must be a directory's path or None, got {self.kv_offload_dir!r}")
        if not number(self.kv_offload_disk_gib) or not 0 < self.kv_offload_disk_gib < float("inf"):
            raise ValueError(f"kv_offload_disk_gib must be a number of GiB > 0, got {self.kv_offload_disk_gib!r}")
        if not isinstance(self.enable_kv_events, bool):
            raise ValueError(f"enable_kv_events must be true or false, got {self.enable_kv_events!r}")
        if self.kv_events_endpoint is not None:
            from kvforge.kv_event_publisher import ENDPOINT
            if not isinstance(self.kv_events_endpoint, str) or not ENDPOINT.fullmatch(self.kv_events_endpoint):
                raise ValueError(f"kv_events_endpoint must be a ZMQ endpoint such as tcp://127.0.0.1:5557 "
                                 f"(tcp, ipc or inproc), got {self.kv_events_endpoint!r}")
            self.enable_kv_events = True
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be true, false or unset, got {self.async_scheduling!r}")
        if not isinstance(self.disable_custom_all_reduce, bool):
            raise ValueError(f"disable_custom_all_reduce must be true or false, got {self.disable_custom_all_reduce!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.speculative_config is not None:
            from kvforge.spec_decode.policy import SpeculativeConfig
            SpeculativeConfig.from_dict(self.speculative_config)
        if not isinstance(self.plugins, dict) or not all(isinstance(v, dict) for v in self.plugins.values()):
            raise ValueError("plugins must map component names to option tables")

    # -- resolved values -------------------------------------------------------------------------
    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = _DTYPES[self.dtype]
        if dtype is None:
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return dtype

    @property
    def torch_kv_cache_dtype(self) -> torch.dtype:
        """The KV cache's element type: the model dtype for ``auto``."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def create(cls, config: str | os.PathLike | None = None, *, offline: bool = False,
               **overrides: Any) -> "EngineConfig":
        """Defaults, then the config file (if any), then ``overrides`` (None values are ignored).
        ``offline`` (``LLM``): where neither sets ``max_num_seqs`` / ``max_num_batched_tokens``, a GPU of
        70 GiB or more gets vLLM's offline defaults (:func:`offline_scheduling_defaults`)."""
        values: dict[str, Any] = load_config_file(config) if config is not None else {}
        if "speculative" in values:  # the config file's [speculative] table
            values["speculative_config"] = values.pop("speculative")
        plugins = dict(values.pop("plugins", {}) or {})
        for key, table in (overrides.pop("plugins", None) or {}).items():
            plugins[key] = {**plugins.get(key, {}), **table}
        values.update({k: v for k, v in overrides.items() if v is not None})
        if offline:
            for key, value in offline_scheduling_defaults(values.get("device", "auto")).items():
                values.setdefault(key, value)
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - valid)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; valid options: {sorted(valid - {'plugins'})}")
        return cls(**values, plugins=plugins)

    def piecewise_graph_tokens(self) -> int:
        """The largest mixed step that replays piecewise graphs (``max_piecewise_graph_tokens``
        resolved: its default for one rank without LoRA, never more than a step's budget; 0: none)."""
        pw = self.max_piecewise_graph_tokens
        if pw is None:
            one_rank = self.tensor_parallel_size * self.pipeline_parallel_size == 1
            pw = PIECEWISE_DEFAULT_TOKENS if one_rank and not self.enable_lora else 0
        if self.pipeline_parallel_size > 1 or self.enable_lora:
            return 0
        return min(pw, self.max_num_batched_tokens)

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


#: the offline engine's scheduling limits on a GPU of at least 70 GiB other than an A100, as vLLM's
#: ``LLM`` sets them there (its ``EngineArgs`` defaults by device memory): up to 1,024 running requests
#: and 16,384 tokens a step, so that a large offline batch of mixed lengths stays in flight whole and its
#: prompts are taken in half as many steps. Smaller GPUs, the CPU and the server keep the dataclass's
#: 256 and 8,192 (vLLM's server uses 8,192 tokens on these GPUs too).
#: ``max_piecewise_graph_tokens``'s default (a NOTE in ``kvforge.rank.piecewise_graphs`` says why)
PIECEWISE_DEFAULT_TOKENS = 2048
LARGE_GPU_OFFLINE = {"max_num_seqs": 1024, "max_num_batched_tokens": 16384}
LARGE_GPU_BYTES = 70 * 2**30


def offline_scheduling_defaults(device: object = "auto") -> dict[str, int]:
    """:data:`LARGE_GPU_OFFLINE` when ``device`` resolves to a CUDA GPU of 70 GiB or more (not an A100),
    else nothing."""
    if not isinstance(device, str) or device == "cpu" or not torch.cuda.is_available():
        return {}
    index = int(device.split(":", 1)[1]) if device.startswith("cuda:") else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        return {}  # EngineConfig's checks name the bad device
    props = torch.cuda.get_device_properties(index)
    if props.total_memory >= LARGE_GPU_BYTES and "A100" not in props.name:
        return dict(LARGE_GPU_OFFLINE)
    return {}


def load_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a TOML (``.toml``) or YAML (``.yaml``/``.yml``) config file into a dict."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"config file {path!r} does not exist")
    if path.endswith(".toml"):
        if sys.version_info >= (3, 11):
            import tomllib
        else:
            import tomli as tomllib
        with open(path, "rb") as f:
            data = tomllib.load(f)
    elif path.endswith((".yaml", ".yml")):
        import yaml
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    else:
        raise ValueError(f"config file {path!r}: use a .toml, .yaml or .yml file")
    if not isinstance(data, dict):
        raise ValueError(f"config file {path!r} must hold a table/mapping at its top level")
    return data


def build_options(cls: type, name: str, table: dict[str, Any]) -> dict[str, Any]:
    """Validate ``table`` against the component's ``Options`` dataclass; return keyword arguments."""
    options_cls = getattr(cls, "Options", None)
    if options_cls is None:
        if table:
            raise ValueError(f"plugin component {name!r} takes no options, got {sorted(table)}")
        return {}
    valid = [f.name for f in fields(options_cls)]
    unknown = sorted(set(table) - set(valid))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for {name!r}; valid options: {valid}")
    return dataclasses.asdict(options_cls(**table))
