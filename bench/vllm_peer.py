"""``--vs vllm``: vLLM as a peer, in a subprocess of its own, on exactly kvforge's requests.

vLLM pins other versions of packages kvforge uses (fastapi, flashinfer...), so it runs in its own
interpreter: ``--vllm-python`` (default: this one) with ``--vllm-path`` entries put in front of its
``PYTHONPATH``. The child runs ``vllm_worker.py`` (stdlib and vLLM only); both sides exchange JSON
files (the worker's docstring has the protocol). The model becomes vLLM's arguments
(:func:`llm_kwargs`): a ``dummy:`` preset is a temporary directory holding its ``config.json`` loaded
with ``load_format="dummy"``, whose weights the worker then draws again as kvforge draws its own (see
:func:`redraw_spec`); an HF directory is passed as is (with
``load_format="dummy"`` if kvforge's is); a GGUF file is passed as is. Everything else is vLLM's
default: its ``max_num_seqs``, its batch-token budget, its attention backend, torch.compile and CUDA
graphs. The child's output (vLLM's log) is shown as it comes and searched for the attention backend
vLLM picked.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from kvforge.bench.metrics import summarize
from kvforge.bench.workloads import BenchRequest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker.py")
#: vLLM 0.26's log line for its attention backend ("Using FLASH_ATTN attention backend out of potential
#: backends: [...]" when it chose, "Using FLASH_ATTN backend." when told)
BACKEND_LINE = re.compile(r"Using (?:AttentionBackendEnum\.)?([A-Z][A-Z0-9_]+) (?:attention )?backend")


@dataclass
class VllmPeer:
    """Where vLLM runs: the interpreter, the ``PYTHONPATH`` entries in front, and what the probe saw."""

    python: str = sys.executable
    path: list[str] = field(default_factory=list)
    timeout: float = 1800.0
    version: str | None = None
    #: random weights (``load_format="dummy"``) drawn again as kvforge's (:func:`redraw_spec`)
    redraw_dummy: bool = True

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        entries = self.path + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        if entries:
            env["PYTHONPATH"] = os.pathsep.join(entries)
        return env

    def cli(self, *argv: str) -> list[str]:
        """The command line of ``vllm ARGV...`` in vLLM's interpreter (run it with :meth:`env`): its CLI's
        entry point called directly, since the ``vllm`` script may not be on the PATH (``--vllm-path``)."""
        return [self.python, "-c", "import sys; from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()",
                *argv]

    def call(self, request: dict, echo: bool = True) -> tuple[dict, str]:
        """Run the worker on ``request``; returns (its result, its output). Raises ``RuntimeError`` for a
        worker that wrote no result."""
        with tempfile.TemporaryDirectory(prefix="kvforge-vllm-") as tmp:
            req_path, res_path = os.path.join(tmp, "request.json"), os.path.join(tmp, "result.json")
            with open(req_path, "w") as f:
                json.dump(request, f)
            proc = subprocess.Popen([self.python, WORKER, req_path, res_path], env=self.env(), text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, errors="replace")
            lines: list[str] = []

            def pump() -> None:
                for line in proc.stdout:
                    lines.append(line)
                    if echo:
                        sys.stderr.write(f"[vllm] {line}")

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            try:
                proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            reader.join(timeout=10)
            log = "".join(lines)
            if not os.path.exists(res_path):
                raise RuntimeError(f"the vLLM worker ({self.python}) exited with status {proc.returncode} "
                                   f"without a result; its last output:\n{log[-3000:]}")
            with open(res_path) as f:
                return json.load(f), log

    def probe(self) -> str:
        """vLLM's version; ``ValueError`` naming what is missing when it does not import."""
        result, log = self.call({"mode": "probe"}, echo=False)
        if "error" in result:
            missing = result.get("missing")
            what = f"the module {missing!r} is missing" if missing else result["error"]
            raise ValueError(f"--vs vllm: vLLM does not import in {result.get('python', self.python)} ({what}; "
                             f"{result['error']}). Install vLLM there, or point --vllm-python at an interpreter "
                             "that has it, or --vllm-path at a directory holding it (shared/gpu/README.md: "
                             "prepare.sh vllm)")
        self.version = result["vllm_version"]
        return self.version


def attention_backend(log: str) -> str | None:
    """The attention backend vLLM's log names (the last one), or None."""
    found = BACKEND_LINE.findall(log)
    return found[-1] if found else None


#: kvforge quantization methods vLLM runs under the same name (on-load ``int4`` has no vLLM equivalent)
VLLM_QUANTIZATION = ("fp8", "awq", "gptq", "compressed-tensors")


def llm_kwargs(source: Any, mc: Any, dtype: Any, seed: int, workdir: str, config: Any = None) -> dict:
    """``vllm.LLM`` keyword arguments for kvforge's model ``source`` (a ``ModelSource``), with the
    engine ``config``'s quantization and KV-cache dtype (vLLM's names are kvforge's)."""
    kwargs: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "seed": seed,
                              "skip_tokenizer_init": True}
    quant = getattr(config, "quantization", None)
    if quant is not None:
        if quant not in VLLM_QUANTIZATION:
            raise ValueError(f"--vs vllm: quantization {quant!r} has no vLLM equivalent; vLLM runs "
                             f"{', '.join(VLLM_QUANTIZATION)}")
        kwargs["quantization"] = quant
    if getattr(config, "kv_cache_dtype", "auto") != "auto":
        kwargs["kv_cache_dtype"] = config.kv_cache_dtype
    if source.kind == "dummy":
        path = source.path
        if path is None:  # a preset: its config.json in a directory of its own
            path = os.path.join(workdir, source.preset)
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(mc.to_hf_dict() | {"torch_dtype": kwargs["dtype"]}, f, indent=2)
        return kwargs | {"model": path, "load_format": "dummy"}
    return kwargs | {"model": source.path}


#: the spread of kvforge's random weights (``kvforge.model.loader``): vLLM's are redrawn with it
DUMMY_STD = 0.02


def redraw_spec(kwargs: dict, redraw: bool = True) -> dict | None:
    """The worker's ``redraw`` for vLLM keyword arguments: random weights (``load_format="dummy"``) are
    drawn again as kvforge's (norms 1, the rest N(0, 0.02)), so that both engines run the same kind of
    model: vLLM's own (uniform +-1e-3, one seed per tensor size) make another model, whose MoE routers
    spread tokens over the experts otherwise (gpt-oss-20b on an H200: vLLM 9,265 output tok/s with its
    own, 10,601 redrawn). None for real weights, or when not ``redraw``
    (``--vllm-dummy-weights vllm``)."""
    if not redraw or kwargs.get("load_format") != "dummy":
        return None
    return {"std": DUMMY_STD, "seed": kwargs.get("seed", 0)}


def lora_spec(lora_request: Any) -> dict | None:
    """The worker's form of an adapter (``{"name", "id", "path"}``) from a kvforge ``LoRARequest``, or None."""
    if lora_request is None:
        return None
    return {"name": lora_request.lora_name, "id": lora_request.lora_int_id, "path": lora_request.lora_path}


def throughput_row(peer: VllmPeer, kwargs: dict, workload: list[BenchRequest], warmup: list[list[int]],
                   warmup_tokens: int, loras: Sequence[Any] | None = None,
                   warmup_loras: Sequence[Any] | None = None) -> dict:
    """vLLM's row of ``kvforge bench throughput``: the columns kvforge's has, from the worker's stamps.

    ``loras`` / ``warmup_loras``: one kvforge ``LoRARequest`` (or None: the base model) per request of
    ``workload`` / per ``warmup`` prompt; vLLM gets its own ``LoRARequest`` of the same name, id and path
    (``kwargs`` must then enable LoRA)."""
    request = {"mode": "throughput", "llm_kwargs": kwargs, "redraw": redraw_spec(kwargs, peer.redraw_dummy), "warmup": warmup,
               "warmup_tokens": warmup_tokens,
               "requests": [{"prompt": r.prompt_token_ids, "max_tokens": r.output_len} for r in workload]}
    if loras is not None:
        if len(loras) != len(workload):
            raise ValueError(f"loras: got {len(loras)} for {len(workload)} requests")
        for entry, lora in zip(request["requests"], loras):
            if lora is not None:
                entry["lora"] = lora_spec(lora)
    if warmup_loras is not None:
        if len(warmup_loras) != len(warmup):
            raise ValueError(f"warmup_loras: got {len(warmup_loras)} for {len(warmup)} warm-up prompts")
        request["warmup_loras"] = [lora_spec(lora) for lora in warmup_loras]
    result, log = peer.call(request)
    row = header(result, log)
    if "error" in result:
        return row | {"error": result["error"]}
    stamps = result["stamps"]
    # NOTE: stamps are seconds after the first add_request, so each request's arrival is 0
    return row | {
        "seconds": result["seconds"], "load_seconds": result["load_seconds"],
        "output_tokens": sum(result["tokens"]),
        "ttft_ms": summarize((s[0] for s in stamps if s), 1e3),
        "tpot_ms": summarize(((s[-1] - s[0]) / (r.output_len - 1) for s, r in zip(stamps, workload)
                              if s and r.output_len > 1), 1e3),
        "itl_ms": summarize((b - a for s in stamps for a, b in zip(s, s[1:])), 1e3),
        "e2e_ms": summarize((s[-1] for s in stamps if s), 1e3),
    }


def latency_seconds(peer: VllmPeer, kwargs: dict, batches: list[list[BenchRequest]],
                    max_tokens: list[int | None]) -> tuple[dict, list[float]]:
    """Seconds of one ``llm.generate`` per batch, in order (``max_tokens[i]`` overrides batch i's output
    lengths when set); returns (the row's header fields, the seconds)."""
    request = {"mode": "latency", "llm_kwargs": kwargs, "redraw": redraw_spec(kwargs, peer.redraw_dummy),
               "batches": [{"prompts": [r.prompt_token_ids for r in b],
                            "max_tokens": [m or r.output_len for r in b]} for b, m in zip(batches, max_tokens)]}
    result, log = peer.call(request)
    row = header(result, log)
    if "error" in result:
        return row | {"error": result["error"]}, []
    return row | {"load_seconds": result["load_seconds"]}, result["seconds"]


def header(result: dict, log: str) -> dict:
    backend = attention_backend(log)
    version = result.get("vllm_version", "?")
    return {"engine": f"vLLM {version} ({backend or 'backend not logged'})", "vllm_version": version,
            "attention_backend": backend, "redrawn_parameters": result.get("redrawn_parameters"),
            "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
