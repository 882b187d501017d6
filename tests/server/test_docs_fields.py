"""docs/server.md lists every request field kvforge honours and every one it refuses; these tests hold
those tables to the request models, so the doc cannot drift from the code again."""
import re
from pathlib import Path

from kvforge.server.protocol import REFUSED, ChatCompletionRequest, CompletionRequest

DOC = Path(__file__).resolve().parents[2] / "docs" / "server.md"


def table(marker: str) -> list[str]:
    lines = DOC.read_text().splitlines()
    start = lines.index(f"<!-- fields: {marker} -->")
    rows = []
    for line in lines[start + 1:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return [name for row in rows[2:] for name in re.findall(r"`(\w+)`", row.split("|")[1])]


def fields(model) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


def test_the_refused_table_is_the_refused_fields():
    assert table("refused") == list(REFUSED)


def test_chat_fields_are_documented_as_honoured_or_refused():
    documented = table("sampling") + table("chat")
    assert len(documented) == len(set(documented))
    assert set(documented) == fields(ChatCompletionRequest) - set(REFUSED)
    assert fields(ChatCompletionRequest) & set(REFUSED) <= set(table("refused"))


def test_completion_fields_are_documented_as_honoured_or_refused():
    documented = table("sampling") + table("completions")
    assert set(documented) == fields(CompletionRequest) - set(REFUSED)
    assert fields(CompletionRequest) & set(REFUSED) == set(REFUSED)  # suffix too
