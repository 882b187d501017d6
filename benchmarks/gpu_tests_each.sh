#!/usr/bin/env bash
# On the GPU machine, after `source .gpu/install.sh`: each gpu-marked test of the given files in its own pytest
# process under its own time limit, its report written to $OUT as soon as it ends. A run cut short by the
# device call's limit still leaves every finished test's report (one pytest of many tests prints its failures
# only at the end, and a hang loses them all), and a test that hangs dumps its threads' stacks. A failed
# test's whole output is kept as $OUT/failed-N.log (N: its place in the run).
#   PER_TEST_S=120 bash benchmarks/gpu_tests_each.sh tests/gpu/test_tensor_parallel_gpu.py [-k EXPR]
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
log="$out/gpu-tests-each.log"; : > "$log"
mapfile -t ids < <(python3 -m pytest -q -m gpu --collect-only "$@" 2>/dev/null | grep '::')
echo "${#ids[@]} tests" | tee -a "$log"
n=0
for id in "${ids[@]}"; do
  start=$(date +%s)
  timeout -s INT "${PER_TEST_S:-120}" python3 -m pytest -p no:cacheprovider -q -m gpu --tb=short -rfE \
    -o faulthandler_timeout=$(( ${PER_TEST_S:-120} - 10 )) "$id" > "$out/one.log" 2>&1
  rc=$?
  echo "== rc=$rc $(( $(date +%s) - start )) s $id" | tee -a "$log"
  n=$(( n + 1 ))
  [[ $rc == 0 ]] || { tail -40 "$out/one.log" >> "$log"; cp "$out/one.log" "$out/failed-$n.log"; }
done
rm -f "$out/one.log"
grep '^== ' "$log"
