"""The peer engines: transformers ``generate`` (static batches) and continuous batching (``generate_batch``).

Both run the kvforge workload in the same process, after kvforge's engine is freed, on the same
device and dtype. Dummy models become a transformers model of the same config with random weights
(``AutoConfig.for_model`` of ``ModelConfig.to_hf_dict()``, seeded; not kvforge's random values, which
does not matter with EOS ignored); real models load the same weights (GGUF via ``gguf_file=``, HF
directories directly). A peer that fails returns a row with ``error`` instead of raising.
"""
from __future__ import annotations

import dataclasses
import gc
import inspect
import os
import time
from typing import Any

import torch

from kvforge.bench.metrics import summarize
from kvforge.bench.workloads import BenchRequest


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_hf_model(source: Any, mc: Any, device: torch.device, dtype: torch.dtype, seed: int) -> Any:
    """The transformers model for a kvforge ``ModelSource`` on ``device`` in ``dtype``, in eval mode."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.logging.set_verbosity_error()  # generation-config warnings would drown the table
    if source.kind == "dummy":
        d = mc.to_hf_dict()
        d.pop("architectures", None)
        if (d.get("rope_scaling") or {}).get("rope_type") == "freq_factors":  # kvforge's GGUF-only form
            d["rope_scaling"] = None
        cfg = AutoConfig.for_model(d.pop("model_type"), **d)
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    elif source.kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(source.path)),
                                                     gguf_file=os.path.basename(source.path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
    return model.to(device).eval()


def run_peer(name: str, source: Any, mc: Any, workload: list[BenchRequest], device: torch.device,
             dtype: torch.dtype, seed: int, hf_batch_size: int) -> dict:
    """One row for peer ``name`` (one of ``kvforge.bench.PEERS``); ``error`` set if it could not run."""
    label = {"hf-generate": f"transformers generate (batch {hf_batch_size})",
             "hf-continuous": "transformers generate_batch"}[name]
    model = None
    try:
        model = load_hf_model(source, mc, device, dtype, seed)
        if name == "hf-generate":
            row = run_hf_generate(model, workload, device, hf_batch_size)
        else:
            row = run_hf_continuous(model, workload, device)
    except Exception as exc:  # a peer's failure is a result to report, not a reason to lose ours
        row = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        del model
        free_memory()
    import transformers
    return {"engine": label, "transformers": transformers.__version__} | row


def _left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # ids, mask: [batch, longest prompt]; prompts right-aligned so that generation continues each one
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def run_hf_generate(model: Any, workload: list[BenchRequest], device: torch.device, batch_size: int) -> dict:
    """Greedy ``generate`` in static batches of ``batch_size`` in workload order.

    Every sequence of a batch generates the batch's longest output (``min_new_tokens`` =
    ``max_new_tokens``, so EOS cannot end it); only each request's own output length is counted as
    output tokens, so a mix of lengths costs transformers the padding that static batching costs.
    No per-token times: a streamer would force a device sync every step and slow the peer down.
    """
    def generate(batch: list[BenchRequest]) -> int:
        ids, mask = _left_pad([r.prompt_token_ids for r in batch], 0, device)
        longest = max(r.output_len for r in batch)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                             do_sample=False, pad_token_id=0)
        if out.shape[1] - ids.shape[1] != longest:
            raise RuntimeError(f"generate returned {out.shape[1] - ids.shape[1]} new tokens, expected {longest}")
        return sum(r.output_len for r in batch)

    generate([dataclasses.replace(r, output_len=min(4, r.output_len)) for r in workload[:min(8, len(workload))]])
    sync(device)
    t0 = time.perf_counter()
    n_out = sum(generate(workload[i:i + batch_size]) for i in range(0, len(workload), batch_size))
    sync(device)
    return {"seconds": time.perf_counter() - t0, "output_tokens": n_out}


def _cb_config(workload: list[BenchRequest], device: torch.device) -> Any:
    """transformers' defaults on CUDA; on CPU a cache sized to the workload (its defaults size the cache
    to the free host memory: 5.23 spent 17 s on it before the first step of 8 tiny requests)."""
    if device.type == "cuda":
        return None
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        return None
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    page = 256
    want = {"num_blocks": sum(-(-(r.input_len + r.output_len) // page) for r in workload) + 1,
            "max_batch_tokens": min(512, sum(r.input_len for r in workload))}
    return ContinuousBatchingConfig(**{k: v for k, v in want.items() if k in fields})


@torch.no_grad()
def run_hf_continuous(model: Any, workload: list[BenchRequest], device: torch.device) -> dict:
    """``model.generate_batch`` (transformers' continuous batching) of the whole workload, greedy, EOS off.

    ``generate_batch`` takes one ``max_new_tokens`` for all requests: it generates the longest output
    for every request and only each request's own length is counted. ``seconds`` runs from the first
    request's creation to the last one's end (manager construction and its CUDA-graph warm-up are
    left out, as kvforge's engine construction is); ``call_seconds`` is the whole call.
    """
    from transformers import GenerationConfig

    if not hasattr(model, "generate_batch"):
        raise RuntimeError("this transformers version has no generate_batch (continuous batching)")
    longest = max(r.output_len for r in workload)
    gen_cfg = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=-1, pad_token_id=0)
    params = inspect.signature(model.generate_batch).parameters
    kwargs: dict[str, Any] = {}
    if "record_timestamps" in params:
        kwargs["record_timestamps"] = True
    if "progress_bar" in params:
        kwargs["progress_bar"] = False
    cb_config = _cb_config(workload, device)
    if cb_config is not None and "continuous_batching_config" in params:
        kwargs["continuous_batching_config"] = cb_config
    sync(device)
    t0 = time.perf_counter()
    results = model.generate_batch(inputs=[r.prompt_token_ids for r in workload], generation_config=gen_cfg, **kwargs)
    sync(device)
    call_s = time.perf_counter() - t0
    outs = list(results.values())
    errors = [o.error for o in outs if getattr(o, "error", None)]
    short = [o for o in outs if len(o.generated_tokens) < longest]
    if len(outs) != len(workload) or errors or short:
        raise RuntimeError(f"generate_batch finished {len(outs) - len(short)} of {len(workload)} requests "
                           f"in full; errors: {errors[:2]}")
    row: dict[str, Any] = {"seconds": call_s, "call_seconds": call_s,
                           "output_tokens": sum(r.output_len for r in workload)}
    created = [getattr(o, "created_time", None) for o in outs]
    ends = [getattr(o, "lifespan", (-1, -1))[1] for o in outs]
    if all(isinstance(c, float) for c in created) and min(ends) > 0 and 0 < max(ends) - min(created) <= call_s:
        row["seconds"] = max(ends) - min(created)
    stamps = [getattr(o, "timestamps", None) for o in outs]
    if all(stamps):  # per-token times (perf_counter): TTFT, TPOT and ITL of each request's own tokens
        own = [s[:r.output_len] for s, r in zip(stamps, workload)]
        row["ttft_ms"] = summarize((s[0] - c for s, c in zip(own, created)), 1e3)
        row["tpot_ms"] = summarize(((s[-1] - s[0]) / (len(s) - 1) for s in own if len(s) > 1), 1e3)
        row["itl_ms"] = summarize((b - a for s in own for a, b in zip(s, s[1:])), 1e3)
    return row
