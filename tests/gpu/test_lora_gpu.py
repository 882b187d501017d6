"""LoRA on the GPU with the real default model: CUDA graphs replay the LoRA kernels and give the tokens eager
steps give, for a batch mixing two adapters and the base model; the base model's requests are unchanged by
LoRA being on."""
import pytest
import torch

from kvforge import LLM, LoRARequest, SamplingParams
from kvforge.bench.lora_adapters import write_adapter
from kvforge.model.loader import load_model_config, resolve_model_source

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = ["The capital of France is", "def quicksort(xs):", "Once upon a time", "SELECT * FROM", "Water boils at",
           "The largest planet is"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
#: a fixed KV pool: three engines live in this process one after another, and a profiled pool would count the
#: memory an earlier one still holds against the next
ENGINE = {"dtype": "float32", "max_num_seqs": 16, "max_model_len": 256, "num_gpu_blocks_override": 512}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    mc = load_model_config(resolve_model_source(None, "auto"))
    root = tmp_path_factory.mktemp("loras")
    return [LoRARequest(f"a{i}", i + 1, _write(str(root / f"a{i}"), mc, 8 * (i + 1), i)) for i in range(2)]


def _write(path, mc, rank, seed):
    write_adapter(path, mc, rank, 4 * rank, seed, "SmolLM2-135M-Instruct")
    return path


def _run(adapters, **kwargs):
    llm = LLM(None, enable_lora=True, max_loras=2, **ENGINE, **kwargs)
    loras = [None, adapters[0], adapters[1]] * 2
    outs = llm.generate(PROMPTS, GREEDY, lora_request=loras, use_tqdm=False)
    graphs = llm.llm_engine.runner.graphs
    replays = sum(graphs.replays.values()) if graphs is not None else 0
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], replays


def test_cuda_graphs_with_lora_match_eager_steps(adapters):
    eager, _ = _run(adapters, enforce_eager=True)
    graphed, replays = _run(adapters)
    assert replays > 0  # the decode steps did replay graphs, LoRA kernels inside
    assert graphed == eager
    plain = LLM(None, **ENGINE)
    base = [list(o.outputs[0].token_ids) for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert [eager[i] for i in (0, 3)] == [base[i] for i in (0, 3)]  # the base model's rows are untouched
    assert eager[1] != base[1] or eager[4] != base[4]  # and the adapters do change theirs
