"""``ModelRunner``: the driver's side of a step: hands it to the executor's workers, then samples.

The workers (``kvforge.rank.worker``, through ``kvforge.rank.executor``) run the forward and compute the
logits of the sampled rows; the runner turns them into tokens with the sampler and the rejection
sampler, in the engine process, where the requests live (docs/distributed.md).
"""
from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from kvforge.attention import AttentionBackend
from kvforge.errors import RequestFailure, is_device_error
from kvforge.kv_cache import KVCacheManager
from kvforge.model.interface import capabilities_of
from kvforge.multimodal.encoder_cache import reaches_placeholders
from kvforge.rank.cuda_graphs import CUDAGraphRunner
from kvforge.rank.executor import Executor
from kvforge.rank.input_buffers import h2d
from kvforge.rank.model_build import RankModel
from kvforge.rank.step_handle import StepHandle, logprob_tensors
from kvforge.rank.step_input import ForwardOutput, StepInput, StepInputBuilder, StepPlan
from kvforge.rank.swap import CPUSwapSpace
from kvforge.sampler import DraftRow, Sampler
from kvforge.scheduler import ModelRunnerOutput, SchedulerOutput
from kvforge.spec_decode.rejection_sampler import VerifiedTokens, rejection_sample

logger = logging.getLogger(__name__)


class ModelRunner:
    """Builds each step's ``StepInput``, runs it on the executor, samples from the driver's logits."""

    def __init__(self, executor: Executor, sampler: Sampler, *, vocab_size: int, device: torch.device):
        self.executor = executor
        self.worker = executor.driver  # the driver worker, in this process
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.device = device
        model = self.worker.model
        multimodal = model is not None and bool(capabilities_of(type(model)).modalities)
        self.builder = StepInputBuilder(lora=self.worker.lora is not None, multimodal=multimodal)
        self.num_graph_verifications = 0  # steps whose drafts a CUDA graph verified (greedy, CUDAGraphRunner.head)
        #: called with every step that ran a forward, once its sampling is queued (a drafter that reads the
        #: target's hidden states: ``kvforge.spec_decode.decoder.SpecDecoder.attach``)
        self.step_observer: Callable[[StepInput, StepPlan, SchedulerOutput, ForwardOutput, StepHandle], None] | None = None

    # the driver worker's parts (tools and tests read them here)
    @property
    def model(self) -> RankModel | None:
        return self.worker.model

    @property
    def attn(self) -> AttentionBackend:
        return self.worker.attn

    @property
    def graphs(self) -> CUDAGraphRunner | None:
        return self.worker.graphs

    @property
    def swap_space(self) -> CPUSwapSpace | None:
        return self.worker.swap_space

    def prompt_logprobs_rows(self) -> int:
        return self.worker.prompt_logprobs_rows()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, kv: KVCacheManager, prev: "StepHandle | None" = None) -> "StepHandle":
        """Queue one step's work and return at once; ``StepHandle.result()`` waits for it.

        ``prev``: the step still in flight, whose sampled tokens fill this step's placeholders
        (async scheduling) on the device, without a round trip through the host.
        """
        self.sampler.release(out.finished_request_ids)
        graphs = self.worker.graphs
        graph_key = None  # (padded batch size, query tokens per sequence) of a uniform step
        if graphs is not None and not _computes_prompt_logprobs(out) and not (
                self.builder.encoder is not None and reaches_placeholders(out.scheduled, out.num_scheduled_tokens)):
            graph_key = graphs.padded_size(out)
        step, plan = self.builder.build(out, kv, graph_key, prev.sample_reqs if prev is not None else None)
        if plan.sample_reqs:
            plan.use_head = (plan.row_counts is not None and plan.dense and graphs is not None
                             and graph_key is not None and graphs.head(graph_key) is not None
                             and all(self.sampler.plain_greedy(r) for r in plan.sample_reqs))
            step.compute_logits = not plan.use_head
        sink, parts = self._prompt_sink(plan) if plan.prompt_spans else (None, [])
        fwd = None
        if step.has_work:
            prev_tokens = prev.tokens if prev is not None and step.fill_dst is not None else None
            fwd = self.executor.execute_model(step, prev_tokens, sink)
        if fwd is None:
            return StepHandle.done(ModelRunnerOutput())
        handle = StepHandle(fwd.buf, self.device)
        if plan.prompt_spans:
            handle.prompt_logprobs = (plan.prompt_spans, {key: torch.cat([p[key] for p in parts]) for key in parts[0]})
        if plan.sample_reqs:
            self._tokens(fwd, step, plan, out, handle)
        handle.finish()
        if self.step_observer is not None:  # (after finish: the step's results do not wait for its work)
            self.step_observer(step, plan, out, fwd, handle)
        return handle

    def _tokens(self, fwd: ForwardOutput, step: StepInput, plan: StepPlan, out: SchedulerOutput,
                handle: StepHandle) -> None:
        """The step's tokens from the driver's results: the graph's greedy head, the rejection
        sampler (drafts), or the sampler."""
        reqs = plan.sample_reqs
        if plan.use_head:
            handle.set_verified(_present(fwd.head, "verification head")[:len(reqs)], reqs)  # verified in the graph
            self.num_graph_verifications += 1
        elif plan.row_counts is not None:  # the step verifies drafts
            n = step.num_sample_rows
            # the rows' input ids: each request's own last token, then its drafts
            row_ids = fwd.input_ids[:n] if fwd.sample_rows is None else fwd.input_ids[fwd.sample_rows]
            self._verify(_present(fwd.logits, "logits"), row_ids, reqs, plan.row_counts, out.draft_token_ids, handle)
        else:
            logits = _present(fwd.logits, "logits")  # [num_sampled, vocab]
            sampled = self._sample(logits, reqs, handle)  # NO_TOKEN (-1) where nothing could be sampled
            tokens = sampled.clamp_min(0)  # what the device reads (placeholders, logprobs); the host sees -1
            handle.set_tokens(tokens, reqs, sampled)
            want = [i for i, r in enumerate(reqs) if r.sampling_params.logprobs is not None]
            if want:
                k = max(reqs[i].sampling_params.logprobs or 0 for i in want)
                idx = h2d(want, torch.long, self.device)
                handle.logprobs = ([reqs[i] for i in want], logprob_tensors(logits[idx], tokens[idx], k))

    def release(self, request_ids: set[str]) -> None:
        """Forget ended requests now, on the driver and on every rank, without a step (the engine
        calls this when it goes idle, so no rank holds state of a request that is gone)."""
        if request_ids:
            self.sampler.release(request_ids)
            self.executor.execute_model(self.builder.forget(request_ids))

    def _prompt_sink(self, plan: StepPlan) -> tuple[Callable[[int, torch.Tensor], None], list[dict[str, torch.Tensor]]]:
        """A callback taking each slice of prompt-position logits, and the list it fills."""
        k = max(r.sampling_params.prompt_logprobs for r, _, _ in plan.prompt_spans)
        targets = h2d(plan.prompt_targets, torch.long, self.device)
        parts: list[dict[str, torch.Tensor]] = []

        def sink(start: int, logits: torch.Tensor) -> None:
            parts.append(logprob_tensors(logits, targets[start:start + len(logits)], k))
        return sink, parts

    def _sample(self, logits: torch.Tensor, reqs: list, handle: "StepHandle") -> torch.Tensor:
        """Sample every row. If the batch raises, each row is sampled alone: a request whose row still
        raises fails on its own (``handle.errors``; its row gets token 0, never used) and the others
        keep the tokens they would have had. Device errors propagate (see ``kvforge.errors``)."""
        try:
            return self.sampler.sample(logits, self.sampler.prepare(reqs))
        except Exception as exc:
            if is_device_error(exc):
                raise
            logger.warning("sampling a batch of %d failed (%r); sampling its rows one by one", len(reqs), exc)
        tokens = torch.zeros(len(reqs), dtype=torch.long, device=self.device)
        for i, req in enumerate(reqs):
            try:
                tokens[i:i + 1] = self.sampler.sample(logits[i:i + 1], self.sampler.prepare([req]))
            except Exception as exc:
                if is_device_error(exc):
                    raise
                handle.errors[req.request_id] = RequestFailure.from_exception(exc, "sampling")
        return tokens

    def _verify(self, logits: torch.Tensor, row_ids: torch.Tensor, reqs: list, counts: list[int],
                drafts: dict[str, list[int]], handle: "StepHandle") -> None:
        """Verify the step's drafts with the rejection sampler: request b owns ``counts[b]`` rows
        (1 + its drafts). Isolated like :meth:`_sample`: if the batch raises, each request is verified
        alone, and one that still raises fails on its own."""
        K = max(counts) - 1
        try:
            verified = self._verify_rows(logits, row_ids, reqs, counts, drafts, K)
        except Exception as exc:
            if is_device_error(exc):
                raise
            logger.warning("verifying a batch of %d failed (%r); verifying its requests one by one", len(reqs), exc)
            tokens = torch.full((len(reqs), K + 1), 0, dtype=torch.long, device=self.device)
            emitted = torch.ones(len(reqs), dtype=torch.long, device=self.device)
            start = 0
            for b, (req, c) in enumerate(zip(reqs, counts)):
                try:
                    one = self._verify_rows(logits[start:start + c], row_ids[start:start + c], [req], [c], drafts, K)
                    tokens[b], emitted[b] = one.tokens[0], one.num_emitted[0]
                except Exception as exc:
                    if is_device_error(exc):
                        raise
                    handle.errors[req.request_id] = RequestFailure.from_exception(exc, "sampling")
                start += c
            verified = VerifiedTokens(tokens, emitted, emitted - 1)
        handle.set_verified(verified.packed(), reqs)
        want = [b for b, r in enumerate(reqs) if r.sampling_params.logprobs is not None]
        if want:
            first = np.concatenate([[0], np.cumsum(counts)[:-1]])
            row_b = np.concatenate([np.full(counts[b], b) for b in want])
            row_j = np.concatenate([np.arange(counts[b]) for b in want])
            rows = np.concatenate([first[b] + np.arange(counts[b]) for b in want])
            row_tokens = verified.tokens[h2d(row_b, torch.long, self.device), h2d(row_j, torch.long, self.device)]
            k = max(reqs[b].sampling_params.logprobs for b in want)
            handle.logprobs = ([reqs[b] for b in want], logprob_tensors(
                logits[h2d(rows, torch.long, self.device)], row_tokens.clamp_min(0), k))
            handle.logprob_rows = [counts[b] for b in want]

    def _verify_rows(self, logits: torch.Tensor, row_ids: torch.Tensor, reqs: list, counts: list[int],
                     drafts: dict[str, list[int]], K: int) -> VerifiedTokens:
        """Request b's rows are the next ``counts[b]`` of ``logits``; ``row_ids`` are their input ids
        (its own last token, then its drafts)."""
        views: list = []
        for req, c in zip(reqs, counts):
            if c > 1 and self.sampler.reads_history(req):  # row j sees drafts 1..j as generated
                d = drafts.get(req.request_id, [])[:c - 1]
                views.append(req)
                views.extend(DraftRow(req, d[:j]) for j in range(1, c))
            else:
                views.extend([req] * c)
        target = self.sampler.target(logits, self.sampler.prepare(views))
        B = len(reqs)
        if all(c == K + 1 for c in counts):  # uniform (always, with CUDA graphs): no index to build
            tokens = row_ids.view(B, K + 1)[:, 1:]
            return rejection_sample(target, tokens, draft_probs=self._draft_probs(reqs, counts, tokens, K))
        first = np.zeros(B, dtype=np.int64)
        np.cumsum(counts[:-1], out=first[1:])
        num_drafts = np.asarray(counts, dtype=np.int64) - 1
        j = np.arange(K)
        index = np.where(j[None, :] < num_drafts[:, None], first[:, None] + 1 + j[None, :], first[:, None])
        packed = h2d(np.concatenate([index.ravel(), num_drafts, first]), torch.long, self.device)  # one copy
        tokens = row_ids[packed[:B * K]].view(B, K)
        return rejection_sample(target, tokens, packed[B * K:B * K + B], packed[B * K + B:],
                                self._draft_probs(reqs, counts, tokens, K))

    def _draft_probs(self, reqs: list, counts: list[int], tokens: torch.Tensor, K: int) -> torch.Tensor | None:
        """[B, K, vocab] q of every draft: the drafter's where it gave one, else one-hot at the draft."""
        if K == 0 or all(r.draft_probs is None for r in reqs):
            return None
        q = torch.nn.functional.one_hot(tokens, self.vocab_size).float()
        for b, (r, c) in enumerate(zip(reqs, counts)):
            if r.draft_probs is not None and c > 1:  # (filler drafts past the drafter's own stay one-hot)
                n = min(c - 1, len(r.draft_probs))
                q[b, :n] = r.draft_probs[:n]
        return q


def _present(t: torch.Tensor | None, what: str) -> torch.Tensor:
    """A result the step's plan relies on (the driver computed it for that plan)."""
    if t is None:
        raise RuntimeError(f"the driver's step output has no {what}")
    return t


def _computes_prompt_logprobs(out: SchedulerOutput) -> bool:
    """Whether the step computes prompt log-probabilities: a request that asked for them is still short
    of its last prompt position (as ``StepInputBuilder._prompt_rows`` counts). Such a step runs eagerly;
    the decode steps after the prompt replay CUDA graphs like any other."""
    return any(r.sampling_params.prompt_logprobs is not None and r.num_computed_tokens < r.num_prompt_tokens - 1
               for r in out.scheduled)
