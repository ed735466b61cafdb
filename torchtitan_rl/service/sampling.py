"""Sampling sessions of the service: frozen snapshots of a client's adapters (or the base model),
generated from with the KV-cache generator on the ranks that sample.

A snapshot keeps the client's adapters whole, on the CPU (a few MB for LoRA), and its scale. Each
rank that samples holds one unsharded replica of the model (``TorchGenerator``) that takes the
base weights once, at start, and then merges a snapshot's adapters into them when a request needs
another snapshot than the last. A request's samples are split over the ranks that sample (every
training rank, ``ColocatedSampling``; or the rollout ranks alone, ``service.rollout_sampling``);
sample j draws from its own random stream (``rollout_seed(seed, 0, j, 0)``), so what comes back
does not depend on the layout.
"""

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from torchtitan_rl.data.tokenizer import Tokenizer
from torchtitan_rl.rl.generator import TorchGenerator
from torchtitan_rl.rl.rollouts import split_among_peers
from torchtitan_rl.rl.sampling import SamplingParams
from torchtitan_rl.service.checkpoints import parse_path
from torchtitan_rl.service.operations import SampledSequence, SampleResult, UserError


@dataclass
class Snapshot:
    base_model: str
    adapters: dict[str, torch.Tensor] | None  # whole adapter tensors on the CPU; None: the base model
    scale: float = 0.0
    model_path: str | None = None  # its tinker:// path when it was saved by name


class SamplingSessions:
    """Sampling session id -> snapshot, and named sampler checkpoints path -> snapshot. At most
    ``max_snapshots`` unnamed snapshots are kept (a client that samples after every update makes
    one per step); the oldest go first, and sampling from one that went is a UserError. Every
    rank that holds one updates it with the same operations in the same order."""

    def __init__(self, max_snapshots: int):
        self.max_snapshots = max_snapshots
        self.sessions: OrderedDict[str, Snapshot] = OrderedDict()
        self.named: dict[str, Snapshot] = {}

    def add(self, session_id: str, snapshot: Snapshot) -> None:
        self.sessions[session_id] = snapshot
        unnamed = [sid for sid, snap in self.sessions.items() if snap.model_path is None and snap.adapters is not None]
        for sid in unnamed[: max(0, len(unnamed) - self.max_snapshots)]:
            del self.sessions[sid]

    def get(self, session_id: str) -> Snapshot:
        if session_id not in self.sessions:
            raise UserError(
                f"sampling_session_id: no sampling session {session_id!r} (never created, or one of the oldest "
                f"unnamed snapshots beyond the {self.max_snapshots} the service keeps)"
            )
        return self.sessions[session_id]

    def keep(self, snapshot: Snapshot, session_id: str | None) -> None:
        """A snapshot of ``save_weights_for_sampler``: under its path when it was saved by name,
        else as the ephemeral session ``session_id``."""
        if snapshot.model_path is None:
            self.add(session_id, snapshot)
        else:
            self.named[snapshot.model_path] = snapshot

    def named_snapshot(self, model_path: str) -> Snapshot:
        parse_path(model_path, "model_path")
        if model_path not in self.named:
            raise UserError(f"model_path: no sampler weights were saved at {model_path!r} by this service")
        return self.named[model_path]

    def open(self, session_id: str, base_model: str | None, model_path: str | None) -> None:
        """``create_sampling_session``: of named sampler weights, or of the base model."""
        snapshot = Snapshot(base_model, None) if model_path is None else self.named_snapshot(model_path)
        self.add(session_id, snapshot)


def _stop_at_string(tokens: list[int], stops: list[str], tokenizer: Tokenizer) -> int | None:
    """The length of the shortest prefix of ``tokens`` whose text contains one of ``stops``. Ids
    past the tokenizer's vocabulary (a model may have more embeddings than it has tokens) have no
    text."""
    known = [t for t in tokens if t < tokenizer.vocab_size]
    whole = tokenizer.decode(known)
    if not any(stop in whole for stop in stops):
        return None  # the common case: one decode, not one per prefix
    for length in range(1, len(tokens) + 1):
        text = tokenizer.decode([t for t in tokens[:length] if t < tokenizer.vocab_size])
        if any(stop in text for stop in stops):
            return length
    return None


@dataclass
class SampleShare:
    """What one sampling rank generated of a request: its contiguous part of the samples, and
    the prompt's log-probs from the first share when the request asks for them."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None


class ServiceSampler:
    """Generation for sampling requests on this rank's replica, whose base weights are loaded
    (``TorchGenerator.update_weights`` or a rollout rank's ``WeightReceiver``) before the first
    request."""

    def __init__(self, generator: TorchGenerator, tokenizer: Tokenizer):
        self.generator = generator
        self.tokenizer = tokenizer
        self.loaded: Snapshot | None = None

    def _load(self, snapshot: Snapshot) -> None:
        if self.loaded is snapshot:
            return
        lora = self.generator.lora
        if snapshot.adapters is None:
            tensors = {name: torch.zeros(shape) for name, shape in self.generator.next_sync()}
        else:
            tensors = {name: snapshot.adapters[name] for name, _ in self.generator.next_sync()}
            # The merge scales B A by alpha / rank: the snapshot's own scale.
            self.generator.lora = dataclasses.replace(lora, alpha=snapshot.scale * lora.rank)
        try:
            self.generator.load_weights(tensors, version=0)
        finally:
            self.generator.lora = lora
        self.loaded = snapshot

    def share(self, snapshot: Snapshot, args: dict, index: int, num_shares: int) -> SampleShare:
        """Share ``index`` of ``num_shares`` of the request's samples: sample j draws from
        ``rollout_seed(seed, 0, j, 0)`` whichever rank generates it."""
        self._load(snapshot)
        stop = args["stop"]
        stop_ids = (self.tokenizer.eos_id,) if stop is None else tuple(s for s in stop if isinstance(s, int))
        stop_strings = [] if stop is None else [s for s in stop if isinstance(s, str)]
        prompt, num_samples = list(args["prompt"]), args["num_samples"]
        max_tokens = args["max_tokens"]
        params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=args["temperature"],
            top_k=max(args["top_k"], 0),
            top_p=args["top_p"],
            stop_token_ids=stop_ids,
        )
        mine = split_among_peers(list(range(num_samples)), index, num_shares)
        rollouts = self.generator.generate([prompt] * len(mine), mine, 1, params, args["seed"], 0)
        local = []
        for rollout in rollouts:
            tokens, logprobs, reason = rollout.completion_tokens, rollout.logprobs, rollout.stop_reason
            cut = _stop_at_string(tokens, stop_strings, self.tokenizer) if stop_strings else None
            if cut is not None:
                tokens, logprobs, reason = tokens[:cut], logprobs[:cut], "stop"
            local.append(SampledSequence(list(tokens), [float(x) for x in logprobs], reason))
        prompt_logprobs = self.prompt_logprobs(prompt) if args["prompt_logprobs"] and index == 0 else None
        return SampleShare(local, prompt_logprobs)

    @torch.inference_mode()
    def prompt_logprobs(self, prompt: list[int]) -> list[float | None]:
        """log p(prompt[i] | prompt[:i]) under the loaded snapshot; None for the first token."""
        if len(prompt) < 2:
            return [None] * len(prompt)
        device = self.generator.device
        tokens = torch.tensor(prompt[:-1], device=device)
        positions = torch.arange(len(prompt) - 1, device=device)
        seq_ids = torch.zeros(len(prompt) - 1, dtype=torch.long, device=device)
        logits, _ = self.generator.logits_and_routing(tokens, positions, seq_ids)
        targets = torch.tensor(prompt[1:], device=device)
        values = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
        return [None, *values.cpu().tolist()]


def gather_shares(share: SampleShare | None, group: dist.ProcessGroup | None) -> SampleResult | None:
    """The request's result on rank 0, from the shares of the ranks of ``group`` (a gloo group
    of rank 0 and the sampling ranks, in share order; None: rank 0 alone); None elsewhere.
    Rank 0 passes its own share, or None when it does not sample."""
    shares = [share]
    if group is not None:
        shares = [None] * dist.get_world_size(group) if dist.get_rank() == 0 else None
        dist.gather_object(share, shares, dst=0, group=group)
    if shares is None:
        return None
    present = [s for s in shares if s is not None]
    return SampleResult([seq for s in present for seq in s.sequences], present[0].prompt_logprobs)


class SamplingBackend(Protocol):
    """Where a training rank's worker sends what concerns sampling."""

    def publish(self, snapshot: Snapshot) -> None:
        """A snapshot of ``save_weights_for_sampler``, for the ranks that sample (every training
        rank calls it, in the operation)."""

    def sample(self, snapshot: Snapshot, args: dict) -> SampleResult | None:
        """A checked sample request's sequences on rank 0, None on the other training ranks."""


class ColocatedSampling:
    """Sampling on the training ranks (no rollout ranks): each generates its share of a request
    on its own replica; rank 0 gathers them over the dispatch group (``group``)."""

    def __init__(self, sampler: ServiceSampler, group: dist.ProcessGroup | None):
        self.sampler, self.group = sampler, group

    def publish(self, snapshot: Snapshot) -> None:
        """A new snapshot: every training rank has it already."""

    def sample(self, snapshot: Snapshot, args: dict) -> SampleResult | None:
        """The request's sequences on rank 0 (None elsewhere); collective over ``group``."""
        rank, world = (dist.get_rank(), dist.get_world_size(self.group)) if self.group is not None else (0, 1)
        return gather_shares(self.sampler.share(snapshot, args, rank, world), self.group)


def check_sample_args(args: dict, vocab_size: int, max_len: int) -> None:
    """UserErrors naming the field, before any rank starts generating."""
    prompt = args["prompt"]
    if not prompt:
        raise UserError("prompt: empty")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise UserError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if args["num_samples"] < 1:
        raise UserError(f"num_samples: {args['num_samples']} < 1")
    if args["max_tokens"] is None or args["max_tokens"] < 1:
        raise UserError(f"sampling_params.max_tokens: {args['max_tokens']} (give a positive number of tokens)")
    if len(prompt) + args["max_tokens"] > max_len:
        raise UserError(
            f"sampling_params.max_tokens: the prompt's {len(prompt)} tokens + {args['max_tokens']} exceed the "
            f"service's training.seq_len = {max_len}"
        )
    for stop in args["stop"] or ():
        if isinstance(stop, int) and not 0 <= stop < vocab_size:
            raise UserError(f"sampling_params.stop: token id {stop} is outside the vocabulary")
    if not args["temperature"] >= 0:
        raise UserError(f"sampling_params.temperature: {args['temperature']} < 0")
    if not 0 < args["top_p"] <= 1:
        raise UserError(f"sampling_params.top_p: {args['top_p']} is not in (0, 1]")
