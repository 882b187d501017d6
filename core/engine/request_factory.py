"""Turns a prompt and its sampling parameters into what the engine runs: one ``Request`` per sample
(``n``), and the ``ParentState`` the output processor gathers them under.

Every field is checked here (``ValueError`` naming it), and no scheduler state is touched, so a front
end calls it off the engine's thread (``LLMEngine.process_inputs``) and queues the result on it
(``LLMEngine.add_processed``).
"""
from __future__ import annotations

import itertools
import time
from typing import Any

from kvforge.config import EngineConfig
from kvforge.engine.input_checks import bad_words_token_ids, check_request, tokenize_prompt
from kvforge.engine.output_processor import ParentState
from kvforge.engine.structured_output import StructuredOutputManager
from kvforge.lora.registry import check_lora_request
from kvforge.lora.request import LoRARequest
from kvforge.model.config import ModelConfig
from kvforge.model.interface import capabilities_of
from kvforge.multimodal.inputs import MultiModalProcessor, parse_multi_modal_data
from kvforge.outputs import RequestMetrics
from kvforge.plugin_manager import PluginManager
from kvforge.request import Request
from kvforge.sampling_params import SamplingParams


class RequestFactory:
    """The engine's requests, made from prompts under its config, model and context length."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, tokenizer: Any,
                 plugin_manager: PluginManager, *, max_model_len: int, eos_token_ids: tuple[int, ...],
                 model_dir: str | None = None):
        self.config, self.model_config, self.tokenizer = config, model_config, tokenizer
        self.plugin_manager = plugin_manager
        self.model_dir = model_dir  # a multimodal checkpoint's directory (its image processor's config)
        self._processor: MultiModalProcessor | None = None
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self._structured: StructuredOutputManager | None = None
        self._ids = itertools.count()  # ids of requests that come without one

    def processor(self) -> MultiModalProcessor:
        """The model's multimodal processor (made on first use); ``ValueError`` naming
        ``multi_modal_data`` for a text-only model."""
        if self._processor is None:
            cls = self.plugin_manager.get("model", self.model_config.architecture)
            if not capabilities_of(cls).modalities:
                raise ValueError("multi_modal_data: this model takes no images (text only)")
            processor: MultiModalProcessor = cls.processor(self.model_config, self.model_dir)
            self._processor = processor
            return processor
        return self._processor

    def multimodal(self, ids: list[int], data: Any) -> tuple[list[int], tuple]:
        """A prompt's ids with its items' placeholders expanded, and the items' features."""
        processor = self.processor()
        limits = {m: 1 for m in processor.modalities} | dict(self.config.limit_mm_per_prompt or {})
        processed = processor.process(ids, parse_multi_modal_data(data, processor.modalities, limits))
        budget = self.config.max_num_batched_tokens
        for i, f in enumerate(processed.features):
            if f.bidirectional and budget is not None and f.length > budget:  # one chunk must take it whole
                raise ValueError(f"multi_modal_data: {f.modality} {i} takes {f.length} positions, more than "
                                 f"max_num_batched_tokens ({budget}); its rows attend to each other, so one "
                                 "step must compute them all")
        return processed.prompt_token_ids, processed.features

    def tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt; ``ValueError`` naming the field."""
        return tokenize_prompt(self.tokenizer, prompt)

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """The grammar compiler and cache (made on first use: most engines never need it)."""
        if self._structured is None:
            self._structured = StructuredOutputManager(
                self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                timeout=self.config.grammar_compile_timeout, cache_size=self.config.grammar_cache_size)
        return self._structured

    def make(self, request_id: str | None, prompt: str | list[int] | dict, params: SamplingParams | None = None, *,
             arrival_time: float | None = None, priority: int = 0, stream_deltas: bool = False,
             final_only: bool = False, lora_request: LoRARequest | None = None) -> tuple[ParentState, list[Request]]:
        """Tokenize and validate a request; ``LLMEngine.process_inputs`` documents the arguments."""
        if params is not None and not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        params = params.clone() if params is not None else SamplingParams()
        text, ids = self.tokenize(prompt)
        features: tuple = ()
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            ids, features = self.multimodal(ids, prompt["multi_modal_data"])
        check_request(ids, params, config=self.config, vocab_size=self.model_config.vocab_size,
                      max_model_len=self.max_model_len, tokenizer=self.tokenizer,
                      logits_processors=self.plugin_manager.names("logits_processor"),
                      plugin_manager=self.plugin_manager)
        lora_request = check_lora_request(self.config, lora_request)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        room = self.max_model_len - len(ids)
        params._eos_token_ids = () if params.ignore_eos else self.eos_token_ids
        parent = ParentState(request_id, text, ids, stream_deltas, RequestMetrics(arrival_time=time.time()),
                             final_only=final_only)
        children: list[Request] = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                child_params = params.clone()
                child_params._eos_token_ids = params._eos_token_ids
                if params.seed is not None:
                    child_params.seed = params.seed + i
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(rid, ids, child_params, prompt=text, priority=priority,
                          max_tokens=min(params.max_tokens or room, room), lora_request=lora_request,
                          mm_features=features)
            if params.bad_words:
                req.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
            if params.structured_outputs is not None:
                req.grammar = self.structured_outputs.state(params.structured_outputs)
            if arrival_time is not None:
                req.arrival_time = arrival_time
            if children:
                req.fork_of = children[0]
                children[0].forks.append(req)
            children.append(req)
        return parent, children
