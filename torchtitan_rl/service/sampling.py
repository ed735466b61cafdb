"""Sampling sessions of the service: frozen snapshots of a client's adapters (or the base model),
generated from with the KV-cache generator on every rank.

A snapshot keeps the client's adapters whole, on the CPU (a few MB for LoRA), and its scale. Each
rank holds one unsharded replica of the model (``TorchGenerator``) that takes the base weights
once and then merges a snapshot's adapters into them when a request needs another snapshot than
the last. A request's samples are split over all ranks; sample j draws from its own random stream
(``rollout_seed(seed, 0, j, 0)``), so what comes back does not depend on the layout.
"""

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchtitan_rl.data.tokenizer import Tokenizer
from torchtitan_rl.rl.generator import TorchGenerator
from torchtitan_rl.rl.rollouts import split_among_peers
from torchtitan_rl.rl.sampling import SamplingParams
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
    one per step); the oldest go first, and sampling from one that went is a UserError."""

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


def _stop_at_string(tokens: list[int], stops: list[str], tokenizer: Tokenizer) -> int | None:
    """The length of the shortest prefix of ``tokens`` whose text contains one of ``stops``. Ids
    past the tokenizer's vocabulary (a model may have more embeddings than it has tokens) have no
    text."""
    for length in range(1, len(tokens) + 1):
        text = tokenizer.decode([t for t in tokens[:length] if t < tokenizer.vocab_size])
        if any(stop in text for stop in stops):
            return length
    return None


class ServiceSampler:
    """Generation for sampling requests on this rank (every rank runs ``sample`` together)."""

    def __init__(self, generator: TorchGenerator, tokenizer: Tokenizer, model: torch.nn.Module):
        self.generator = generator
        self.tokenizer = tokenizer
        self.model = model  # the trained model: the replica's first load takes its base weights
        self.loaded: Snapshot | None = None

    def _load(self, snapshot: Snapshot) -> None:
        if self.loaded is snapshot:
            return
        if not self.generator.is_loaded:
            # Every weight once (a collective over the trained model's shards); the adapters
            # of the snapshot replace the active client's right after.
            self.generator.update_weights(self.model)
        names = [name for name, _ in self.generator.next_sync()]
        lora = self.generator.lora
        if snapshot.adapters is None:
            tensors = {name: torch.zeros(shape) for name, shape in self.generator.next_sync()}
        else:
            tensors = {name: snapshot.adapters[name] for name in names}
            # The merge scales B A by alpha / rank: the snapshot's own scale.
            self.generator.lora = dataclasses.replace(lora, alpha=snapshot.scale * lora.rank)
        try:
            self.generator.load_weights(tensors, version=0)
        finally:
            self.generator.lora = lora
        self.loaded = snapshot

    def sample(self, snapshot: Snapshot, args: dict) -> SampleResult | None:
        """The request's sequences on rank 0 (None elsewhere); collective over the world."""
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
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        mine = split_among_peers(list(range(num_samples)), rank, world)
        rollouts = self.generator.generate([prompt] * len(mine), mine, 1, params, args["seed"], 0)
        local = []
        for rollout in rollouts:
            tokens, logprobs, reason = rollout.completion_tokens, rollout.logprobs, rollout.stop_reason
            cut = _stop_at_string(tokens, stop_strings, self.tokenizer) if stop_strings else None
            if cut is not None:
                tokens, logprobs, reason = tokens[:cut], logprobs[:cut], "stop"
            local.append(SampledSequence(list(tokens), [float(x) for x in logprobs], reason))
        prompt_logprobs = self.prompt_logprobs(prompt) if args["prompt_logprobs"] and rank == 0 else None
        if world > 1:
            gathered: list = [None] * world
            dist.all_gather_object(gathered, local)
            local = [seq for part in gathered for seq in part]
        if rank != 0:
            return None
        return SampleResult(local, prompt_logprobs)

    @torch.inference_mode()
    def prompt_logprobs(self, prompt: list[int]) -> list[float | None]:
        """log p(prompt[i] | prompt[:i]) under the loaded snapshot; None for the first token."""
        if len(prompt) < 2:
            return [None] * len(prompt)
        device = self.generator.device
        tokens = torch.tensor(prompt[:-1], device=device)
        positions = torch.arange(len(prompt) - 1, device=device)
        seq_ids = torch.zeros(len(prompt) - 1, dtype=torch.long, device=device)
        logits = self.generator.logits(tokens, positions, seq_ids)
        targets = torch.tensor(prompt[1:], device=device)
        values = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
        return [None, *values.cpu().tolist()]


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
