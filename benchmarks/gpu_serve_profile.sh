#!/usr/bin/env bash
# On the GPU machine, after `source .gpu/install.sh` (base group) with py-spy's wheel in .gpu/pyspy
# (`pip download py-spy --no-deps --only-binary=:all: --platform manylinux2014_x86_64 --python-version 3
# --implementation py --abi none -d .gpu/pyspy`): the host profile of `kvforge serve` under the issue-14
# serving load (Llama-3-8B shape, 512 in, 128 out, Poisson 32 req/s). py-spy samples the engine-core
# process and the API process for 10 s of a 400-request run; a second run goes unprofiled. Prints each
# process's top frames by own and by inclusive samples, and the share of the engine core's samples spent
# sending step outputs to the API process (docs/benchmarks.md, "Where the serving time goes").
#   bash benchmarks/gpu_serve_profile.sh                       this tree
#   OLD=bench-old.tar.gz bash benchmarks/gpu_serve_profile.sh  this tree, then an older one (as gpu_w1_paired.sh)
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; export OUT
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
python3 -m zipfile -e .gpu/pyspy/*.whl /tmp/pyspy; PYSPY=$(find /tmp/pyspy -name py-spy -type f | head -1); chmod +x $PYSPY
trees=(new)
if [[ -n "${OLD:-}" ]]; then
  rm -rf /tmp/old-tree /tmp/old-site; mkdir -p /tmp/old-tree; tar -xzf "$OLD" -C /tmp/old-tree
  python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/old-site /tmp/old-tree > "$OUT/old-install.log" 2>&1 \
    || { echo "installing the old tree failed"; tail -5 "$OUT/old-install.log"; exit 1; }
  trees+=(old)
fi
port=8011
for tree in "${trees[@]}"; do
  out=$OUT/$tree; mkdir -p "$out"; site=""; [[ $tree == old ]] && site=/tmp/old-site:
  export PYTHONPATH_RUN="$site${PYTHONPATH:-}"
  PYTHONPATH="$PYTHONPATH_RUN" python3 -m kvforge.cli serve --model dummy:llama-3-8b --port $port > "$out/serve.log" 2>&1 &
  spid=$!
  for i in $(seq 1 300); do curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:$port/health 2>/dev/null | grep -q 200 && break; sleep 0.5; done
  core=$(pgrep -f "kvforge.engine" | grep -v "^$spid$" | head -1)  # kvforge.engine.core (kvforge.engine_core before the floors)
  echo "== $tree tree: ready after ~$((i/2)) s; server $spid core $core"
  B=(--base-url http://127.0.0.1:$port --model dummy:llama-3-8b --input-len 512 --output-len 128)
  kvforge bench serve "${B[@]}" --request-rate 32 --num-prompts 100 > /dev/null 2>&1   # warm-up
  ( sleep 3; timeout 20 $PYSPY record -d 10 -r 250 -f raw -o $out/core.raw --nonblocking --pid $core > $out/pyspy-core.log 2>&1 ) &
  p1=$!
  ( sleep 3; timeout 20 $PYSPY record -d 10 -r 250 -f raw -o $out/api.raw --nonblocking --pid $spid > $out/pyspy-api.log 2>&1 ) &
  p2=$!
  kvforge bench serve "${B[@]}" --request-rate 32 --num-prompts 400 --json $out/serve32-profiled.json 2>&1 | grep -v -i warn | tail -3
  wait $p1 $p2
  kvforge bench serve "${B[@]}" --request-rate 32 --num-prompts 400 --json $out/serve32.json 2>&1 | grep -v -i warn | tail -3
  kill $spid; wait $spid 2>/dev/null; sleep 2
done
python3 - "${trees[@]}" <<'PY'
import collections, os, sys
SEND = ("._emit (",)  # EngineCore._emit: building the step-output message, pickling it, the pipe write
for tree in sys.argv[1:]:
    for name in ("core", "api"):
        p = os.path.join(os.environ["OUT"], tree, name + ".raw")
        if not os.path.exists(p):
            print(tree, name, "no profile"); continue
        self_t, incl, total, send = collections.Counter(), collections.Counter(), 0, 0
        for line in open(p):
            stack, _, n = line.rstrip().rpartition(" ")
            n = int(n); total += n
            frames = stack.split(";")
            self_t[frames[-1]] += n
            for f in set(frames):
                incl[f] += n
            if name == "core" and any(s in f and "EngineCore" in f for f in frames for s in SEND):
                send += n
        if name == "core":
            pickle = sum(n for f, n in incl.items() if f.startswith(("ForkingPickler.dumps", "dumps (pickle", "_pickle")))
            print(f"#### {tree} core: {total} samples; sending step outputs (EngineCore._emit) {send / total:.1%}; "
                  f"pickling inside it {pickle / total:.1%}")
        print(f"== {tree} {name}: {total} samples; top self")
        for f, n in self_t.most_common(20):
            print(f"  {n / total:6.1%}  {f[:150]}")
        print(f"== {tree} {name}: top inclusive")
        for f, n in incl.most_common(30):
            print(f"  {n / total:6.1%}  {f[:150]}")
PY
