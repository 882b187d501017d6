#!/usr/bin/env bash
# On the GPU machine, after `source .gpu/install.sh`: W1 (256 x 512 in x 256 out, dummy:llama-3-8b) on this
# tree and on older ones, alternated (the order rotates every round), each run a fresh process, so that a
# hot-path change is measured against the last figure on the same machine (docs/benchmarks.md: no regression
# lands silently).
#   OLD="bench-old.tar.gz [bench-mid.tar.gz ...]" bash benchmarks/gpu_w1_paired.sh [ROUNDS]   (2 rounds by default)
# Each OLD archive is `git archive --format=tar.gz -o bench-old.tar.gz REV` of a revision to compare with, made
# where git is (untracked, it travels with the working tree; do not commit it). JSON goes to $OUT/results.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out/results"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
trees=(new)
for archive in ${OLD:?OLD=paths of the old trees\' archives}; do
  name=$(basename "$archive" .tar.gz); name=${name#bench-}
  src=/tmp/tree-$name site=/tmp/site-$name
  rm -rf "$src" "$site"; mkdir -p "$src"; tar -xzf "$archive" -C "$src"
  python3 -m pip install -q --no-deps --no-build-isolation --target "$site" "$src" > "$out/$name-install.log" 2>&1 \
    || { echo "installing $archive failed"; tail -5 "$out/$name-install.log"; exit 1; }
  trees+=("$name")
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
for round in $(seq "${1:-2}"); do
  order=("${trees[@]}")
  for ((k = 0; k < (round - 1) % ${#trees[@]}; k++)); do order=("${order[@]:1}" "${order[0]}"); done
  (( round % 2 == 0 )) && order=($(printf '%s\n' "${order[@]}" | tac))
  for tree in "${order[@]}"; do
    site=""; [[ $tree != new ]] && site=/tmp/site-$tree:
    PYTHONPATH="$site${PYTHONPATH:-}" timeout 300 python3 -m kvforge.cli bench throughput --model dummy:llama-3-8b \
      --num-prompts 256 --input-len 512 --output-len 256 --json "$out/results/w1-$tree-$round.json" \
      > "$out/w1-$tree-$round.log" 2>&1
    echo "== W1 $tree tree, round $round (exit $?): $(grep -o 'kvforge ([a-z_0-9]*) *[0-9.]* *[0-9,]*' "$out/w1-$tree-$round.log" | awk '{print $NF}') tok/s"
  done
done
