"""docs/server.md lists every request field kvforge honours and every one it refuses; these tests hold
those tables to the request models, so the doc cannot drift from the code again."""
import re
from pathlib import Path

from kvforge.server.protocol import REFUSED, WITHOUT_EFFECT, ChatCompletionRequest, CompletionRequest
from testing_support import doc_field_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "server.md"


def table(marker: str) -> list[str]:
    return doc_field_table(DOC, marker)


def fields(model) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


def test_the_refused_table_is_the_refused_fields():
    assert table("refused") == list(REFUSED)


def test_the_without_effect_table_is_the_fields_accepted_without_effect():
    assert table("without-effect") == list(WITHOUT_EFFECT)


def test_chat_fields_are_documented_as_honoured_or_refused():
    documented = table("sampling") + table("chat") + table("without-effect")
    assert len(documented) == len(set(documented))
    assert set(documented) == fields(ChatCompletionRequest) - set(REFUSED)
    assert fields(ChatCompletionRequest) & set(REFUSED) <= set(table("refused"))


def test_completion_fields_are_documented_as_honoured_or_refused():
    documented = table("sampling") + table("completions") + table("without-effect")
    assert set(documented) == fields(CompletionRequest) - set(REFUSED)
    assert fields(CompletionRequest) & set(REFUSED) == set(REFUSED)  # suffix too


def test_the_flag_table_lists_every_serve_flag():
    import argparse

    from kvforge.cli import add_engine_args
    from kvforge.server.cli import add_serve_parser

    def flags(parser: argparse.ArgumentParser) -> set[str]:
        return {s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}

    subparsers = argparse.ArgumentParser().add_subparsers()
    add_serve_parser(subparsers)
    engine = argparse.ArgumentParser()
    add_engine_args(engine, model_flag=False)  # documented in configuration.md (tests/test_docs.py)
    own = flags(subparsers.choices["serve"]) - flags(engine)
    lines = DOC.read_text().splitlines()
    start = lines.index("<!-- flags: serve -->")
    rows = []
    for line in lines[start + 1:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    documented = [f for row in rows[2:] for f in re.findall(r"`(--[a-z-]+)`", row.split("|")[1])]
    assert len(documented) == len(set(documented)), "a flag is listed twice"
    assert set(documented) == own, f"missing {sorted(own - set(documented))}, not flags {sorted(set(documented) - own)}"
