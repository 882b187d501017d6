"""`kvforge serve --speculative-config`: the same greedy answers as without speculation, several tokens
per streamed delta, and the speculative counters in /metrics (docs/server.md's metrics table)."""
import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from conftest import API_KEY, ServerProcess, metric, wait_idle

DOC = Path(__file__).resolve().parents[2] / "docs" / "server.md"
PROMPTS = ["one two three one two three one two", "a b a b a b a b a b", "The cat sat. The cat sat. The cat"]


def _client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)


def test_streamed_greedy_completions_match_the_server_without_speculation(server, spec_server):
    kw = dict(max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True},
              extra_body={"ignore_eos": True})
    deltas_with_several = 0
    for prompt in PROMPTS:
        texts = []
        for s in (server, spec_server):
            chunks = list(_client(s).completions.create(model=_client(s).models.list().data[0].id, prompt=prompt,
                                                        **kw))
            assert chunks[-1].usage.completion_tokens == 24
            texts.append("".join(c.choices[0].text for c in chunks if c.choices))
            if s is spec_server:
                deltas_with_several += sum(1 for c in chunks if c.choices) < 24
        assert texts[0] == texts[1]
    assert deltas_with_several  # some stream carried accepted drafts: fewer deltas than tokens
    assert metric(spec_server, "kvforge:spec_decode_num_accepted_tokens_total") > 0
    assert wait_idle(spec_server) == {k: 0 for k in wait_idle(spec_server)}


def test_the_metrics_table_lists_every_metric_exposed(spec_server):
    text = httpx.get(f"{spec_server.url}/metrics").text
    # every family has a TYPE line, also one with no series yet (waiting_by_priority when nothing waits)
    # (a counter's family is typed with its _total sample name; _created samples are not families)
    exposed = {re.sub(r"_total$", "", name) for name in re.findall(r"^# TYPE (kvforge:\S+) ", text, flags=re.M)
               if not name.endswith("_created")}
    doc = DOC.read_text()
    table = doc[doc.index("| metric | type | meaning |"):]
    table = table[:table.index("\n\n")]
    documented = set(re.findall(r"^\| `(kvforge:[a-z0-9_]+)` \|", table, flags=re.M))
    # exposed only with --data-parallel-size > 1 (tests/server/test_data_parallel_server.py checks it)
    documented -= {"kvforge:data_parallel_requests"}
    assert documented == exposed, (f"missing from the doc {sorted(exposed - documented)}, "
                                   f"not exposed {sorted(documented - exposed)}")


def test_a_bad_speculative_config_stops_serve_with_the_reason():
    with pytest.raises(RuntimeError, match="unknown drafter 'nope'"):
        ServerProcess("--speculative-config", json.dumps({"method": "nope", "num_speculative_tokens": 2}))
