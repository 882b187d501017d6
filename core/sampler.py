"""The sampler contract: logits of the positions to sample -> token ids, vectorised over the batch."""
from __future__ import annotations

from abc import ABC, abstractmethod
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Generic, Iterable, Sequence, TypeVar

import torch

from kvforge.request import Request

if TYPE_CHECKING:
    from kvforge.spec_decode.rejection_sampler import TargetDistribution

#: the token a sampler returns for a row where no token can be sampled: every logit is -inf (the
#: request's masks exclude the whole vocabulary) or one is NaN. The engine fails that request (a 400).
NO_TOKEN = -1

#: a sampler's per-step state: what :meth:`Sampler.prepare` gathers and :meth:`Sampler.sample` reads
#: (``DefaultSampler``'s is ``kvforge.plugins.sampling.default.SamplingState``); the engine only passes it on
SamplingStateT = TypeVar("SamplingStateT")


class LogitsProcessor(ABC):
    """A batch-level logits transform that requests enable by name (``SamplingParams.logits_processors``).

    Registered through the ``register_logits_processors`` hook; built once per engine, on first use.

    ``request_options``: the per-request arguments the processor reads from
    ``SamplingParams.extra_args`` (``vllm_xargs`` over HTTP), as a dataclass whose fields all have
    defaults and whose ``__post_init__`` raises ``ValueError`` on a bad value. Requests are checked
    against it before they are queued (a ``ValueError`` / 400 naming the key); ``options_of(request)``
    gives ``apply`` the parsed options. None: the processor takes no arguments.
    """

    name: str = ""
    request_options: type | None = None

    @classmethod
    def options_of(cls, request: Request) -> Any:  # an instance of this processor's request_options
        """``request_options`` built from the request's ``extra_args`` (the keys it declares)."""
        import dataclasses

        options = cls.request_options
        if options is None:
            raise TypeError(f"logits processor {cls.name!r} declares no request_options")
        args = request.sampling_params.extra_args or {}
        keys = {f.name for f in dataclasses.fields(options)}
        return options(**{k: v for k, v in args.items() if k in keys})

    def __init__(self, *, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = torch.device(device)

    @abstractmethod
    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """logits: [len(requests), vocab] float32 rows of the requests that enabled this processor
        (their state: ``request.output_token_ids``, ``request.sampling_params.extra_args``...).
        Returns the new logits of the same shape. Called once per step, never per request."""


class Sampler(ABC, Generic[SamplingStateT]):
    """Turns one step's logits into tokens. Built once per engine; ``prepare`` runs once per step.

    Generic in its state: a sampler declares what ``prepare`` returns and ``sample`` / ``target`` read
    (``class DefaultSampler(Sampler[SamplingState])``); the engine holds it opaque between the two calls.
    """

    name: str = ""

    def __init__(self, *, vocab_size: int, device: torch.device,
                 logits_processors: Callable[[str], LogitsProcessor] | None = None, **options: object):
        """``logits_processors(name)`` returns the engine's instance of a registered processor."""
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.get_processor = logits_processors

    @abstractmethod
    def prepare(self, requests: Sequence[Request]) -> SamplingStateT:
        """Gather the per-request parameters of the rows to sample into device tensors."""

    @abstractmethod
    def sample(self, logits: torch.Tensor, state: SamplingStateT) -> torch.Tensor:
        """logits: [num_rows, vocab] float32 -> token ids [num_rows] int64 on the same device;
        :data:`NO_TOKEN` for a row with nothing to sample (no finite logit, or a NaN)."""

    def target(self, logits: torch.Tensor, state: SamplingStateT) -> TargetDistribution:
        """The distribution :meth:`sample` would draw from at each row, for speculative decoding's
        rejection sampler (``kvforge.spec_decode.rejection_sampler``): greedy tokens, probabilities after every
        transformation, rows with nothing to sample, and at the rows of seeded requests the very token
        :meth:`sample` would draw there (keyed by seed and output position: ``kvforge.keyed_random``), which
        verification compares the drafts with. Rows may be :class:`DraftRow` views. A sampler without it
        cannot be used with a drafter."""
        raise NotImplementedError(f"sampler {self.name!r} does not implement target(), which speculative "
                                  "decoding needs")

    def reads_history(self, request: Request) -> bool:
        """Whether this request's rows depend on its generated tokens (penalties, bad words...) or on
        their output position (a seeded draw, :func:`output_position`): if so, the rows verifying its
        drafts are :class:`DraftRow` views, else the request itself. Default: always (correct for any
        sampler; a sampler that knows better saves the views)."""
        return True

    def plain_greedy(self, request: Request) -> bool:
        """Whether this request's token is exactly the argmax of the raw logits (greedy, nothing
        that changes the logits, no log-probabilities): a CUDA graph may then verify its drafts
        without the sampler. Default: never (correct for any sampler)."""
        return False

    def release(self, request_ids: Iterable[str]) -> None:  # noqa: B027 - optional: a no-op by default
        """Forget per-request state (random generators...) of requests that ended."""


class DraftRow:
    """A request as row j of its draft verification sees it: the first j drafts count as generated
    (penalties, bad-word prefixes, ``min_tokens`` and logits processors see them in
    ``output_token_ids``; the grammar bitmask is the one after them). Everything else is the request's.
    """

    def __init__(self, request: Request, draft_prefix: list[int]):
        self.request = request
        self.draft_prefix = draft_prefix

    @cached_property
    def output_token_ids(self) -> list[int]:
        # (built on first read: rows whose sampling reads no history, seeded ones, never copy the output)
        return self.request.output_token_ids + self.draft_prefix

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens + len(self.draft_prefix)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.request, name)


def output_position(row: Request | DraftRow) -> int:
    """The index in the request's output of the token a row samples: its tokens so far (a step in
    flight's placeholder counts: that token comes first), plus the drafts before it for a
    :class:`DraftRow`. Seeded draws are keyed by it, so the token at a position is the same whichever
    step (plain, or verifying drafts) samples it."""
    if isinstance(row, DraftRow):
        return len(row.request.output_token_ids) + len(row.draft_prefix)
    return len(row.output_token_ids)
