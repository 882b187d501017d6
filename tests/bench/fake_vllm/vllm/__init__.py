"""A stand-in for vLLM's offline API, for the CPU tests of ``kvforge bench ... --vs vllm``.

It implements what ``kvforge/bench/vllm_worker.py`` calls (``LLM``, ``SamplingParams``,
``inputs.TokensPrompt``, ``sampling_params.RequestOutputKind``, ``llm_engine.add_request/step``) and
records every request it gets to the JSON-lines file ``$FAKE_VLLM_RECORD``, so that a test can check
that vLLM was sent exactly kvforge's requests. ``FAKE_VLLM_BROKEN=1`` makes the import fail on a
missing dependency; ``FAKE_VLLM_SHORT=1`` makes every request one token short. ``apply_model`` runs
the function on a small torch model with vLLM's parameter names, drawn as vLLM's dummy loader draws
them, and records what the function left in it.
"""
import json
import os
from dataclasses import dataclass, field

if os.environ.get("FAKE_VLLM_BROKEN") == "1":
    raise ModuleNotFoundError("No module named 'msgspec'", name="msgspec")

from vllm.inputs import TokensPrompt  # noqa: E402,F401
from vllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402,F401

__version__ = "0.0.fake"


def _record(entry: dict) -> None:
    path = os.environ.get("FAKE_VLLM_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


@dataclass
class CompletionOutput:
    token_ids: list = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    outputs: list
    finished: bool


class _Engine:
    def __init__(self):
        self.live = {}  # request id -> [tokens left, params]

    def add_request(self, request_id, prompt, params):
        _record({"call": "add_request", "prompt": prompt["prompt_token_ids"], **params.record()})
        self.live[request_id] = [params.max_tokens - (os.environ.get("FAKE_VLLM_SHORT") == "1"), params]

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        outs = []
        for rid, state in list(self.live.items()):
            state[0] -= 1
            done = state[0] <= 0
            outs.append(RequestOutput(rid, [CompletionOutput([7])], done))
            if done:
                del self.live[rid]
        return [o for o in outs if o.outputs[0].token_ids]


class LLM:
    def __init__(self, **kwargs):
        _record({"call": "LLM", "kwargs": kwargs})
        print("INFO 11-24 [cuda.py:1] Using FAKE_ATTN attention backend out of potential backends: ['FAKE_ATTN']",
              flush=True)
        self.llm_engine = _Engine()

    def apply_model(self, func):
        import torch

        model = torch.nn.Module()
        names = ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.0.mlp.router.bias", "model.layers.0.mlp.experts.w13_weight", "model.norm.weight"]
        params = {}
        for i, name in enumerate(names):
            p = torch.nn.Parameter(torch.empty(64 + i, 32).uniform_(-1e-3, 1e-3), requires_grad=False)
            model.register_parameter(name.replace(".", "_"), p)
            params[name] = p
        model.named_parameters = lambda: iter(params.items())  # vLLM's dotted names
        result = func(model)
        _record({"call": "apply_model", "env": os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION"),
                 "result": result, "params": {n: {"mean": p.mean().item(), "std": p.std().item(),
                                                  "all_ones": bool((p == 1).all())} for n, p in params.items()}})
        return [result]

    def generate(self, prompts, sampling_params, use_tqdm=True):
        assert len(prompts) == len(sampling_params), "one SamplingParams per prompt"
        short = os.environ.get("FAKE_VLLM_SHORT") == "1"
        outs = []
        for i, (p, sp) in enumerate(zip(prompts, sampling_params)):
            _record({"call": "generate", "prompt": p["prompt_token_ids"], **sp.record()})
            outs.append(RequestOutput(str(i), [CompletionOutput([7] * (sp.max_tokens - short))], True))
        return outs
