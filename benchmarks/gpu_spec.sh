#!/usr/bin/env bash
# On the GPU machine, after `source .gpu/install.sh` (base and model groups): speculative decoding's
# figures of docs/speculative.md, speculation off and on side by side, each row a fresh process.
#   tpot        batch 1, the default model, the `edit` dataset (copying is common), ngram k=4 and k=8: TPOT
#   throughput  dummy:llama-3-8b, 64 and 256 requests x 512 in x 256 out, ngram k=4, policy auto
#   draft       draft_model, dummy:llama-3.2-1b drafting for dummy:llama-3-8b, k=4, batch 1 and 16: the
#               drafting overhead, and the speedup at 50/70/90% acceptance (benchmarks/spec_oracle.py)
#   eagle       an EAGLE-3 head (random, 32k draft vocabulary) for dummy:llama-3-8b, k=4: batch-1 TPOT off /
#               head rejected / 50/70/90/100% acceptance, the drafting cost per step, and batch 64 and 256
#               against speculation off with policy auto (benchmarks/spec_eagle.py)
#   bash benchmarks/gpu_spec.sh [all|tpot|throughput|draft|eagle]
# JSON and tables go to $OUT (the device tool's output folder) or ./gpu-out.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
what=${1:-all}
case $what in all|tpot|throughput|draft|eagle) ;; *) echo "usage: $0 [all|tpot|throughput|draft|eagle]" >&2; exit 2 ;; esac
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
NGRAM='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
NGRAM8='{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
run() {  # run NAME TIMEOUT ARGS...: one fresh process, JSON to $out/NAME.json, its table to $out/NAME.txt
  local name=$1 limit=$2; shift 2
  timeout "$limit" kvforge bench "$@" --json "$out/$name.json" 2>&1 | grep -v -i warn | tail -6 | tee "$out/$name.txt"
}
if [[ $what == all || $what == tpot ]]; then
  L=(latency --batch-size 1 --input-len 512 --output-len 256 --dataset edit --num-iters-warmup 1 --num-iters 3)
  run tpot-off 150 "${L[@]}"
  run tpot-ngram 150 "${L[@]}" --speculative-config "$NGRAM"
  run tpot-ngram8 150 "${L[@]}" --speculative-config "$NGRAM8"
fi
if [[ $what == all || $what == throughput ]]; then
  for n in 64 256; do
    T=(throughput --model dummy:llama-3-8b --num-prompts $n --input-len 512 --output-len 256)
    run "tp$n-off" 150 "${T[@]}"
    run "tp$n-ngram" 150 "${T[@]}" --speculative-config "$NGRAM"
  done
fi
if [[ $what == all || $what == draft ]]; then
  for b in 1 16; do
    o=(--batch-size $b --input-len 512 --output-len 256)
    one() {  # one NAME ARGS...: a fresh process, its JSON line to $out/NAME.json
      local name=$1; shift
      timeout 150 python3 benchmarks/spec_oracle.py "$@" "${o[@]}" 2>&1 | grep '^{' | tee "$out/$name.json"
    }
    one "draft$b-off-plain" off --no-force
    one "draft$b-off" off
    one "draft$b-draft" draft
    one "draft$b-phases" draft --phases
    for a in 0.5 0.7 0.9; do one "draft$b-oracle$a" oracle --acceptance $a; done
  done
fi
if [[ $what == all || $what == eagle ]]; then
  eagle() {  # eagle NAME ARGS...: a fresh process, its JSON line to $out/NAME.json
    local name=$1; shift
    timeout 300 python3 benchmarks/spec_eagle.py "$@" --input-len 512 --output-len 256 2>&1 | grep '^{' | tee "$out/$name.json"
  }
  eagle eagle1-off off
  eagle eagle1-head eagle
  eagle eagle1-phases eagle --phases
  for a in 0.5 0.7 0.9 1; do eagle "eagle1-oracle$a" oracle --acceptance $a; done
  for b in 64 256; do
    eagle "eagle$b-off" off --batch-size $b
    eagle "eagle$b-head-auto" eagle --batch-size $b --policy auto
    eagle "eagle$b-oracle0.7-auto" oracle --acceptance 0.7 --batch-size $b --policy auto
  done
fi
