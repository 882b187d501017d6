"""Random PEFT LoRA adapters of a local model, made offline with ``peft`` and saved with ``save_pretrained``,
and the reference generation they are checked against (transformers + peft, greedy, float32)."""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    use_rslora: bool = False
    seed: int = 0


#: three adapters of different ranks, scalings and targets
SPECS = (
    AdapterSpec("sql", 8, 16, ("q_proj", "v_proj"), seed=1),
    AdapterSpec("chat", 16, 8, tuple(ALL_PROJECTIONS), use_rslora=True, seed=2),
    AdapterSpec("math", 4, 32, ("o_proj", "gate_proj", "down_proj"), seed=3),
)


def load_hf_base(model_path: str):
    """The transformers model of a local checkpoint (an HF directory or a ``.gguf`` file, dequantized)."""
    from transformers import AutoModelForCausalLM

    if model_path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path),
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def make_adapter(hf_base, out_dir: str, spec: AdapterSpec, scale: float = 1.0) -> str:
    """Save a PEFT adapter of ``hf_base`` (left untouched) with random non-zero A and B (seeded) into
    ``out_dir/spec.name``."""
    from peft import LoraConfig, get_peft_model

    path = os.path.join(out_dir, spec.name)
    base = copy.deepcopy(hf_base)
    cfg = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets), lora_dropout=0.0,
                     use_rslora=spec.use_rslora, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:  # x A^T keeps x's scale
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "lora_B" in name:  # a delta a fraction of the base output's
                p.copy_(torch.randn(p.shape, generator=gen) * scale * 0.05 / p.shape[1] ** 0.5)
    model.save_pretrained(path)
    return path


def peft_model(hf_base, adapter_path: str | None):
    """``hf_base`` (None: no adapter) or a copy of it under the PEFT adapter at ``adapter_path``, in eval mode."""
    model = hf_base
    if adapter_path is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(copy.deepcopy(hf_base), adapter_path)
    return model.eval()


def greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """``model``'s greedy tokens for each prompt (one at a time, no padding, EOS not special): the argmax of
    the last position's logits, decoded with transformers' KV cache (no logits processors: generate's would
    suppress EOS). With the cache, each new token is a one-token forward, not a forward of the whole sequence."""
    out = []
    with torch.no_grad():
        for ids in prompts:
            step, cache, seq = torch.tensor([list(ids)]), None, []
            for _ in range(max_tokens):
                res = model(step, cache=cache, use_cache=True)
                cache = res.cache
                seq.append(int(res.logits[0, -1].argmax()))
                step = torch.tensor([seq[-1:]])
            out.append(seq)
    return out


def peft_greedy(hf_base, adapter_path: str | None, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers + peft greedy tokens for each prompt (one at a time, no padding, EOS not special)."""
    return greedy(peft_model(hf_base, adapter_path), prompts, max_tokens)
