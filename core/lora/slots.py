"""``LoRAManager``: one rank's adapters, in host memory and in device slots.

The engine decides which adapters are registered (``add`` / ``remove``, at most ``max_cpu_loras``)
and guarantees that no step runs more than ``max_loras`` of them (the scheduler's budget). This
rank keeps every registered adapter as ready-made slot images (its shard, padded, scaled, pinned
on CUDA), and before each step gives the step's adapters device slots: one already there stays,
a new one takes a free slot or the least recently used slot of an adapter the step does not run.
Loading a slot is a copy queued on the stream, so a step still in flight that reads the old
contents finishes first.
"""
from __future__ import annotations

import collections
import logging
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from kvforge.errors import is_device_error
from kvforge.layers.weights import ShardId
from kvforge.lora.adapter import adapter_modules, load_adapter_tensors, read_adapter_config
from kvforge.lora.layers import LoRAContext, LoRALinear, wrap_model
from kvforge.lora.ops import LoRABatch, group_request_rows, tile_capacity, tile_grouping
from kvforge.lora.request import LoRARequest

logger = logging.getLogger(__name__)


@runtime_checkable
class MapsCheckpointNames(Protocol):
    """A model LoRA can adapt: it maps a checkpoint tensor's name to its parameter and part (the Llama
    family's ``param_for``: ``q_proj.weight`` -> ``qkv_proj.weight``, part ``"q"``)."""

    def param_for(self, name: str, w: torch.Tensor | None = None) -> tuple[str, ShardId]: ...


class LoRAManager:
    def __init__(self, model: nn.Module, *, max_loras: int, max_lora_rank: int, max_tokens: int,
                 num_layers: int, device: torch.device):
        self.model, self.device, self.num_layers = model, device, num_layers
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.ctx = LoRAContext(max_loras=max_loras, max_rank=max_lora_rank, max_parts=3, max_tokens=max_tokens,
                               device=device, dtype=activation_dtype(model))
        self.layers: dict[str, LoRALinear] = wrap_model(model, self.ctx)
        if not self.layers:
            raise ValueError(f"enable_lora: {type(model).__name__} has no projection LoRA can adapt")
        self.images: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}  # id -> layer -> (A, B)
        self.requests: dict[int, LoRARequest] = {}
        self.slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # id -> slot, LRU first
        self.pin = device.type == "cuda" and torch.cuda.is_available()

    # -- registration (the engine's add_lora / remove_lora) ---------------------------------------
    def add(self, request: LoRARequest) -> bool:
        """Read, check and shard an adapter into host memory; False if it is already here.
        ``ValueError`` naming the field for a bad adapter (nothing is kept then); any failure to read or
        fit its files is one, unless it is device-level (``is_device_error``)."""
        if request.lora_int_id in self.images:
            return False
        try:
            images, rank, num_modules = self._read(request.lora_path)
        except ValueError:
            raise
        except Exception as exc:
            if is_device_error(exc):
                raise
            raise ValueError(f"lora_request.lora_path: {request.lora_path!r} cannot be loaded as a LoRA adapter "
                             f"of this model ({type(exc).__name__}: {exc})") from None
        self.images[request.lora_int_id] = images
        self.requests[request.lora_int_id] = request
        logger.info("LoRA adapter %r (id %d, rank %d, %d modules) loaded from %s", request.lora_name,
                    request.lora_int_id, rank, num_modules, request.lora_path)
        return True

    def _read(self, path: str) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], int, int]:
        """(this rank's slot images by wrapped layer, the adapter's rank, its number of modules)."""
        cfg = read_adapter_config(path, self.max_lora_rank)
        modules = adapter_modules(load_adapter_tensors(path), cfg, self.num_layers)
        by_layer: dict[str, dict[ShardId, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, (a, b) in modules.items():
            layer_name, part = self._target(module, a)
            if layer_name is None:  # a layer of another pipeline stage
                continue
            by_layer.setdefault(layer_name, {})[part] = (a, b)
        images = {}
        for name, parts in by_layer.items():
            a_img, b_img = self.layers[name].slot_image(parts)
            images[name] = (a_img.pin_memory(), b_img.pin_memory()) if self.pin else (a_img, b_img)
        return images, cfg.rank, len(modules)

    def _target(self, module: str, a: torch.Tensor) -> tuple[str | None, ShardId]:
        """(wrapped layer name, part id) of a checkpoint module, or (None, None) off this stage."""
        if not isinstance(self.model, MapsCheckpointNames):
            raise ValueError(f"lora_request.lora_path: {type(self.model).__name__} does not map checkpoint names "
                             "to its parameters (param_for), which LoRA needs")
        param, part = self.model.param_for(f"{module}.weight", a)
        layer_name = param.rsplit(".", 1)[0]
        if layer_name in self.layers:
            return layer_name, part
        start, end = getattr(self.model.model, "start", 0), getattr(self.model.model, "end", self.num_layers)
        if not start <= int(module.split(".")[2]) < end:
            return None, None
        raise ValueError(f"lora_request.lora_path: {module}: kvforge cannot adapt this module of "
                         f"{type(self.model).__name__} (it adapts {sorted({n.rsplit('.', 1)[1] for n in self.layers})})")

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (its slot is free for the next); False if it was not here."""
        self.slot_of.pop(lora_int_id, None)
        self.requests.pop(lora_int_id, None)
        return self.images.pop(lora_int_id, None) is not None

    def list(self) -> list[int]:
        return sorted(self.images)

    # -- each step --------------------------------------------------------------------------------
    def _slots_for(self, ids: list[int]) -> dict[int, int]:
        """Device slots of the step's adapters, loading those not resident."""
        wanted = set(ids)
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step runs {len(wanted)} LoRA adapters, more than max_loras={self.max_loras}")
        for lid in ids:
            if lid in self.slot_of:
                self.slot_of.move_to_end(lid)
                continue
            if lid not in self.images:
                raise RuntimeError(f"LoRA adapter id {lid} was not added on this rank")
            used = set(self.slot_of.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:  # the least recently used adapter this step does not run gives up its slot
                victim = next(v for v in self.slot_of if v not in wanted)
                slot = self.slot_of.pop(victim)
            for name, layer in self.layers.items():
                image = self.images[lid].get(name)
                if image is None:
                    layer.lora_a[slot].zero_()
                    layer.lora_b[slot].zero_()
                else:
                    layer.load_slot(slot, image)
            self.slot_of[lid] = slot
        return {lid: self.slot_of[lid] for lid in wanted}

    def prepare(self, lora_ids: np.ndarray | None, query_lens: np.ndarray, num_rows: int, graph: bool) -> None:
        """Group this step's rows by adapter slot (``lora_ids``: one per request, 0 = the base model;
        ``num_rows``: the step's rows, graph padding included). Graph steps always run the LoRA
        kernels (captured), over the grouping copied into the context's static buffers."""
        ctx = self.ctx
        if lora_ids is None or not lora_ids.any():
            ctx.active = graph
            if graph:
                ctx.starts.zero_()
                ctx.tiles.zero_()
            return
        ids = [int(i) for i in np.unique(lora_ids) if i]
        slots = self._slots_for(ids)
        lut = np.full(int(lora_ids.max()) + 1, -1, dtype=np.int64)
        for lid, slot in slots.items():
            lut[lid] = slot
        order, starts = group_request_rows(lut[lora_ids], query_lens, self.max_loras)
        if not graph:
            ctx.grow(num_rows)
        # the whole work list (unused entries zero), so that a graph of any size reads a complete one
        tiles = tile_grouping(starts, ctx.tiles.shape[0])
        # queued behind a step in flight that still reads the buffers (pinned: the CPU does not wait)
        ctx.order[:len(order)].copy_(self._staged(order), non_blocking=True)
        ctx.starts.copy_(self._staged(starts), non_blocking=True)
        ctx.tiles.copy_(self._staged(tiles), non_blocking=True)
        ctx.active = True
        if not graph:
            need = tile_capacity(num_rows, self.max_loras)
            ctx.batch = LoRABatch(ctx.order, ctx.starts, ctx.tiles[:need], self.max_loras, starts)

    def _staged(self, host: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(host)
        return t.pin_memory() if self.pin else t

    def capture_batch(self, num_rows: int) -> None:
        """Before capturing a graph of ``num_rows`` rows: the kernels' grid covers that many rows of
        one slot, and the grouping is read from the static buffers at replay."""
        ctx = self.ctx
        ctx.active = True
        ctx.batch = LoRABatch(ctx.order, ctx.starts, ctx.tiles[:tile_capacity(num_rows, self.max_loras)],
                              self.max_loras, None)


def activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model's projections compute in (their ``params_dtype``; quantized weights may
    be stored in another)."""
    for m in model.modules():
        dtype = getattr(m, "params_dtype", None)
        if isinstance(dtype, torch.dtype):
            return dtype
    return next(model.parameters()).dtype
