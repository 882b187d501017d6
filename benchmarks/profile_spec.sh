#!/usr/bin/env bash
# On the GPU machine, after `source .gpu/install.sh` (base and model groups): where a speculative step's
# time goes at batch 1 (the default model, the edit dataset, ngram k=4): cProfile of
# `kvforge bench latency`, top functions by cumulative and own time, to $OUT/spec-profile.txt.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
NGRAM='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5, "policy": "fixed"}'
timeout 200 python3 -m cProfile -o "$out/spec.prof" -m kvforge.cli bench latency --batch-size 1 --input-len 512 \
  --output-len 256 --dataset edit --num-iters-warmup 1 --num-iters 3 --speculative-config "$NGRAM" 2>&1 | tail -4
python3 - "$out/spec.prof" > "$out/spec-profile.txt" <<'PY'
import pstats, sys
s = pstats.Stats(sys.argv[1])
s.sort_stats("cumulative").print_stats(45)
s.sort_stats("tottime").print_stats(30)
PY
head -c 200 "$out/spec-profile.txt"
