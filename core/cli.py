"""The ``kvforge`` command: ``generate``, ``plugins`` (and ``serve`` / ``bench`` where installed)."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

ENGINE_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--model", dict(default=None, help="HF directory, .gguf file, hub id or dummy:<preset> (default: SmolLM2-135M-Instruct)")),
    ("--config", dict(default=None, help="TOML/YAML file of engine options and [plugins.<name>] tables")),
    ("--tokenizer", dict(default=None)),
    ("--load-format", dict(default=None, choices=["auto", "safetensors", "gguf", "dummy"])),
    ("--dtype", dict(default=None, choices=["auto", "float32", "float16", "bfloat16", "half", "float"])),
    ("--device", dict(default=None, help="auto, cpu or cuda[:N]")),
    ("--seed", dict(type=int, default=None)),
    ("--max-model-len", dict(type=int, default=None)),
    ("--block-size", dict(type=int, default=None)),
    ("--gpu-memory-utilization", dict(type=float, default=None)),
    ("--kv-cache-memory-gib", dict(type=float, default=None)),
    ("--num-gpu-blocks-override", dict(type=int, default=None)),
    ("--swap-space", dict(type=float, default=None, help="GiB of CPU memory for KV blocks preempted by swapping")),
    ("--kv-offload-cpu-gib", dict(type=float, default=None,
                                  help="GiB of CPU memory per rank keeping prefix-cached KV blocks the GPU pool reuses (0)")),
    ("--kv-connector", dict(default=None, help="the tier of those blocks, a kv_connector plugin (cpu)")),
    ("--kv-offload-dir", dict(default=None, help="a directory keeping prefix-cached KV blocks on disk, across "
                                                 "restarts (behind the CPU tier when --kv-offload-cpu-gib is set)")),
    ("--kv-offload-disk-gib", dict(type=float, default=None, help="GiB of disk per rank that directory may fill (16)")),
    ("--kv-events-endpoint", dict(default=None, help="publish KV events (blocks stored and removed per tier) on a "
                                                     "ZMQ PUB socket bound here, e.g. tcp://127.0.0.1:5557 "
                                                     "(implies --enable-kv-events)")),
    ("--max-num-seqs", dict(type=int, default=None)),
    ("--max-num-batched-tokens", dict(type=int, default=None)),
    ("--max-piecewise-graph-tokens", dict(type=int, default=None,
                                          help="largest step with prompt tokens replayed as piecewise CUDA graphs "
                                               "(default 2048 on one rank without LoRA; 0: off)")),
    ("--max-logprobs", dict(type=int, default=None, help="most logprobs / prompt_logprobs a request may ask for (20)")),
    ("--max-n", dict(type=int, default=None, help="most samples (n) one request may ask for (128)")),
    ("--grammar-compile-timeout", dict(type=float, default=None,
                                       help="seconds a structured-output constraint may take to compile (10)")),
    ("--grammar-cache-size", dict(type=int, default=None, help="compiled constraints kept for reuse (256)")),
    ("--attention-backend", dict(default=None)),
    ("--scheduler", dict(default=None)),
    ("--sampler", dict(default=None)),
    ("--kv-cache-manager", dict(default=None)),
    ("--tensor-parallel-size", dict(type=int, default=None, help="ranks each layer is split over (1)")),
    ("--pipeline-parallel-size", dict(type=int, default=None, help="pipeline stages the layers are split into (1)")),
    ("--distributed-executor-backend", dict(default=None, help="uni, mp, ray or a plugin's executor "
                                            "(default: uni for one rank, ray if a Ray cluster runs, else mp)")),
    ("--quantization", dict(default=None, help="quantization method of the linear layers: fp8 or int4 (on "
                                               "load), awq, gptq, compressed-tensors, or a plugin's (default: "
                                               "the checkpoint's quantization_config, else the model dtype)")),
    ("--kv-cache-dtype", dict(default=None, choices=["auto", "fp8", "fp8_e4m3"],
                              help="KV cache element type: auto (the model dtype) or fp8 (e4m3 with per-layer "
                                   "scales: twice the blocks in the same memory)")),
    ("--max-loras", dict(type=int, default=None, help="most LoRA adapters one step may run (1)")),
    ("--max-lora-rank", dict(type=int, default=None, help="largest LoRA rank accepted (16)")),
    ("--max-cpu-loras", dict(type=int, default=None, help="LoRA adapters kept in host memory (max-loras)")),
    ("--limit-mm-per-prompt", dict(default=None, type=lambda text: _json_table(text, "--limit-mm-per-prompt"),
                                   help='a multimodal model\'s items per prompt as JSON, vLLM\'s form: '
                                        '\'{"image": 2}\' (each modality left out: 1; docs/multimodal.md)')),
    ("--speculative-config", dict(default=None, type=lambda text: _json_table(text, "--speculative-config"),
                                  help='speculative decoding as JSON, vLLM\'s keys: \'{"method": "ngram", '
                                       '"num_speculative_tokens": 4}\' (docs/speculative.md)')),
]


def _json_table(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{flag}: not valid JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{flag}: must be a JSON object")
    return value


def add_engine_args(parser: argparse.ArgumentParser, model_flag: bool = True) -> None:
    for flag, kwargs in ENGINE_FLAGS:
        if flag == "--model" and not model_flag:
            continue
        parser.add_argument(flag, **kwargs)
    parser.add_argument("--enforce-eager", dest="enforce_eager", action="store_true", default=None,
                        help="never capture or replay CUDA graphs")
    parser.add_argument("--async-scheduling", dest="async_scheduling", action="store_true", default=None,
                        help="schedule the next step while the GPU runs the current one (default: on CUDA only)")
    parser.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")
    parser.add_argument("--disable-custom-all-reduce", dest="disable_custom_all_reduce", action="store_true",
                        default=None, help="every tensor-parallel all-reduce through NCCL (none over peer memory)")
    parser.add_argument("--enable-lora", dest="enable_lora", action="store_true", default=None,
                        help="serve LoRA adapters next to the base model (docs/lora.md)")
    parser.add_argument("--enable-kv-events", dest="enable_kv_events", action="store_true", default=None,
                        help="record KV events: the server's GET /kv_events (docs/kv_cache.md)")
    parser.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=None)
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    keys = [f[0][2:].replace("-", "_") for f in ENGINE_FLAGS] + ["enable_prefix_caching", "enforce_eager", "async_scheduling",
                                                           "enable_lora", "disable_custom_all_reduce",
                                                           "enable_kv_events"]
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def cmd_generate(args: argparse.Namespace) -> int:
    from kvforge.engine.llm import LLM
    from kvforge.sampling_params import SamplingParams

    kwargs = engine_kwargs(args)
    llm = LLM(kwargs.pop("model", None), config=kwargs.pop("config", None), **kwargs)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from kvforge.plugin_manager import get_plugin_manager

    pm = get_plugin_manager()
    report = [{"name": i.name, "module": i.module, "distribution": i.distribution, "version": i.version,
               "registers": i.registers} for i in pm.plugins.values()]
    report += [{"name": i.name, "module": i.module, "distribution": i.distribution, "version": i.version,
                "error": i.error} for i in pm.failed.values()]
    print(json.dumps(report, indent=2))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from kvforge.model.interface import capabilities_of
    from kvforge.plugin_manager import get_plugin_manager

    pm = get_plugin_manager()
    rows = []
    for name in pm.names("model"):
        row: dict[str, Any] = {"architecture": name, "plugin": pm.registries["model"].plugin_of(name)}
        try:
            cls = pm.get("model", name)
        except ImportError as exc:  # a plugin's model whose dependencies are missing
            rows.append({**row, "error": str(exc)})
            continue
        rows.append({**row, "class": f"{cls.__module__}:{cls.__qualname__}", **capabilities_of(cls).as_dict()})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    flags = ("sliding_window", "moe", "tensor_parallel", "pipeline_parallel", "quantization")
    header = ["architecture", "inputs", *flags, "notes"]
    table = [header] + [[r["architecture"], ", ".join(["text", *r.get("modalities", ())]),
                         *("yes" if r.get(f) else "-" for f in flags), r.get("notes", r.get("error", ""))]
                        for r in rows]
    widths = [max(len(str(line[i])) for line in table) for i in range(len(header))]
    for line in table:
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvforge", description="kvforge LLM inference engine")
    parser.add_argument("--log-level", default=None, help="default: INFO for serve, WARNING otherwise")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt")
    add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.set_defaults(func=cmd_generate)

    plugins = sub.add_parser("plugins", help="list discovered plugins as JSON")
    plugins.set_defaults(func=cmd_plugins)

    models = sub.add_parser("models", help="list the registered model architectures and their capabilities")
    models.add_argument("--json", action="store_true", help="print JSON instead of a table")
    models.set_defaults(func=cmd_models)

    # More subcommands (``serve``, ``bench``) come from the ``kvforge.cli`` entry-point group, so that
    # core never imports the server: each entry point is a function taking the subparsers object.
    import importlib.metadata as md
    for ep in md.entry_points(group="kvforge.cli"):
        try:
            ep.load()(sub)
        except ImportError as exc:  # e.g. the server's optional dependencies are not installed
            logging.getLogger(__name__).debug("kvforge subcommand %s unavailable: %r", ep.name, exc)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = args.log_level or ("INFO" if args.command in ("serve", "router") else "WARNING")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
