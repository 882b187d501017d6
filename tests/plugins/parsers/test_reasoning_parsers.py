"""The built-in reasoning parsers on fixed model outputs, and the streaming invariant on every split of them."""
import random

import pytest

from kvforge.tool_parsing import ReasoningParser, get_reasoning_parser

# (parser, model output, expected reasoning_content, expected content)
CASES = [
    ("deepseek_r1", "<think>\nLet me think.\n</think>\n\nThe answer is 4.", "\nLet me think.\n", "\n\nThe answer is 4."),
    ("deepseek_r1", "Let me think: 2+2 (ü).</think>Answer: 4", "Let me think: 2+2 (ü).", "Answer: 4"),
    ("deepseek_r1", "Still thinking <thin...", "Still thinking <thin...", None),
    ("deepseek_r1", "</think>Just the answer", None, "Just the answer"),
    ("deepseek_r1", "<think>\n\n</think>\n\n", None, None),
    ("deepseek_r1", "  <think>x</think>y", "x", "y"),
    ("deepseek_r1", "<thinking aloud</think>done", "<thinking aloud", "done"),
    ("deepseek_r1", "r</think>a</think>b<think>c", "r", "a</think>b<think>c"),
    ("deepseek_r1", "", None, None),
    ("qwen3", "<think>\nreason\n</think>\n\nanswer", "\nreason\n", "\n\nanswer"),
    ("qwen3", "No thinking here, a < b and </think> too.", None, "No thinking here, a < b and </think> too."),
    ("qwen3", "<think>unfinished reasoning", "unfinished reasoning", None),
    ("qwen3", "before <think>r</think> after", "r", "before  after"),
    ("qwen3", "<think>\n\n</think>\n\nHi", None, "\n\nHi"),
    ("qwen3", "<think>a<think>b</think>c<think>d</think>", "a<think>b", "c<think>d</think>"),
]


def splits(text, seed=0):
    """Every split into two chunks, char by char, and a few random chunkings."""
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(10):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def stream(parser_cls, chunks):
    parser = parser_cls()
    pieces = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    return "".join(r for r, _ in pieces), "".join(c for _, c in pieces)


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_parse_finds_the_expected_reasoning_and_content(name, text, reasoning, content):
    assert get_reasoning_parser(name)().parse(text) == (reasoning, content)


@pytest.mark.parametrize("name,text", [(p, t) for p, t, _, _ in CASES if len(t) > 1])
def test_every_split_streams_exactly_what_parse_finds(name, text):
    cls = get_reasoning_parser(name)
    reasoning, content = cls().parse(text)
    for chunks in splits(text):
        assert stream(cls, chunks) == (reasoning or "", content or ""), chunks


def test_text_streams_out_at_once_unless_it_may_be_a_tag():
    deepseek = get_reasoning_parser("deepseek_r1")()
    assert deepseek.feed("<th") == ("", "")  # may be the leading <think>
    assert deepseek.feed("ink>Hmm, ") == ("Hmm, ", "")
    assert deepseek.feed("so</thi") == ("so", "")
    assert deepseek.feed("nk>\n") == ("", "")  # blank content so far: it may stay None
    assert deepseek.feed("4") == ("", "\n4")
    assert get_reasoning_parser("deepseek_r1")().feed("Hello") == ("Hello", "")
    qwen = get_reasoning_parser("qwen3")()
    assert qwen.feed("Hello <") == ("", "Hello ")
    assert qwen.feed("b>") == ("", "<b>")
    assert qwen.finish() == ("", "")


def test_unknown_parser_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown reasoning_parser 'nope'; valid names: deepseek_r1, qwen3"):
        get_reasoning_parser("nope")


def test_the_base_class_is_all_content():
    assert ReasoningParser().parse("<think>a</think>b") == (None, "<think>a</think>b")
