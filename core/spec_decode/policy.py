"""Speculative decoding in the engine: its configuration, the per-step policy and the counters.

See docs/speculative.md for the design; the drafter contract is in ``kvforge.spec_decode.drafter`` and the
verification in ``kvforge.spec_decode.rejection_sampler``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

if TYPE_CHECKING:
    from kvforge.engine.stats import SpecDecodeSnapshot

#: keys of ``speculative_config`` that the engine reads; the rest go to the drafter's options
ENGINE_KEYS = ("method", "num_speculative_tokens", "policy", "knee_tokens")
POLICIES = ("auto", "fixed")


@dataclass
class SpeculativeConfig:
    """``speculative_config`` (vLLM's keys): ``method`` names a registered drafter,
    ``num_speculative_tokens`` is k. ``policy``: ``auto`` (default) lowers k or skips speculation
    per step when it would not pay (docs/speculative.md#the-policy); ``fixed`` always asks for k.
    ``knee_tokens``: the auto policy's estimate of the query tokens per step up to which a step costs
    about the same (bandwidth-bound); default 256 on CUDA, 16 on the CPU. Every other key is an
    option of the drafter (e.g. ngram's ``prompt_lookup_min`` / ``prompt_lookup_max``, draft_model's
    ``model``)."""

    method: str
    num_speculative_tokens: int
    policy: str = "auto"
    knee_tokens: int | None = None
    drafter_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Any) -> "SpeculativeConfig":
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a table/dict, got {type(d).__name__}")
        if not isinstance(d.get("method"), str) or not d["method"]:
            raise ValueError("speculative_config: 'method' (the drafter's name, e.g. 'ngram') is required")
        k = d.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 32:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer in [1, 32], got {k!r}")
        policy = d.get("policy", "auto")
        if policy not in POLICIES:
            raise ValueError(f"speculative_config: policy must be one of {POLICIES}, got {policy!r}")
        knee = d.get("knee_tokens")
        if knee is not None and (not isinstance(knee, int) or isinstance(knee, bool) or knee < 1):
            raise ValueError(f"speculative_config: knee_tokens must be an integer >= 1, got {knee!r}")
        options = {key: v for key, v in d.items() if key not in ENGINE_KEYS}
        return cls(d["method"], k, policy, knee, options)


class SpeculationPolicy:
    """How many drafts to ask for in the next step (docs/speculative.md#the-policy).

    ``fixed``: always k. ``auto``, in two layers:

    1. Acceptance and a cost model pick j. Each request's per-position acceptance alpha is tracked
       as the estimate of a geometric run: exponential averages of its accepted drafts per step and
       of its rejection events (a step whose run stopped before the drafts it asked for; a drafter
       that proposed nothing is a rejection), alpha = accepted / (accepted + rejections). A request
       then expects E(j) = (1 - alpha^(j+1)) / (1 - alpha) tokens from a step with j drafts. Such a
       step costs about max(B(1 + j), knee) / max(B, knee) of a plain step for B decoding requests
       (bandwidth-bound up to ``knee`` query tokens). The best j in 0..k by sum E(j) / cost(j) is the
       candidate, a drafting j only if it beats a plain step (B tokens) by 2%; 0 switches
       speculation off. (No margin between draft counts: under the knee an extra draft costs
       nothing, so j = k, the one count with CUDA graphs.)
    2. Measured step times overrule the cost model. The model cannot see what a step really costs
       on this machine (a step that verifies drafts runs synchronously and gives up async
       scheduling's overlap, worth little at batch 256 and a lot at batch 1), so the engine reports
       every decode step's wall time (:meth:`record_step`), kept per batch-size bucket (powers of
       two) and mode (drafting or not) as exponential averages. Once both modes have been timed in a bucket, the
       candidate j drafts only if sum E(j) / T_drafting beats B / T_plain. Every
       ``explore_every`` decisions of a bucket the other mode runs for ``explore_steps`` steps, so
       that the times follow the workload.
    """

    def __init__(self, k: int, mode: str = "auto", knee_tokens: int = 256, initial_acceptance: float = 0.5,
                 smoothing: float = 0.3, explore_every: int = 64, explore_steps: int = 4, min_samples: int = 3):
        self.k, self.mode, self.knee = k, mode, knee_tokens
        self.smoothing = smoothing
        # (accepted per step, rejections per step) averages: alpha = a / (a + r)
        self.prior = (initial_acceptance, 1 - initial_acceptance)
        self.overall = self.prior  # requests that have not drafted yet start here
        self.per_request: dict[str, tuple[float, float]] = {}
        self.explore_every, self.explore_steps, self.min_samples = explore_every, explore_steps, min_samples
        self.times: dict[tuple[int, bool], tuple[float, int]] = {}  # (bucket, drafting) -> (seconds/step, samples)
        self.steps: dict[int, int] = {}  # bucket -> decisions made

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, batch_size - 1).bit_length()

    def acceptance(self, request_id: str) -> float:
        """The request's estimated per-position acceptance alpha."""
        a, r = self.per_request.get(request_id, self.overall)
        return a / (a + r) if a + r > 0 else 0.0

    def expected_tokens(self, request_ids: list[str], j: int) -> float:
        """Sum over the requests of E(j), the tokens a step with j drafts each yields."""
        return self._expected(self._alphas(request_ids), j)

    def _alphas(self, request_ids: list[str]) -> np.ndarray:
        return np.minimum([self.acceptance(rid) for rid in request_ids], 0.999)

    @staticmethod
    def _expected(alphas: np.ndarray, j: int) -> float:
        return float(((1 - alphas ** (j + 1)) / (1 - alphas)).sum())

    def _cost(self, B: int, j: int) -> float:
        return max(B * (1 + j), self.knee) / max(B, self.knee)

    def model_choice(self, request_ids: list[str], alphas: np.ndarray | None = None) -> int:
        """The cost model's j (layer 1); ``alphas``: the requests' acceptances, if already looked up."""
        B = len(request_ids)
        alphas = self._alphas(request_ids) if alphas is None else alphas
        best_j, best = 0, 1.02 * B  # drafting must beat a plain step (B tokens) by a 2% margin
        for j in range(1, self.k + 1):
            # (no margin between draft counts: under the knee every extra draft is free, so j = k;
            # with CUDA graphs only k has verification graphs)
            value = self._expected(alphas, j) / self._cost(B, j)
            if value > best:
                best_j, best = j, value
        return best_j

    def num_draft_tokens(self, request_ids: list[str]) -> int:
        if not request_ids:
            return 0
        if self.mode == "fixed":
            return self.k
        alphas = self._alphas(request_ids)
        model = self.model_choice(request_ids, alphas)
        if model == 0:
            # nothing is learned while not drafting: let estimates drift back toward the prior, so a
            # request whose text turns repetitive gets drafts again
            for rid in request_ids:
                if rid in self.per_request:
                    (a, r), (pa, pr) = self.per_request[rid], self.prior
                    self.per_request[rid] = (a + 0.02 * (pa - a), r + 0.02 * (pr - r))
            return 0
        B = len(request_ids)
        b = self.bucket(B)
        n = self.steps[b] = self.steps.get(b, 0) + 1
        on, off = self.times.get((b, True)), self.times.get((b, False))
        j = model
        if (on is not None and off is not None and on[1] >= self.min_samples and off[1] >= self.min_samples
                and self._expected(alphas, model) / on[0] < B / off[0]):
            j = 0  # drafting was measured slower here
        if n % self.explore_every < self.explore_steps:  # refresh the other mode's measurement
            j = 0 if j else model
        return j

    def record_step(self, batch_size: int, drafting: bool, seconds: float) -> None:
        """A decode step's wall time (the engine calls it every decode step)."""
        if seconds <= 0 or batch_size <= 0:
            return
        key = (self.bucket(batch_size), drafting)
        old = self.times.get(key)
        self.times[key] = (seconds, 1) if old is None else (0.8 * old[0] + 0.2 * seconds, old[1] + 1)

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        """One verification of a request: ``proposed`` drafts (0: the drafter had none), of which the
        first ``accepted`` were accepted."""
        accepted = min(accepted, proposed)
        rejected = 1.0 if accepted < proposed or proposed == 0 else 0.0
        s = self.smoothing
        a, r = self.per_request.get(request_id, self.overall)
        self.per_request[request_id] = ((1 - s) * a + s * accepted, (1 - s) * r + s * rejected)
        a, r = self.overall
        self.overall = ((1 - s / 4) * a + s / 4 * accepted, (1 - s / 4) * r + s / 4 * rejected)

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.per_request.pop(rid, None)


@dataclass
class SpecDecodeStats:
    """Counters since the engine started (vLLM's definitions)."""

    num_drafts: int = 0  # (request, step) pairs that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_by_position: list[int] = field(default_factory=list)  # [k]: drafts accepted at position j
    num_steps: int = 0  # steps that verified drafts
    num_steps_without: int = 0  # decode steps the policy (or the drafter) left without drafts

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.accepted_by_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verifying step per request: 1 + accepted drafts on average."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> SpecDecodeSnapshot:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_by_position": list(self.accepted_by_position), "num_steps": self.num_steps,
                "num_steps_without": self.num_steps_without, "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length}
