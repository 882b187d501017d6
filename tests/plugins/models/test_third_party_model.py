"""A model architecture added by a third-party package (the dummy plugin's Granite, the template of
docs/adding_a_model.md): registered by name, listed by `kvforge models`, and token for token transformers'."""
import json
import subprocess
import sys

import torch
import transformers

from kvforge import LLM, SamplingParams


@torch.no_grad()
def greedy(hf, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_third_party_granite_equals_transformers(dummy_plugin_installed, tmp_path, check_no_blocks):
    config = transformers.GraniteConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        embedding_multiplier=6.0, attention_multiplier=0.2, residual_multiplier=0.3,
                                        logits_scaling=4.0, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    hf = transformers.GraniteForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 19, 40, 33)]
    llm = LLM(model=str(tmp_path), device="cpu", dtype="float32", max_num_batched_tokens=32)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [greedy(hf, p, 16) for p in prompts]
    check_no_blocks(llm.llm_engine)
    # the hidden-state hook (EAGLE heads read it) is inherited from LlamaForCausalLM: transformers' states too
    from kvforge.model.hidden_capture import HiddenStateCapture, install
    from kvforge.rank.cuda_graphs import uniform_layout

    worker, T = llm.llm_engine.runner.worker, len(prompts[2])
    capture = HiddenStateCapture(range(3), num_layers=2, hidden_size=64, max_tokens=T, dtype=torch.float32, device="cpu")
    install(worker.model, capture)
    layout = uniform_layout(1, T, 4, seq_lens=torch.tensor([T], dtype=torch.int32).numpy(),
                            block_tables=torch.arange(4, dtype=torch.int32)[None].numpy(),
                            slots=torch.arange(T).numpy())
    with torch.inference_mode():
        worker.model(torch.tensor(prompts[2]), torch.arange(T), worker.kv_caches, worker.attn.build_metadata(layout))
    install(worker.model, None)
    ref = hf(torch.tensor([prompts[2]]), output_hidden_states=True).hidden_states
    for i in range(3):
        torch.testing.assert_close(capture.rows(T)[:, 64 * i:64 * (i + 1)], ref[i][0], atol=2e-4, rtol=2e-4)


def test_kvforge_models_lists_the_third_party_architecture(dummy_plugin_installed):
    out = subprocess.run([sys.executable, "-m", "kvforge.cli", "models", "--json"], capture_output=True, text=True,
                         check=True).stdout
    rows = {r["architecture"]: r for r in json.loads(out)}
    assert rows["GraniteForCausalLM"]["plugin"] == "dummy"
    assert rows["GraniteForCausalLM"]["class"] == "kvforge_dummy_plugin.granite:GraniteForCausalLM"
    assert rows["LlamaForCausalLM"]["sliding_window"] is True and rows["MixtralForCausalLM"]["moe"] is True


def test_a_model_class_adds_the_attention_features_its_config_cannot_say():
    """A third-party model with sinks (or a soft cap) in a config kvforge does not know declares them, so
    that backend selection honours them: the class's features join the config's."""
    from kvforge.model.config import ModelConfig
    from kvforge.model.interface import attention_features

    class WithSinks:
        @classmethod
        def attention_features(cls, config):
            return {"attention_sinks"}

    mc = ModelConfig.from_preset("tiny")
    assert attention_features(WithSinks, mc) == {"attention_sinks"}
    assert attention_features(object, mc) == frozenset()
    windowed = ModelConfig(**{**mc.to_dict(), "sliding_window": 8})
    assert attention_features(WithSinks, windowed) == {"attention_sinks", "sliding_window"}


def test_third_party_siglip_llava_takes_images_and_equals_transformers(dummy_plugin_installed, tmp_path):
    """The multimodal contract from a package: the dummy plugin's LLaVA with a SigLIP tower gives
    transformers' greedy tokens for prompts with 0, 1 and 2 images, whole and split across chunks."""
    import numpy as np
    from PIL import Image

    text = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                    bos_token_id=None, eos_token_id=None, pad_token_id=None)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                             num_attention_heads=4, image_size=28, patch_size=14)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=100,
                                      vision_feature_layer=-1, vision_feature_select_strategy="full")
    torch.manual_seed(0)
    hf = transformers.LlavaForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(tmp_path)
    processor = transformers.SiglipImageProcessor(size={"height": 28, "width": 28})
    processor.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"architectures": ["SiglipLlavaForConditionalGeneration"]}))
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ((40, 60), (30, 30))]
    cases = [([5, 100, 6, 7], images[:1]), ([8, 100, 9, 100, 10], images), ([11, 12, 13], [])]

    def reference(ids, imgs):  # transformers: each placeholder expanded to the 4 patches' rows
        expanded = [t for i in ids for t in ([100] * 4 if i == 100 else [i])]
        kw = {"pixel_values": processor(images=imgs, return_tensors="pt")["pixel_values"]} if imgs else {}
        with torch.no_grad():
            out = hf.generate(torch.tensor([expanded]), max_new_tokens=8, do_sample=False, **kw)
        return out[0, len(expanded):].tolist()

    for budget in (256, 3):
        llm = LLM(model=str(tmp_path), device="cpu", max_num_batched_tokens=budget, limit_mm_per_prompt={"image": 2},
                  num_gpu_blocks_override=32, max_model_len=128)
        outs = llm.generate([{"prompt_token_ids": ids, **({"multi_modal_data": {"image": imgs}} if imgs else {})}
                             for ids, imgs in cases], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [reference(ids, imgs) for ids, imgs in cases], budget
