"""torch.profiler trace of decode steps at batch 1 on the default model (the `edit` dataset), with and
without speculative decoding: where host and device time go, op by op and phase by phase.

On the GPU machine, after `source .gpu/install.sh` (base and model groups):
    python benchmarks/profile_trace.py [--speculative-config JSON] [--output-len 64] [--out DIR]
Engine phases (schedule, launch, layout, replay, verify, sample, finish, wait, update, outputs,
propose) are wrapped in ``record_function`` ranges; prints the top ops and ranges by host and by
device time and writes a Chrome trace (``trace-<name>.json``) to --out.
"""
from __future__ import annotations

import argparse
import functools
import json
import os

from torch.profiler import ProfilerActivity, profile, record_function

from kvforge import LLM, SamplingParams
from kvforge.bench.workloads import edit_prompt


def ranged(obj, name, label=None):
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        with record_function(f"## {label or name}"):
            return fn(*a, **k)
    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--speculative-config", type=json.loads, default=None)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    args = ap.parse_args()
    llm = LLM(speculative_config=args.speculative_config)
    eng, tok = llm.llm_engine, llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": edit_prompt(tok, 512, 99)}], params, use_tqdm=False)  # warm-up
    r = eng.runner
    for obj, names in ((eng, ["step", "_complete"]), (eng.spec, ["propose"] if eng.spec else []), (eng.scheduler, ["schedule", "update", "advance"]),
                       (r, ["launch", "_verify", "_sample"]), (r.builder, ["build"]), (r.worker, ["_lay_out_step"]), (eng.outputs, ["detokenize", "make_outputs"])):
        for n in names:
            if hasattr(obj, n):
                ranged(obj, n)
    if r.graphs is not None:
        ranged(r.graphs, "replay")
        ranged(r.attn, "update_graph_metadata")
    name = "spec" if args.speculative_config else "off"
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([{"prompt_token_ids": edit_prompt(tok, 512, 1)}], params, use_tqdm=False)
    os.makedirs(args.out, exist_ok=True)
    prof.export_chrome_trace(os.path.join(args.out, f"trace-{name}.json"))
    ka = prof.key_averages()
    print(f"== {name}: by self CPU time")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=35, max_name_column_width=60))
    print(f"== {name}: by CPU time (ranges)")
    print(ka.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
    print(f"== {name}: by device time")
    print(ka.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
