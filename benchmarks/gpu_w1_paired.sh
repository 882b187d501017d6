#!/usr/bin/env bash
# On the GPU machine, after `source .gpu/install.sh`: W1 (256 x 512 in x 256 out, dummy:llama-3-8b) on this
# tree and on an older one, alternated, each run a fresh process, so that a hot-path change is measured
# against the last figure on the same machine (docs/benchmarks.md: no regression lands silently).
#   OLD=bench-old.tar.gz bash benchmarks/gpu_w1_paired.sh [ROUNDS]     (2 rounds by default)
# OLD is `git archive --format=tar.gz -o bench-old.tar.gz REV` of the revision to compare with, made where
# git is (untracked, it travels with the working tree; do not commit it). JSON goes to $OUT/results.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out/results"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
old=/tmp/old-tree; rm -rf "$old" /tmp/old-site; mkdir -p "$old"
tar -xzf "${OLD:?OLD=path of the old tree archive}" -C "$old"
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/old-site "$old" > "$out/old-install.log" 2>&1 \
  || { echo "installing the old tree failed"; tail -5 "$out/old-install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
for round in $(seq "${1:-2}"); do
  for tree in new old; do
    site=""; [[ $tree == old ]] && site=/tmp/old-site:
    PYTHONPATH="$site${PYTHONPATH:-}" timeout 300 python3 -m kvforge.cli bench throughput --model dummy:llama-3-8b \
      --num-prompts 256 --input-len 512 --output-len 256 --json "$out/results/w1-$tree-$round.json" \
      > "$out/w1-$tree-$round.log" 2>&1
    echo "== W1 $tree tree, round $round (exit $?)"; grep -i -e "tok/s" -e "kvforge" "$out/w1-$tree-$round.log" | tail -3
  done
done
