"""Rollout generation: a continuously batched sampler with a KV cache over the project's models
(``Qwen3Model`` and the vision-language ``VLMModel``).

Every trainer rank holds an unsharded replica of the policy (docs/design.md, 'The RL step'), refreshed with
``update_weights`` after each optimizer step, and samples its share of the step's prompts.

Weight syncs take only what can have changed: the first one into a replica (no weights yet)
takes every parameter of the trained model, later ones only those that train. With LoRA the
replica is still a plain model: it keeps the base weight of each adapted layer as it arrived and
sets the layer's weight to ``merged_weight(base, A, B, scale)`` from each sync's adapters, so
an adapter-only sync leaves exactly the replica a full load of the merged weights gives. Every
tensor arrives in the replica's dtype (the rollout ranks' broadcast carries that dtype, and the
colocated sync casts the same way), so both paths build the same replica bit for bit.

How a call's prompts are generated (``rl/continuous_batching.py`` runs the loop):

1. Prefill: the admitted prompts, packed, go once through the model's normal packed forward;
   its attention state (``PrefillAttention``, ``rl/kv_cache.py``) writes every layer's K/V into
   each prompt's ``num_samples`` cache rows. The first token of each row is sampled from its
   prompt's last-position logits. A vision-language model's prompts bring their images: the
   vision tower encodes the admitted prompts' images in one packed call, once per prompt however
   many samples it has, and the features replace the placeholder tokens' embeddings through
   ``vision_index``, exactly as in training.
2. Decode: one token per running row per step at the row's own position (RoPE included);
   attention reads the row's cache slots ``0..position`` (``DecodeAttention``). Finished rows
   leave the batch and queued prompts take their rows. Generated tokens are text: decoding
   never touches the vision tower.

``compile=True`` compiles the decode step (``torch.compile``; on CUDA with
``mode="reduce-overhead"``, CUDA graphs): it then runs on a few bucket sizes of rows (powers of
two from 8, and the capacity) over every slot of the cache, whose slots are a power of two from
64 too (``cache_slots``), so that each (rows, slots) bucket is one graph and a run has few of
them. Prefill and observation feeds stay eager (their shapes vary).

``kv_cache=False`` reruns the whole packed model on every row's sequence so far at every step:
the reference the cache is tested against.

``record_routing`` (a MoE model): every forward also returns the top-k experts each token used
in each MoE layer, and each rollout keeps those of the positions it fed (``Rollout.routing``):
a sampled token's routing is the one that produced the logits it was sampled from, which the
trainer can replay (docs/moe.md). Each forward's experts of its fed positions cross to the host
in one copy, compacted to ``routing_dtype``; a prefill's are its prompts', shared by their samples.

Randomness (``rl/sampling.py``): row (prompt index p, sample index s) draws one uniform per step
from its own stream seeded with ``rollout_seed(seed, step, p, s)``. A rollout therefore depends
only on (weights, prompt, params, seed, step, p, s), not on the batch it is generated in, the
order of prompts, ``max_prompts_per_batch`` or the device count, up to the rounding of float
kernels for other batch shapes (which can only change a token when its uniform falls within
that rounding of a CDF step).
"""

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from torchtitan_rl.data.vision_samples import VisionDataConfig, image_vision_rows
from torchtitan_rl.distributed.utils import full_tensor
from torchtitan_rl.models.attention import AttentionState, build_attention_context
from torchtitan_rl.models.lora import LoRASettings, adapted_module_name, add_adapters, is_adapter_key, merged_weight
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs
from torchtitan_rl.models.registry import spec_for_args
from torchtitan_rl.models.vlm.model import VisionInputs
from torchtitan_rl.rl.continuous_batching import ContinuousBatch, PromptBatch, PromptImages, pack_sequences
from torchtitan_rl.rl.kv_cache import DecodeAttention, KVCache, PrefillAttention
from torchtitan_rl.rl.sampling import SamplingParams


@dataclass
class Rollout:
    prompt_index: int  # the caller's global index of the prompt in the step
    sample_index: int  # 0..num_samples-1
    prompt_tokens: list[int]
    completion_tokens: list[int]  # generated tokens, the stop token included when it stopped
    logprobs: list[float]  # log_softmax(logits / temperature) at each completion token (T=1 when greedy)
    stop_reason: str  # "stop" (a stop token was generated) or "length" (max_new_tokens)
    version: int = 0  # the version of the weights that generated it (the RL step they are from)
    images: PromptImages = ()  # the prompt's images: its training sample carries them too
    # With record_routing: [m, MoE layers, top_k] experts (routing_dtype) of the last m input
    # positions of prompt_tokens + completion_tokens (the last token is never fed, so it has none):
    # aligned with the training sample's input_ids[-m:]. None without recording.
    routing: np.ndarray | None = None


class RolloutEngine(Protocol):
    """The seam a GPU inference engine can implement later."""

    def update_weights(self, model: torch.nn.Module, version: int = 0) -> int: ...  # the bytes taken

    def generate(
        self,
        prompts: list[list[int]],
        prompt_indices: list[int],
        num_samples: int,
        params: SamplingParams,
        seed: int,
        step: int,
        images: Sequence[PromptImages] | None = None,
    ) -> list[Rollout]: ...

    def take_phase_seconds(self) -> dict[str, float]: ...  # phase -> seconds since the last call; reset


def sync_names(trains: dict[str, bool], full: bool) -> list[str]:
    """The parameters a weight sync carries, in the order every side uses: all of them (``full``,
    into a replica without weights) or those that train. ``trains``: name -> requires_grad."""
    return sorted(name for name, trained in trains.items() if full or trained)


def trained_parameters(
    args: Qwen3ModelArgs, lora: LoRASettings | None, freeze_vision: bool = False
) -> dict[str, tuple[torch.Size, bool]]:
    """name -> (shape, whether it trains) of the parameters of the model the trainers train:
    the plain model, or with ``lora`` its adapted form, with ``freeze_vision`` its vision tower
    frozen, as ``recipes.base.build_model`` builds it (on meta, nothing allocated)."""
    spec = spec_for_args(args)
    with torch.device("meta"):
        model = spec.model_cls(args)
        if lora is not None:
            add_adapters(model, lora, spec.lora_targets)
        if freeze_vision:
            model.vision_tower.requires_grad_(False)
    return {name: (p.shape, p.requires_grad) for name, p in model.named_parameters()}


class TorchGenerator:
    """``RolloutEngine`` on an unsharded replica of the trained model (CPU or CUDA).

    The KV cache holds the rows of at most ``max_prompts_per_batch`` prompts (``num_samples``
    rows each) at once: per layer, K and V of shape ``[rows, longest prompt + max_new_tokens,
    n_kv_heads, head_dim]`` (single turn); further prompts take the rows of finished ones.
    ``compile``: compile the decode step (see above).

    ``lora``: the trained model carries these adapters; the replica holds its merged weights and
    keeps a copy of each adapted layer's base (in the replica's dtype: a bfloat16 replica merges
    into the bfloat16-rounded base, as it would round a full model's weights).

    ``vision``: how a vision-language model's prompt images are decoded and cut into patches
    (the loader's settings); ``freeze_vision``: the trained model's vision tower is frozen, so
    syncs after the first leave the replica's tower as it is.

    ``record_routing`` (a MoE model only): ``"completion"`` records the experts of every position
    from the last prompt token on (each samples a token or reads an observation), ``"all"`` of
    every position, prompt included; ``"off"`` records nothing.
    """

    def __init__(
        self,
        model_args: Qwen3ModelArgs,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        max_prompts_per_batch: int = 8,
        kv_cache: bool = True,
        lora: LoRASettings | None = None,
        vision: VisionDataConfig | None = None,
        freeze_vision: bool = False,
        compile: bool = False,
        record_routing: str = "off",
    ):
        if max_prompts_per_batch < 1:
            raise ValueError(f"max_prompts_per_batch must be >= 1, got {max_prompts_per_batch}")
        if record_routing not in ("off", "completion", "all"):
            raise ValueError(f"record_routing must be 'off', 'completion' or 'all', got {record_routing!r}")
        if record_routing != "off" and not model_args.is_moe:
            raise ValueError(f"record_routing={record_routing!r} needs a MoE model; this one has no MoE layers")
        spec = spec_for_args(model_args)
        if vision is not None and not spec.takes_images:
            raise ValueError(f"vision settings given for a {spec.name!r} model, which takes no images")
        self.args = model_args
        self.device = torch.device(device)
        self.max_prompts_per_batch = max_prompts_per_batch
        self.kv_cache = kv_cache
        self.vision = vision
        self.record_routing = record_routing
        # Fixed for the replica's life, so a compiled decode step never recompiles for it;
        # ``not_recording`` only stops the copies out.
        self._returns_experts = record_routing != "off"
        with torch.device("meta"):
            model = spec.model_cls(model_args)
        # Uninitialized until update_weights: there is nothing to sample from before it.
        self.model = model.to_empty(device=self.device).to(dtype).eval().requires_grad_(False)
        self._loaded = False
        self.version = 0  # of the weights loaded last; every rollout carries it
        self.lora = lora
        self.sources = trained_parameters(model_args, lora, freeze_vision)
        self._params = dict(self.model.named_parameters())
        self._adapted = {adapted_module_name(name) for name in self.sources if is_adapter_key(name)}
        self._bases: dict[str, torch.Tensor] = {}  # adapted layer -> its base weight, as last received
        self._pending: dict[str, torch.Tensor] = {}  # the adapters of the sync in progress
        self._phase_seconds = {"prefill": 0.0, "decode": 0.0}
        self.compile = compile
        # One graph per decode bucket (static shapes: dynamic=False); the cache is written in place,
        # and on CUDA its address is marked static (new_cache) so that CUDA graphs can replay it.
        mode = "reduce-overhead" if self.device.type == "cuda" else None
        self._decode_forward = torch.compile(self._forward, mode=mode, dynamic=False) if compile else self._forward
        if compile:
            # Past dynamo's recompile limit (8 by default) further buckets would silently run
            # eagerly, as 256 rows of varied lengths did on an H100.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, MAX_DECODE_GRAPHS)

    def add_phase_seconds(self, phase: str, seconds: float) -> None:
        self._phase_seconds[phase] += seconds

    def take_phase_seconds(self) -> dict[str, float]:
        """Seconds spent since the last call in prefill (prompts, their images through the vision
        tower, the first token) and in decoding the other tokens; resets both."""
        taken, self._phase_seconds = self._phase_seconds, {"prefill": 0.0, "decode": 0.0}
        return taken

    @contextlib.contextmanager
    def not_recording(self):
        """Generate without recording routing inside the block (evaluation: nothing trains on it)."""
        mode, self.record_routing = self.record_routing, "off"
        try:
            yield
        finally:
            self.record_routing = mode

    @property
    def routing_dtype(self) -> torch.dtype:
        """The dtype of recorded experts: one byte per expert id where the ids fit."""
        return torch.uint8 if self.args.num_experts <= 256 else torch.int16

    @property
    def is_loaded(self) -> bool:
        return self._loaded

    def next_sync(self) -> list[tuple[str, torch.Size]]:
        """(name, full shape) of the trained model's parameters the next sync takes, in order:
        every one while the replica has no weights, then only those that train."""
        names = sync_names({name: trains for name, (_, trains) in self.sources.items()}, not self._loaded)
        return [(name, self.sources[name][0]) for name in names]

    @torch.no_grad()
    def update_weights(self, model: torch.nn.Module, version: int = 0) -> int:
        """Take the trained ``model``'s weights (plain, FSDP2, HSDP or TP; ``next_sync`` says
        which) by name; ``version`` tags the rollouts generated with them. Returns the bytes
        taken, in the replica's dtype.

        A sharded parameter is gathered with ``full_tensor()``, a collective: every rank of the
        job must call this at the same time. Parameters go in ``next_sync``'s order, which is
        the same on every rank; a tied embedding is one parameter, gathered once.
        """
        source = dict(model.named_parameters())
        self._check_names(source.keys())
        num_bytes = sum(self._take(name, full_tensor(source[name])) for name, _ in self.next_sync())
        self._finish(version)
        return num_bytes

    @torch.no_grad()
    def update_weights_from(
        self, full_parameters: Callable[[list[str]], Iterable[tuple[str, torch.Tensor]]], version: int
    ) -> int:
        """``update_weights`` from ``full_parameters(names)``, which yields each named whole
        parameter in turn (``Engine.full_parameters``: any layout, pipeline stages included).
        Collective like it."""
        return self.load_weight_stream(full_parameters([name for name, _ in self.next_sync()]), version)

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> int:
        """Take full (unsharded) ``tensors``, exactly the ones ``next_sync`` names: weights that
        arrived from elsewhere, e.g. a trainer's broadcast to a rollout rank. Returns their bytes
        in the replica's dtype."""
        names = [name for name, _ in self.next_sync()]
        if set(tensors) != set(names):
            raise ValueError(
                f"a weight sync into a replica {'with' if self._loaded else 'without'} weights takes "
                f"{len(names)} tensors: missing {sorted(set(names) - set(tensors))}, unexpected "
                f"{sorted(set(tensors) - set(names))}"
            )
        return self.load_weight_stream(((name, tensors[name]) for name in names), version)

    def load_weight_stream(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """``load_weights`` for tensors that arrive one after the other, in ``next_sync``'s
        order: each is taken as it comes, so the caller can free what carried it (a rollout
        rank's broadcast bucket) before the next arrives and never holds the model twice."""
        names = [name for name, _ in self.next_sync()]
        num_bytes = num_taken = 0
        for name, value in named_tensors:
            if num_taken == len(names) or name != names[num_taken]:
                expected = names[num_taken] if num_taken < len(names) else "nothing more"
                raise ValueError(f"a weight sync takes next_sync's tensors in order: expected {expected}, got {name}")
            num_bytes += self._take(name, value)
            num_taken += 1
            del value  # before the next arrives: the caller may free its buffer then
        if num_taken != len(names):
            raise ValueError(f"a weight sync ended after {num_taken} of its {len(names)} tensors")
        self._finish(version)
        return num_bytes

    def _take(self, name: str, value: torch.Tensor) -> int:
        """Copy one parameter of the trained model into the replica, or keep it for the merge
        (an adapter, an adapted layer's base); its bytes in the replica's dtype."""
        dtype = self.model.output.weight.dtype
        if is_adapter_key(name):
            # A copy: ``value`` may be a view of a buffer the caller frees after this call.
            self._pending[name] = value.to(self.device, dtype, copy=True)
        elif (module := name.removesuffix(".weight")) in self._adapted:
            self._bases[module] = value.to(self.device, dtype, copy=True)
        else:
            self._params[name].copy_(value)
        return value.numel() * dtype.itemsize

    def _finish(self, version: int) -> None:
        """Merge every adapted layer from its kept base and the adapters just taken."""
        for module in sorted(self._adapted):
            a, b = (self._pending.pop(f"{module}.lora_{x}.weight") for x in "ab")
            self._params[f"{module}.weight"].copy_(merged_weight(self._bases[module], a, b, self.lora.scale))
        assert not self._pending, sorted(self._pending)
        self._loaded = True
        self.version = version

    def _check_names(self, names) -> None:
        expected = set(self.sources)
        if set(names) != expected:
            raise ValueError(
                "the trained model's parameters do not match the generator's model_args and LoRA settings: missing "
                f"{sorted(expected - set(names))}, unexpected {sorted(set(names) - expected)}"
            )

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        prompt_indices: list[int],
        num_samples: int,
        params: SamplingParams,
        seed: int,
        step: int,
        images: Sequence[PromptImages] | None = None,
    ) -> list[Rollout]:
        """One rollout per (prompt, sample), ordered by prompt (as given), then sample index.

        ``images[i]`` are prompt i's images (a vision-language model only; None: no prompt has
        any). No prompts give no rollouts: a rank's share of a step can be empty (TP / CP peers
        split their prompts among themselves), and generation involves no collective.
        """
        self.check_inputs(prompts, prompt_indices, num_samples, params, images)
        if not prompts:
            return []
        batch = PromptBatch(prompts, num_samples, self.device, list(images) if images and any(images) else None)
        pairs = [(p, s) for p in prompt_indices for s in range(num_samples)]
        # One turn: no row reaches max_len before max_new_tokens ends it.
        max_len = max(len(p) for p in prompts) + params.max_new_tokens
        rows = ContinuousBatch(self, batch, pairs, params, seed, step, None, 1, max_len).run()
        return [
            Rollout(
                p,
                s,
                list(prompts[r // num_samples]),
                row.tokens[len(prompts[r // num_samples]) :],
                row.logprobs[len(prompts[r // num_samples]) :],
                "stop" if row.end_reason == "done" else "length",
                self.version,
                batch.images[r // num_samples] if batch.images is not None else (),
                row.routing,
            )
            for r, ((p, s), row) in enumerate(zip(pairs, rows))
        ]

    def check_inputs(self, prompts, prompt_indices, num_samples: int, params: SamplingParams, images=None) -> None:
        """ValueError unless ``generate`` can take these inputs; RuntimeError before the first weights."""
        if len(prompts) != len(prompt_indices):
            raise ValueError(f"{len(prompts)} prompts but {len(prompt_indices)} prompt_indices")
        if images is not None:
            if len(images) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(images)} image lists")
            if self.vision is None and any(images):
                raise ValueError(
                    "prompts with images need a vision-language model and its vision settings (TorchGenerator vision=)"
                )
        if len(set(prompt_indices)) != len(prompt_indices):
            raise ValueError("prompt_indices must be distinct: each one seeds its own random streams")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        vocab = self.args.vocab_size
        for token in params.stop_token_ids:
            if not 0 <= token < vocab:
                raise ValueError(f"stop token {token} is outside the vocabulary [0, {vocab})")
        for index, prompt in zip(prompt_indices, prompts):
            if not prompt:
                raise ValueError(f"prompt {index} is empty")
            if not 0 <= min(prompt) <= max(prompt) < vocab:
                raise ValueError(f"prompt {index} has a token id outside the vocabulary [0, {vocab})")
            if len(prompt) + params.max_new_tokens > self.args.max_seq_len:
                raise ValueError(
                    f"prompt {index}: {len(prompt)} prompt tokens + max_new_tokens {params.max_new_tokens} "
                    f"exceed the model's max_seq_len {self.args.max_seq_len}"
                )
        if not self._loaded:
            raise RuntimeError("call update_weights before generate: the replica has no weights yet")

    def vision_inputs(self, batch: PromptBatch, num_inputs: list[int], prompt_of: list[int]) -> VisionInputs | None:
        """The images of packed sequences, sequence k of ``num_inputs[k]`` tokens starting with
        prompt ``prompt_of[k]`` of ``batch`` (whose images it holds); None for a text batch.
        Each prompt's images are decoded once, whatever the number of sequences that hold them."""
        if batch.images is None:
            return None
        patches, grids, index = [], [], []
        num_features = 0
        for prompt, length in zip(prompt_of, num_inputs):
            rows = image_vision_rows(batch.images[prompt], length, self.vision.merge_size)
            index.append(torch.where(rows >= 0, rows + num_features, rows))
            for image in batch.loaded_images(prompt, self.vision):
                patches.append(image.patches)
                grids.append((image.rows, image.cols))
            num_features += int((rows >= 0).sum())
        if not grids:
            return None
        return VisionInputs(
            torch.cat(patches).to(self.device, self.model.output.weight.dtype),
            tuple(grids),
            torch.cat(index).to(self.device),
        )

    def logits_and_routing(
        self,
        tokens,
        positions,
        seq_ids,
        attention: AttentionState | None = None,
        rows: torch.Tensor | None = None,
        vision: VisionInputs | None = None,
        keep: torch.Tensor | slice | None = None,
    ) -> tuple[torch.Tensor, np.ndarray | None]:
        """float32 logits of the ``rows`` (default: all) of one packed forward that attends with
        ``attention`` (default: the model's plain packed attention), with ``vision``'s images;
        and when the generator records routing and ``keep`` (an index or a slice of the tokens)
        is given, the experts ``[kept tokens, MoE layers, top_k]`` of those tokens on the host
        (else None). Every forward of the generator goes through here; a decode step's is the
        compiled one."""
        images = () if vision is None else (vision,)
        forward = self._decode_forward if isinstance(attention, DecodeAttention) else self._forward
        logits, experts = forward(tokens, positions, seq_ids, attention, rows, images)
        if experts is None or keep is None:
            return logits, None
        return logits, experts[keep].cpu().numpy()  # one device-to-host copy, of the kept tokens only

    def _forward(self, tokens, positions, seq_ids, attention, rows, images) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.args.is_moe:
            # A MoE model also returns its router statistics, with the experts used when asked.
            hidden, stats = self.model(
                tokens, positions, seq_ids, *images, attention=attention, record_routing=self._returns_experts
            )
            # [L, T, k] -> [T, L, k] (per token), compacted on the device: fewer bytes to copy.
            experts = None if stats.experts is None else stats.experts.transpose(0, 1).to(self.routing_dtype)
        else:
            hidden, experts = self.model(tokens, positions, seq_ids, *images, attention=attention), None
        if rows is not None:
            hidden = hidden.index_select(0, rows)
        return self.model.output(hidden).float(), experts

    def new_cache(self, num_rows: int, num_slots: int, old: KVCache | None = None, num_kept: int = 0) -> KVCache:
        """A zeroed KV cache of this model with room for ``num_slots`` slots (``cache_slots``), in
        the replica's dtype and on its device, holding ``old``'s first ``num_kept`` rows."""
        num_slots = cache_slots(num_slots, self.compile)
        shape = (self.args.n_layers, num_rows, num_slots, self.args.n_kv_heads, self.args.head_dim)
        cache = KVCache.zeros(shape, self.model.output.weight.dtype, self.device)
        if self.compile and self.device.type == "cuda":
            # Written in place by every decode step: CUDA graphs replay it only at a fixed address.
            torch._dynamo.mark_static_address(cache.k)
            torch._dynamo.mark_static_address(cache.v)
        if old is not None:
            old.copy_rows_to(cache, num_kept)
        return cache

    def prefill(
        self, batch: PromptBatch, cache: KVCache, prompts: list[int], first_row: int
    ) -> tuple[torch.Tensor, np.ndarray | None]:
        """Packed forward of ``batch``'s prompts ``prompts``, each once, writing their keys and
        values to the first slots of cache rows ``first_row``, ``first_row + 1``, ... (each prompt's
        ``batch.num_samples`` rows in turn); returns those rows' first logits, and when recording
        routing the experts of each prompt's recorded positions (every position with ``"all"``,
        else its last), prompt after prompt: each prompt's are its samples'."""
        sequences = [torch.tensor(batch.prompts[p], device=self.device) for p in prompts]
        ids, positions, seq_ids, last = pack_sequences(sequences)
        samples = batch.num_samples
        # Token j goes to slot positions[j] of its prompt's rows first_row + seq_ids[j] * S + 0..S-1.
        rows = (first_row + seq_ids[:, None] * samples + torch.arange(samples, device=self.device)).flatten()
        slots = positions.repeat_interleave(samples)
        context = build_attention_context(self.args.attn_backend, seq_ids, positions)
        attention = PrefillAttention(context, cache, rows, slots, samples)
        vision = self.vision_inputs(batch, [s.numel() for s in sequences], prompts)
        keep = {"off": None, "all": slice(None)}.get(self.record_routing, last)
        logits, experts = self.logits_and_routing(ids, positions, seq_ids, attention, last, vision, keep)
        return logits.repeat_interleave(samples, dim=0), experts

    def decode(self, tokens: list[int], positions: list[int], cache: KVCache) -> tuple[torch.Tensor, np.ndarray | None]:
        """One token for each of ``cache``'s first ``len(tokens)`` rows, at its own position,
        attending to its slots ``0..position``; their logits and, when recording routing, experts.

        Eager, the step runs on exactly these rows over the slots up to the furthest position.
        Compiled, it runs on the smallest bucket of rows that holds them (``decode_bucket``) over
        every slot: the padding rows feed token 0 at position 0 of the free rows after the
        running ones, which a prefill overwrites before anything reads them.
        """
        num_rows, span = len(tokens), max(positions) + 1
        if self.compile:
            padding = decode_bucket(num_rows, cache.num_rows) - num_rows
            tokens, positions, span = tokens + [0] * padding, positions + [0] * padding, cache.num_slots
        ids = torch.tensor(tokens, device=self.device)
        where = torch.tensor(positions, device=self.device)
        rows = torch.arange(len(tokens), device=self.device)
        attention = DecodeAttention.build(cache, where, span)
        keep = None if self.record_routing == "off" else slice(num_rows)
        logits, experts = self.logits_and_routing(ids, where, rows, attention, keep=keep)
        return logits[:num_rows], experts


# Compiled decode graphs a generator may need: row buckets (8, 16, ... and the capacity: 11 up to
# 4096 rows) times slot buckets (64, 128, ...: 11 up to 65536 slots).
MAX_DECODE_GRAPHS = 121


def cache_slots(num_slots: int, compiled: bool) -> int:
    """The slots a cache is made with to hold ``num_slots``: as many eagerly; compiled, the
    smallest power of two from 64 that holds them (at most twice the memory, for a number of
    decode graphs that grows with the log of the longest sequence, not with each length)."""
    if not compiled:
        return num_slots
    bucket = 64
    while bucket < num_slots:
        bucket *= 2
    return bucket


def decode_bucket(num_rows: int, capacity: int) -> int:
    """The rows a compiled decode step runs on for ``num_rows`` running rows of a cache of
    ``capacity`` rows: the smallest power of two from 8 that holds them, at most ``capacity``."""
    bucket = 8
    while bucket < num_rows:
        bucket *= 2
    return min(bucket, capacity)
