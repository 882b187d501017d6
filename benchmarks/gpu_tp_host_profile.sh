#!/usr/bin/env bash
# On the GPU machine, after `source .gpu/install.sh` (base group) with py-spy's wheel in .gpu/pyspy: where the
# driver's host time goes in a batch-1 decode (Llama-3-8B shape, random bf16 weights) at TP=1 and TP=2.
# One prompt decodes 4,000 tokens, EOS ignored; py-spy samples the engine process (the driver rank runs in
# it) for 8 s of that; the decode step's time is printed beside each profile's top frames, own and inclusive.
#   bash benchmarks/gpu_tp_host_profile.sh [TP ...]      (default: 1 2)
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; export OUT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
python3 -m zipfile -e .gpu/pyspy/*.whl /tmp/pyspy; PYSPY=$(find /tmp/pyspy -name py-spy -type f | head -1); chmod +x $PYSPY
for tp in "${@:-1 2}"; do
  for t in $tp; do
    rm -f /tmp/decoding
    python3 - "$t" > "$OUT/tp$t.log" 2>&1 <<'PY' &
import sys, time
from kvforge import LLM, SamplingParams
tp = int(sys.argv[1])
llm = LLM("dummy:llama-3-8b", tensor_parallel_size=tp, max_model_len=4608, gpu_memory_utilization=0.5)
prompt = {"prompt_token_ids": [(17 * i) % 30000 + 5 for i in range(512)]}
llm.generate([prompt], SamplingParams(max_tokens=64, ignore_eos=True), use_tqdm=False)  # warm-up
n = 4000
open("/tmp/decoding", "w").close()
start = time.perf_counter()
llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
print(f"ROW tp={tp} decode step {(time.perf_counter() - start) / n * 1e3:.3f} ms (4000 tokens, prefill included)")
llm.shutdown()
PY
    pid=$!
    for i in $(seq 1 600); do [[ -e /tmp/decoding ]] && break; sleep 0.5; done
    sleep 2
    timeout 30 $PYSPY record -d 8 -r 1000 -f raw -o "$OUT/tp$t.raw" --nonblocking --threads --pid $pid > "$OUT/pyspy-tp$t.log" 2>&1
    wait $pid
    grep ROW "$OUT/tp$t.log" || tail -20 "$OUT/tp$t.log"
    python3 benchmarks/pyspy_summary.py "$OUT/tp$t.raw" --top 25
  done
done
