"""The built-in tool-call parsers on fixed model outputs, and the streaming invariant on every split of them."""
import json
import random
import types

import pytest

import kvforge
from kvforge.plugin_manager import get_plugin_manager
from kvforge.tool_parsing import ToolParser, get_tool_parser

WEATHER = ("get_weather", {"city": "Paris"})
NESTED = ("search", {"query": 'café "best" 東京 \\ ok', "filters": {"tags": ["a", "b"], "limit": 3, "exact": True,
                                                                    "near": None, "score": -1.5}})
NESTED_JSON = json.dumps(NESTED[1])  # ASCII-escaped on purpose: parsers normalise to ensure_ascii=False

# (parser, model output, expected content, expected calls as (name, arguments dict))
CASES = [
    ("hermes", "Hello, how can I help? a < b, <tool> and </tool_call> are text.", None, []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "", [WEATHER]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_time", "arguments": {}}\n</tool_call>\n', "", [WEATHER, ("get_time", {})]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.\n", [WEATHER]),
    ("hermes", f'<tool_call>{{"name": "search", "arguments": {NESTED_JSON}}}</tool_call> Done.', " Done.", [NESTED]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [("f", {"x": 1})]),
    ("hermes", 'A <tool_call>{"name": "f", "arguments": {bad}}</tool_call> B', None, []),
    ("hermes", '<tool_call>{"arguments": {"x": 1}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>',
     '<tool_call>{"arguments": {"x": 1}}</tool_call>', [("g", {})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "", [WEATHER]),  # unclosed
    ("hermes", 'Sure <tool_call>\n{"name": "f", "argu', None, []),
    ("llama3_json", "The weather is sunny {today}.", None, []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [WEATHER]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    f'{{"name": "search", "arguments": {NESTED_JSON}}}', "", [WEATHER, NESTED]),
    ("llama3_json", '  {"answer": 42}', None, []),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}} and some text', None, []),
    ("llama3_json", '{"name": "f", "parameters": {"x": ', None, []),
    ("llama3_json", '<|python_tag|>print("hi")', None, []),
    ("mistral", "Plain [text] with [TOOL brackets.", None, []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [WEATHER]),
    ("mistral", f'Sure.[TOOL_CALLS] [{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}, '
                f'{{"name": "search", "arguments": {NESTED_JSON}}}]', "Sure.", [WEATHER, NESTED]),
    ("mistral", f'[TOOL_CALLS]get_weather[ARGS]{{"city": "Paris"}}[TOOL_CALLS]search[ARGS]{NESTED_JSON}', "",
     [WEATHER, NESTED]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {bad}}]', None, []),
    ("mistral", '[TOOL_CALLS][{"foo": 1}] then [TOOL_CALLS]get_time[ARGS]{}', '[TOOL_CALLS][{"foo": 1}] then ',
     [("get_time", {})]),
    ("mistral", '[TOOL_CALLS]bad name[ARGS]{"x": 1}', None, []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par', None, []),  # unclosed
    ("pythonic", "[1] See the reference above.", None, []),
    ("pythonic", '[get_weather(city="Paris")]', "", [WEATHER]),
    ("pythonic", '<|python_start|>[get_weather(city="Paris"), search(query=\'café "best" 東京 \\\\ ok\', '
                 'filters={"tags": ["a", "b"], "limit": 3, "exact": True, "near": None, "score": -1.5})]<|python_end|>',
     "", [WEATHER, NESTED]),
    ("pythonic", '[get_time()]\n', "", [("get_time", {})]),
    ("pythonic", '[f(x=g())]', None, []),
    ("pythonic", '[f(1)]', None, []),
    ("pythonic", '[f(x=(1, 2))]', None, []),
    ("pythonic", '[f(x=1)] and text', None, []),
    ("pythonic", '[get_weather(city="Par', None, []),  # unclosed
]
CASES = [(p, t, t if c is None else (c or None), calls) for p, t, c, calls in CASES]  # None: all of it is content


def stream(parser_cls, chunks):
    """Feed ``chunks`` in order, then finish; the streamed content and calls, checking the deltas' shape."""
    parser = parser_cls()
    deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    names, arguments = {}, {}
    for delta in deltas:
        for piece in delta.tool_calls:
            if piece.name is not None:
                assert piece.index not in names, f"call {piece.index} named twice"
                names[piece.index] = piece.name
            arguments[piece.index] = arguments.get(piece.index, "") + piece.arguments
    assert sorted(names) == sorted(arguments) == list(range(len(arguments)))
    return "".join(d.content for d in deltas), [(names[i], arguments[i]) for i in range(len(names))]


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


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parse_finds_the_expected_content_and_calls(name, text, content, calls):
    parsed = get_tool_parser(name)().parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    for call in parsed.calls:  # normalised text, not the model's spacing or escapes
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)


@pytest.mark.parametrize("name,text", [(p, t) for p, t, _, _ in CASES])
def test_every_split_streams_exactly_what_parse_finds(name, text):
    cls = get_tool_parser(name)
    parsed = cls().parse(text)
    expected = (parsed.content or "", [(c.name, c.arguments) for c in parsed.calls])
    for chunks in splits(text):
        assert stream(cls, chunks) == expected, chunks


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_plain_content_streams_out_at_once(name):
    parser = get_tool_parser(name)()
    assert parser.feed("Hello").content == "Hello"
    assert parser.feed(", world").content == ", world"
    assert parser.finish().content == ""


def test_only_a_possible_marker_is_held_back():
    parser = get_tool_parser("hermes")()
    assert parser.feed("\n").content == ""  # whitespace alone may stay None: it waits for more
    assert parser.feed("Hi <tool").content == "\nHi "
    assert parser.feed("bar> x").content == "<toolbar> x"
    delta = parser.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>y')
    assert (delta.content, delta.tool_calls[0].name, delta.tool_calls[0].arguments) == ("y", "f", "{}")
    mistral = get_tool_parser("mistral")()
    assert mistral.feed("a [TOOL_").content == "a "
    assert mistral.feed("CALLS]").content == ""
    assert get_tool_parser("pythonic")().feed("[1").content == "[1"  # cannot open a call list
    assert get_tool_parser("pythonic")().feed("[get_").content == ""


def test_parse_never_raises_on_odd_text():
    odd = ["", " ", "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[TOOL_CALLS][ARGS]", "[" * 5000, "{" * 5000,
           "<|python_tag|>", "[f(x=1e999)]", "[f(**k)]", "\x00", "[TOOL_CALLS]f[ARGS]1", '{"name": "f", "parameters": []}']
    for name in ["hermes", "llama3_json", "mistral", "pythonic"]:
        for text in odd:
            parsed = get_tool_parser(name)().parse(text)
            assert parsed.calls == [] and parsed.content == (text if text.strip() else None)


def test_unknown_parser_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown tool_parser 'nope'; valid names: (dummy_xml, )?hermes, llama3_json, mistral, "
                                         "pythonic"):
        get_tool_parser("nope")


def test_a_registered_class_must_subclass_the_contract():
    pm = get_plugin_manager()
    plugin = types.ModuleType("fake_parsers")
    plugin.register_tool_parsers = kvforge.hookimpl(lambda register: register("not_a_parser", dict))
    pm.register(plugin, "fake_parsers")
    try:
        with pytest.raises(TypeError, match="tool_parser 'not_a_parser' from plugin 'fake_parsers' .* not a subclass"):
            get_tool_parser("not_a_parser")
    finally:
        pm.unregister("fake_parsers")


def test_the_base_class_is_all_content():
    parsed = ToolParser().parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert parsed.calls == [] and parsed.content.startswith("<tool_call>")


def test_third_party_tool_parser(dummy_plugin_installed):
    cls = get_tool_parser("dummy_xml")
    assert issubclass(cls, ToolParser) and cls.__module__ == "kvforge_dummy_plugin.tool_parser"
    text = 'Sure. <call name="get_weather">{"city": "Paris"}</call><call name="x">{bad}</call>'
    parsed = cls().parse(text)
    assert parsed.content == 'Sure. <call name="x">{bad}</call>'
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", '{"city": "Paris"}')]
    for chunks in splits(text):
        assert stream(cls, chunks) == (parsed.content, [("get_weather", '{"city": "Paris"}')])
