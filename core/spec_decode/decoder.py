"""The engine's side of speculative decoding: it builds the drafter named by ``speculative_config``,
asks the policy for k each step, has the drafter propose, and feeds step times and acceptance back
to the policy and the counters (docs/speculative.md).

The engine owns one :class:`SpecDecoder` when speculation is configured and calls it at three
points of a step: after scheduling (:meth:`scheduled`), when deciding whether the step may stay in
flight (:meth:`next_num_drafts`), and after applying a step (:meth:`record`, then :meth:`propose`).
Once, before the KV pool is sized, :meth:`attach` hands the drafter the target model; a drafter that
reads hidden states (EAGLE) then gets every step's, from the runner (:meth:`observe_step`).
"""
from __future__ import annotations

import logging
import time
from typing import AbstractSet, Any, cast

import torch

from kvforge.config import EngineConfig, build_options
from kvforge.kv_cache import KVCacheManager
from kvforge.model import hidden_capture
from kvforge.model.config import ModelConfig
from kvforge.model.hidden_capture import HiddenStateCapture
from kvforge.rank.cuda_graphs import MAX_SPEC_GRAPH_TOKENS, capture_sizes
from kvforge.rank.model_runner import ModelRunner
from kvforge.rank.step_handle import StepHandle
from kvforge.rank.step_input import ForwardOutput, StepInput, StepPlan
from kvforge.request import Request
from kvforge.sampler import Sampler
from kvforge.scheduler import SchedulerOutput
from kvforge.spec_decode.drafter import DraftBatch, Drafter, TargetModel
from kvforge.spec_decode.policy import SpecDecodeStats, SpeculationPolicy, SpeculativeConfig
from kvforge.spec_decode.target_states import target_hidden_states

logger = logging.getLogger(__name__)


class SpecDecoder:
    def __init__(self, drafter: Drafter, config: SpeculativeConfig, device: torch.device, block_size: int):
        self.drafter, self.config = drafter, config
        #: the drafter's own KV cache per block (0: none); the block pool is sized with it counted
        self.kv_bytes_per_block = drafter.kv_bytes_per_block(block_size)
        k = config.num_speculative_tokens
        self.stats = SpecDecodeStats(accepted_by_position=[0] * k)
        knee = config.knee_tokens or (256 if device.type == "cuda" else 16)
        self.policy = SpeculationPolicy(k, config.policy, knee)
        self.speculating = False  # the policy asked for drafts for the next step (it runs synchronously)
        self._last_complete: float | None = None  # perf_counter() of the last applied step (step times)
        self._proposed: dict[str, int] = {}  # request id -> drafts the drafter proposed for the step (no fillers)
        self._step_modes: dict[int, bool] = {}  # id(SchedulerOutput) -> whether its step was speculating
        self.capture: HiddenStateCapture | None = None  # the target's captured layers (a drafter that reads them)

    @classmethod
    def build(cls, pm: Any, config: EngineConfig, sampler: Sampler, *, vocab_size: int, device: torch.device,
              dtype: torch.dtype) -> "SpecDecoder | None":
        """The drafter named by ``speculative_config["method"]``, with its validated options; None
        without ``speculative_config``."""
        if config.speculative_config is None:
            return None
        sc = SpeculativeConfig.from_dict(config.speculative_config)
        if type(sampler).target is Sampler.target:
            raise ValueError(f"speculative_config: sampler {config.sampler!r} does not implement target(), "
                             "which verifying drafts needs")
        try:
            drafter_cls = pm.get("drafter", sc.method)
        except ValueError as exc:
            raise ValueError(f"speculative_config: method: {exc}") from None
        options = build_options(drafter_cls, sc.method, sc.drafter_options)
        drafter = drafter_cls(num_speculative_tokens=sc.num_speculative_tokens, vocab_size=vocab_size,
                              device=device, dtype=dtype, block_size=config.block_size, **options)
        logger.info("speculative decoding: %s, k=%d, policy %s", sc.method, sc.num_speculative_tokens, sc.policy)
        return cls(drafter, sc, device, config.block_size)

    def attach(self, runner: ModelRunner, config: EngineConfig, model_config: ModelConfig) -> None:
        """Hand the drafter the driver's target model (``Drafter.bind_target``); if it reads hidden states,
        make the target's forward capture its layers into a buffer of the largest step (a full token
        budget, the largest decode or verification graph) and have the runner pass every step on."""
        model = runner.worker.model
        if model is None:
            raise RuntimeError("speculative decoding: the driver rank holds no model")
        module = cast(torch.nn.Module, model)  # (a RankModel is the loaded CausalLM module)
        layers = tuple(self.drafter.bind_target(TargetModel(module, model_config, config.tensor_parallel_size,
                                                            config.pipeline_parallel_size)))
        if not layers:
            return
        rows = max(config.max_num_batched_tokens, capture_sizes(config.max_num_seqs)[-1], MAX_SPEC_GRAPH_TOKENS)
        self.capture = HiddenStateCapture(layers, num_layers=model_config.num_hidden_layers,
                                          hidden_size=model_config.hidden_size, max_tokens=rows,
                                          dtype=config.torch_dtype, device=runner.device)
        hidden_capture.install(model, self.capture)
        runner.step_observer = self.observe_step

    def observe_step(self, step: StepInput, plan: StepPlan, out: SchedulerOutput, fwd: ForwardOutput,
                     handle: StepHandle) -> None:
        """A step's forward and sampling are queued: its hidden states to the drafter (``Drafter.observe``)."""
        if self.capture is None:
            return
        states = target_hidden_states(step, plan, out.scheduled, fwd, handle, self.capture)
        if states is not None:
            self.drafter.observe(states)

    def shutdown(self) -> None:
        """The engine shuts down: the drafter gives back what it holds, and the capture buffer goes."""
        self.drafter.shutdown()
        self.capture = None

    @property
    def k(self) -> int:
        return self.config.num_speculative_tokens

    def scheduled(self, sched_out: SchedulerOutput) -> None:
        """A step was scheduled: remember its mode, forget the requests that ended."""
        self._step_modes[id(sched_out)] = self.speculating
        self.drafter.release(sched_out.finished_request_ids)
        self.policy.release(sched_out.finished_request_ids)

    def next_num_drafts(self, running: list[Request], driven: AbstractSet[str] = frozenset()) -> int:
        """The policy's k for the next step (0: none, and the step just launched may stay in flight).
        ``driven``: requests whose tokens their caller appends (``Scheduler.driven_ids``): never drafted for."""
        k = self.policy.num_draft_tokens([r.request_id for r in running if r.request_id not in driven])
        self.speculating = k > 0
        return k

    def propose(self, k: int, reqs: list[Request], kv: KVCacheManager, max_model_len: int, pad: bool) -> None:
        """Drafts for the next step: at most ``k`` per decoding request, never past its ``max_tokens``
        or the context length, cut where its grammar would refuse one. ``pad``: verification steps
        replay CUDA graphs, which need k drafts per request."""
        for r in reqs:
            r.clear_drafts()
        if k == 0:
            self.stats.num_steps_without += 1
            return
        ks = [max(0, min(k, r.max_tokens - len(r.output_token_ids) - 1, max_model_len - r.num_tokens - 1))
              for r in reqs]
        if self.kv_bytes_per_block:  # a drafter with its own KV cache writes k - 1 positions ahead
            ks = [kk if kk == 0 or kv.allocate_slots(r, kk) else 0 for r, kk in zip(reqs, ks)]
        proposal = self.drafter.propose(DraftBatch(reqs, ks, [kv.block_table(r.request_id) for r in reqs]))
        probs = proposal.draft_probs or [None] * len(reqs)
        runs = []
        for r, kk, drafts in zip(reqs, ks, proposal.token_ids):
            drafts = list(drafts[:kk])
            if drafts and r.grammar is not None:
                drafts = drafts[:r.grammar.valid_prefix(drafts)]
            runs.append(drafts)
        self._proposed = {r.request_id: len(d) for r, d in zip(reqs, runs)}
        # with CUDA graphs a verification step is uniform only if every request has k drafts: fill short
        # runs up (a filler is verified like any draft, so it costs compute, never correctness). When
        # the drafter found nothing at all, the step is a plain decode step.
        pad = pad and k == self.k and any(runs) and not any(r.grammar is not None for r in reqs)
        for r, kk, drafts, q in zip(reqs, ks, runs, probs):
            if not drafts and not pad:  # nothing to verify: the drafter's miss counts as a rejection
                self.policy.observe(r.request_id, 0, 0)
            n = len(drafts)
            if pad and n < kk:
                drafts = drafts + [drafts[-1] if drafts else r.all_token_ids[-1]] * (kk - n)
            r.draft_token_ids = drafts
            r.draft_probs = q[:n] if q is not None and n else None

    def record(self, sched_out: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """A step was applied: its wall time (decode-only steps) to the policy, and its acceptance."""
        now = time.perf_counter()
        last, self._last_complete = self._last_complete, now
        drafts = sched_out.draft_token_ids
        # the step's mode is what the policy decided for it (a speculating step runs synchronously and
        # pays for the drafter even when the drafter found nothing)
        speculating = self._step_modes.pop(id(sched_out), bool(drafts))
        if last is not None and sched_out.scheduled and all(
                sched_out.num_scheduled_tokens[r.request_id] == 1 + len(drafts.get(r.request_id, ()))
                for r in sched_out.scheduled):
            self.policy.record_step(len(sched_out.scheduled), speculating, now - last)
        if not drafts:
            return
        self.stats.num_steps += 1
        for rid, d in drafts.items():
            tokens = sampled.get(rid)
            if tokens is not None:
                proposed = self._proposed.get(rid, len(d))  # the rest are fillers (see propose)
                accepted = min(len(tokens) - 1, proposed)
                if proposed:
                    self.stats.record(proposed, accepted)
                self.policy.observe(rid, proposed, accepted)
