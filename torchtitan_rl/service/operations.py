"""What the HTTP layer (``service.http``) hands the dispatch layer (``service.dispatch``): one
``Operation`` per accepted request, and the results the dispatch layer completes them with.

The HTTP layer owns the wire (JSON and protobuf, sessions, request ids, futures, retries); the
dispatch layer owns models, their order of execution and the ranks. Nothing here imports torch
distributed or FastAPI.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class UserError(ValueError):
    """A request the service refuses: bad input, an unknown id or path. The message names the
    field; the SDK raises it as a ``RequestFailedError`` of category "user", and the service
    goes on serving."""


@dataclass
class TinkerDatum:
    """One datum of a forward / forward_backward request: the model input's tokens (its text
    chunks concatenated) and its ``loss_fn_inputs`` as dense CPU tensors (float32 or int64) of
    their declared shape: (N,), or (N, K) for top-K ``target_tokens`` / ``weights`` (a sparse
    one densified with zeros). Unchecked: the dispatch layer checks shapes, lengths, token ids
    and the loss's inputs."""

    tokens: list[int]
    inputs: dict[str, torch.Tensor]


# Operation kinds and their ``args`` (every id below is a string the HTTP layer made):
#   create_model              base_model: str, lora_rank: int, seed: int | None,
#                             train_unembed / train_mlp / train_attn: bool
#   forward_backward          data: list[TinkerDatum], loss_fn: str, loss_fn_config: dict[str, float],
#                             forward_only: bool                        -> ForwardBackwardResult
#   optim_step                learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm: float
#                                                                        -> {"metrics": dict[str, float]}
#   save_weights              name: str                                 -> {"path": "tinker://..."}
#   save_weights_for_sampler  name: str | None, sampling_session_id: str | None (ephemeral when no name)
#                                                                        -> {"path": ...} or {"sampling_session_id": ...}
#   load_weights              path: str, optimizer: bool; when the model does not exist yet (create from
#                             state) also base_model: str | None         -> {"path": path}
#   create_sampling_session   sampling_session_id: str, base_model: str | None, model_path: str | None
#                                                                        -> {"sampling_session_id": ...}
#   sample                    sampling_session_id: str, prompt: list[int], num_samples: int,
#                             max_tokens: int | None, seed: int | None, stop: list[int] | list[str] | None
#                             (None: the tokenizer's end-of-sequence token; []: none), temperature: float,
#                             top_k: int (-1 = off), top_p: float, prompt_logprobs: bool -> SampleResult
#   skip                      error: UserError. A request of a training model that the HTTP layer
#                             refused (malformed): nothing runs; the model's sequence moves past
#                             seq_id, and the operation completes with ``error`` when its turn comes.
# create_model, and load_weights that creates its model (create from state), carry seq_id None:
# they are not in the model's sequence, whose first operation is seq_id 1.
OPERATION_KINDS = (
    "create_model",
    "forward_backward",
    "optim_step",
    "save_weights",
    "save_weights_for_sampler",
    "load_weights",
    "create_sampling_session",
    "sample",
    "skip",
)


@dataclass
class Operation:
    request_id: str
    kind: str
    # The training model the operation belongs to; operations of one model run in ``seq_id``
    # order (the SDK numbers them 1, 2, ... per training client). None for sampling operations.
    model_id: str | None = None
    seq_id: int | None = None
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class ForwardBackwardResult:
    # Per datum, float32 of target_tokens' shape, (N,) or (N, K): log p(target_tokens[i] | tokens[:i+1]).
    logprobs: list[torch.Tensor]
    metrics: dict[str, float]  # "name:reduction" keys, "loss:sum" always


@dataclass
class SampledSequence:
    tokens: list[int]  # the stop token included once when it stopped on one
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"


@dataclass
class SampleResult:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None  # the first is None


class Backend(Protocol):
    """What the HTTP layer calls (``service.dispatch.Dispatcher`` on rank 0; a fake in tests)."""

    def submit(self, op: Operation, done: Callable[[Any], None]) -> None:
        """Queue ``op``; never blocks. ``done`` is called once, later and from another thread,
        with the result or the exception (a ``UserError`` for the client's mistakes)."""

    def model_info(self, model_id: str) -> dict[str, Any]:
        """A created model's ``base_model`` and ``lora_rank`` (also read, when present:
        ``tokenizer_id``, ``arch``), for ``get_info`` (UserError when unknown)."""

    def sampler_info(self, sampling_session_id: str) -> dict[str, Any]:
        """``samplers/{id}``: ``base_model`` and ``model_path`` (UserError when unknown)."""

    def capabilities(self) -> list[dict[str, Any]]:
        """``get_server_capabilities``'s ``supported_models`` entries."""
