"""examples/ray_data_batch.py runs as written on the default model (CPU, a local Ray started by the
example) and returns every prompt's text: the text one kvforge engine generates for it."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvforge import SamplingParams

pytest.importorskip("ray.data")
ROOT = Path(__file__).resolve().parents[2]


def test_ray_data_example_returns_every_prompt_text(default_llm):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from ray_data_batch import PROMPTS
    finally:
        sys.path.pop(0)
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "ray_data_batch.py"), "--device", "cpu",
                          "--max-tokens", "8", "--replicas", "2",
                          # 0.5 GiB per replica, as default_llm (the CPU default zero-fills up to 4 GiB each)
                          "--kv-cache-memory-gib", "0.5"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    got = {r["prompt"]: r["generated_text"] for r in rows}
    assert len(rows) == len(PROMPTS) and set(got) == set(PROMPTS)
    # one engine: conftest's shared default-model engine (built once for the session)
    ref = default_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert got == {o.prompt: o.outputs[0].text for o in ref}
