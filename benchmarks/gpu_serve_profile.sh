#!/usr/bin/env bash
# On the GPU machine, after `source .gpu/install.sh` (base group) with py-spy's wheel in .gpu/pyspy
# (`pip download py-spy --no-deps --only-binary=:all: --platform manylinux2014_x86_64 --python-version 3
# --implementation py --abi none -d .gpu/pyspy`): the host profile of `kvforge serve` under the issue-14
# serving load (Llama-3-8B shape, 512 in, 128 out, Poisson 32 req/s). py-spy samples the engine-core
# process and the API process for 10 s of a 400-request run; a second run goes unprofiled. Prints each
# process's top frames by own and by inclusive samples (docs/benchmarks.md, "Where the serving time goes").
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; export OUT
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
python3 -m zipfile -e .gpu/pyspy/*.whl /tmp/pyspy; PYSPY=$(find /tmp/pyspy -name py-spy -type f | head -1); chmod +x $PYSPY; echo $PYSPY
out=$OUT; port=8011
kvforge serve --model dummy:llama-3-8b --port $port > /tmp/serve.log 2>&1 &
spid=$!
for i in $(seq 1 300); do curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:$port/health 2>/dev/null | grep -q 200 && break; sleep 0.5; done
echo "ready after ~$((i/2)) s"
core=$(pgrep -f "kvforge.engine.core" | head -1); echo "server $spid core $core"
B=(--base-url http://127.0.0.1:$port --model dummy:llama-3-8b --input-len 512 --output-len 128)
kvforge bench serve "${B[@]}" --request-rate 32 --num-prompts 100 > /dev/null 2>&1   # warm-up
( sleep 3; timeout 20 $PYSPY record -d 10 -r 250 -f raw -o $out/core.raw --nonblocking --pid $core > /tmp/pyspy-core.log 2>&1 ) &
p1=$!
( sleep 3; timeout 20 $PYSPY record -d 10 -r 250 -f raw -o $out/api.raw --nonblocking --pid $spid > /tmp/pyspy-api.log 2>&1 ) &
p2=$!
kvforge bench serve "${B[@]}" --request-rate 32 --num-prompts 400 --json $out/serve32-profiled.json 2>&1 | grep -v -i warn | tail -3
wait $p1 $p2
tail -n 3 /tmp/pyspy-core.log /tmp/pyspy-api.log
kvforge bench serve "${B[@]}" --request-rate 32 --num-prompts 400 --json $out/serve32.json 2>&1 | grep -v -i warn | tail -3
kill $spid
python3 - <<'PY'
import collections, os
for name in ("core", "api"):
    p = os.path.join(os.environ["OUT"], name + ".raw")
    if not os.path.exists(p):
        print(name, "no profile"); continue
    self_t, incl, total = collections.Counter(), collections.Counter(), 0
    for line in open(p):
        stack, _, n = line.rstrip().rpartition(" ")
        n = int(n); total += n
        frames = stack.split(";")
        self_t[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    print(f"== {name}: {total} samples; top self")
    for f, n in self_t.most_common(25):
        print(f"  {n / total:6.1%}  {f[:150]}")
    print(f"== {name}: top inclusive")
    for f, n in incl.most_common(40):
        print(f"  {n / total:6.1%}  {f[:150]}")
PY
