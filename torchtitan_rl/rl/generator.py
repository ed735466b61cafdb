"""Rollout generation: a batched sampler with a static KV cache over the project's models
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

How a batch of prompts is generated (``kv_cache=True``):

1. Prefill: all prompts of the batch, packed, go once through the model's normal packed
   forward; its attention state (``PrefillAttention``, ``rl/kv_cache.py``) writes every
   layer's K/V into each prompt's ``num_samples`` cache rows. The first token of each row is
   sampled from its prompt's last-position logits. A vision-language model's prompts bring
   their images: the vision tower encodes all images of the batch in one packed call, once per
   prompt however many samples it has, and the features replace the placeholder tokens'
   embeddings through ``vision_index``, exactly as in training.
2. Decode: one token per row per step at the row's own position (RoPE included); attention
   reads the row's cache slots ``0..position`` and masks the rest. Finished rows keep running
   (static shapes) but their output is frozen. Generated tokens are text: decoding never
   touches the vision tower.

``kv_cache=False`` reruns the whole packed model on every row's sequence so far at every step:
the reference the cache is tested against, and the baseline of the benchmark.

Randomness: row (prompt index p, sample index s) draws one uniform per step from its own CPU
``torch.Generator`` seeded with ``rollout_seed(seed, step, p, s)``, and picks its token by inverse
CDF. A rollout therefore depends only on (weights, prompt, params, seed, step, p, s), not on the
batch it is generated in, the order of prompts, ``max_prompts_per_batch`` or the device count —
and its numbers are bitwise independent of how prompts are split over ranks whenever
``max_prompts_per_batch`` divides every rank's share (float kernels may round differently for
other batch shapes, which can only matter when a uniform falls within rounding of a CDF step).
"""

import hashlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchtitan_rl.data.vision_samples import PlannedImage, VisionDataConfig, image_vision_rows, load_images
from torchtitan_rl.models.attention import AttentionState, LayerAttention, build_attention_context
from torchtitan_rl.models.lora import LoRASettings, adapted_module_name, add_adapters, is_adapter_key, merged_weight
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs
from torchtitan_rl.models.registry import spec_for_args
from torchtitan_rl.models.vlm.model import VisionInputs
from torchtitan_rl.rl.kv_cache import KVCache, PrefillAttention

PromptImages = tuple[PlannedImage, ...]
"""A prompt's images, in order, with their placeholders' positions in its tokens (none: text)."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")


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


def rollout_seed(seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """Seed of one rollout's generator: the first 8 bytes (little-endian) of the SHA-256 of
    ``"{seed}:{step}:{prompt_index}:{sample_index}"``, cut to 63 bits.

    A cryptographic hash rather than arithmetic on the indices, so that neighbouring rollouts
    get unrelated streams; unlike Python's ``hash()`` it is the same in every process.
    """
    digest = hashlib.sha256(f"{seed}:{step}:{prompt_index}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [R], logprobs [R])`` from ``logits [R, V]`` and one uniform in [0, 1) per row.

    The log-prob is of the full (untruncated) tempered distribution, the one the trainer
    evaluates; top-k / top-p only restrict which tokens can be drawn.
    """
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
        logprobs = logits.log_softmax(dim=-1)
    else:
        scaled = logits / params.temperature
        tokens = _inverse_cdf(_truncated_probs(scaled, params.top_k, params.top_p), uniforms)
        logprobs = scaled.log_softmax(dim=-1)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def _truncated_probs(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """softmax(scaled) restricted to the top-k tokens, then to the nucleus of mass top_p
    (unnormalized: the inverse CDF scales by the total)."""
    if 0 < top_k < scaled.shape[-1]:
        # Tokens tied with the k-th logit are kept too: which of them topk returns is arbitrary.
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix of the sorted tokens whose mass reaches top_p.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    return probs


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token whose CDF interval (vocabulary order, float64) holds ``uniform * total``."""
    cdf = probs.double().cumsum(dim=-1)
    targets = uniforms.double()[:, None] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    # Rounding can put a target at the total; never step past the last drawable token.
    last_drawable = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
    return torch.minimum(tokens, last_drawable)


@dataclass(frozen=True)
class _DecodeAttention:
    """Attention state of a decode step: token r (of row r, at ``positions[r]``) is written to
    its cache slot and attends to the row's slots ``0..position`` (``visible``, over the first
    ``span`` slots: up to the furthest row's position)."""

    cache: KVCache
    rows: torch.Tensor  # [R]
    positions: torch.Tensor  # [R]
    span: int
    visible: torch.Tensor  # [R, 1, 1, span] bool

    def for_layer(self, layer_id: int) -> LayerAttention:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.cache.k[layer_id].index_put_((self.rows, self.positions), k)
            self.cache.v[layer_id].index_put_((self.rows, self.positions), v)
            keys, values = (c[layer_id, :, : self.span].transpose(1, 2) for c in (self.cache.k, self.cache.v))
            out = F.scaled_dot_product_attention(
                q[:, :, None, :],
                keys,
                values,
                attn_mask=self.visible,
                scale=q.shape[-1] ** -0.5,
                enable_gqa=q.shape[1] != k.shape[1],
            )
            return out.squeeze(2)

        return attend


@dataclass
class PromptBatch:
    """The prompts of one batch; row ``i * num_samples + s`` (of its KV cache, of its rollouts)
    is sample s of prompt i."""

    prompts: list[list[int]]
    num_samples: int
    device: torch.device
    images: list[PromptImages] | None = None  # per prompt; None: a text batch
    _loaded: dict = field(default_factory=dict)  # prompt -> its decoded images (SampleImage list)

    def loaded_images(self, prompt: int, vision: VisionDataConfig) -> list:
        """Prompt ``prompt``'s images, decoded and cut into patches once per batch."""
        if prompt not in self._loaded:
            self._loaded[prompt] = load_images(self.images[prompt], vision)
        return self._loaded[prompt]

    @property
    def num_rows(self) -> int:
        return len(self.prompts) * self.num_samples

    @property
    def longest_prompt(self) -> int:
        return max(len(p) for p in self.prompts)

    def row_prompt_lens(self) -> torch.Tensor:
        lens = torch.tensor([len(p) for p in self.prompts], device=self.device)
        return lens.repeat_interleave(self.num_samples)


def pack_sequences(sequences: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, positions, seq_ids, index of each sequence's last token) of packed sequences."""
    device = sequences[0].device
    lens = torch.tensor([s.numel() for s in sequences], device=device)
    seq_ids = torch.repeat_interleave(torch.arange(len(sequences), device=device), lens)
    starts = lens.cumsum(0) - lens
    positions = torch.arange(seq_ids.numel(), device=device) - starts[seq_ids]
    return torch.cat(sequences), positions, seq_ids, lens.cumsum(0) - 1


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole of a (possibly sharded) parameter: ``full_tensor()``, a collective, for a DTensor."""
    return (param.full_tensor() if isinstance(param, DTensor) else param).detach()


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

    Prompts are generated in batches of at most ``max_prompts_per_batch`` prompts (each with
    ``num_samples`` rows), which bounds the KV cache: per layer, K and V of shape
    ``[rows, longest prompt + max_new_tokens, n_kv_heads, head_dim]``. Results are bitwise
    independent of how prompts are split over ranks whenever this size divides every rank's
    share (float kernels may round differently for other batch shapes).

    ``lora``: the trained model carries these adapters; the replica holds its merged weights and
    keeps a copy of each adapted layer's base (in the replica's dtype: a bfloat16 replica merges
    into the bfloat16-rounded base, as it would round a full model's weights).

    ``vision``: how a vision-language model's prompt images are decoded and cut into patches
    (the loader's settings); ``freeze_vision``: the trained model's vision tower is frozen, so
    syncs after the first leave the replica's tower as it is.
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
    ):
        if max_prompts_per_batch < 1:
            raise ValueError(f"max_prompts_per_batch must be >= 1, got {max_prompts_per_batch}")
        spec = spec_for_args(model_args)
        if vision is not None and not spec.takes_images:
            raise ValueError(f"vision settings given for a {spec.name!r} model, which takes no images")
        self.args = model_args
        self.device = torch.device(device)
        self.max_prompts_per_batch = max_prompts_per_batch
        self.kv_cache = kv_cache
        self.vision = vision
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

    def take_phase_seconds(self) -> dict[str, float]:
        """Seconds spent since the last call in prefill (prompts, their images through the vision
        tower, the first token) and in decoding the other tokens; resets both."""
        taken, self._phase_seconds = self._phase_seconds, {"prefill": 0.0, "decode": 0.0}
        return taken

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
        rollouts = []
        for start in range(0, len(prompts), self.max_prompts_per_batch):
            end = start + self.max_prompts_per_batch
            batch_images = list(images[start:end]) if images is not None and any(images[start:end]) else None
            batch = PromptBatch(prompts[start:end], num_samples, self.device, batch_images)
            rollouts += self._generate_batch(batch, prompt_indices[start:end], params, seed, step)
        return rollouts

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

    def _generate_batch(
        self, batch: PromptBatch, prompt_indices: list[int], params: SamplingParams, seed: int, step: int
    ) -> list[Rollout]:
        pairs = [(p, s) for p in prompt_indices for s in range(batch.num_samples)]
        generators = [torch.Generator().manual_seed(rollout_seed(seed, step, p, s)) for p, s in pairs]
        rows, steps = batch.num_rows, params.max_new_tokens
        tokens = torch.zeros(rows, steps, dtype=torch.long, device=self.device)
        logprobs = torch.zeros(rows, steps, device=self.device)
        lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
        stopped = torch.zeros(rows, dtype=torch.bool, device=self.device)
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=self.device)
        next_logits = self._cached_logits(batch, params) if self.kv_cache else self._uncached_logits(batch)
        for t in range(steps):
            start = time.perf_counter()
            uniforms = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
            tokens[:, t], logprobs[:, t] = sample_tokens(next_logits(t, tokens), params, uniforms.to(self.device))
            lengths += ~stopped
            stopped |= torch.isin(tokens[:, t], stop_ids)
            done = bool(stopped.all())  # a host sync: the step's time is the device's too
            self._phase_seconds["prefill" if t == 0 else "decode"] += time.perf_counter() - start
            if done:
                break
        tokens, logprobs, lengths, stopped = (x.tolist() for x in (tokens, logprobs, lengths, stopped))
        return [
            Rollout(
                p,
                s,
                list(batch.prompts[r // batch.num_samples]),
                tokens[r][: lengths[r]],
                logprobs[r][: lengths[r]],
                "stop" if stopped[r] else "length",
                self.version,
                batch.images[r // batch.num_samples] if batch.images is not None else (),
            )
            for r, (p, s) in enumerate(pairs)
        ]

    def _vision_inputs(self, batch: PromptBatch, num_inputs: list[int], prompt_of: list[int]) -> VisionInputs | None:
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

    def logits(
        self,
        tokens,
        positions,
        seq_ids,
        attention: AttentionState | None = None,
        rows: torch.Tensor | None = None,
        vision: VisionInputs | None = None,
    ) -> torch.Tensor:
        """float32 logits of the ``rows`` (default: all) of one packed forward that attends with
        ``attention`` (default: the model's plain packed attention), with ``vision``'s images."""
        images = () if vision is None else (vision,)
        hidden = self.model(tokens, positions, seq_ids, *images, attention=attention)
        if self.args.is_moe:
            hidden = hidden[0]  # a MoE model also returns its router statistics
        if rows is not None:
            hidden = hidden.index_select(0, rows)
        return self.model.output(hidden).float()

    def new_cache(self, num_rows: int, num_slots: int) -> KVCache:
        """A zeroed KV cache of this model, in the replica's dtype and on its device."""
        shape = (self.args.n_layers, num_rows, num_slots, self.args.n_kv_heads, self.args.head_dim)
        return KVCache.zeros(shape, self.model.output.weight.dtype, self.device)

    def _uncached_logits(self, batch: PromptBatch):
        """Step t: rerun every row's prompt + first t sampled tokens; last-position logits."""
        prompts = [torch.tensor(p, device=self.device) for p in batch.prompts]

        def next_logits(t: int, tokens: torch.Tensor) -> torch.Tensor:
            prompt_of = [r // batch.num_samples for r in range(batch.num_rows)]
            sequences = [torch.cat((prompts[prompt_of[r]], tokens[r, :t])) for r in range(batch.num_rows)]
            ids, positions, seq_ids, last = pack_sequences(sequences)
            vision = self._vision_inputs(batch, [s.numel() for s in sequences], prompt_of)
            return self.logits(ids, positions, seq_ids, rows=last, vision=vision)

        return next_logits

    def _cached_logits(self, batch: PromptBatch, params: SamplingParams):
        """Step 0: prefill (fills the cache); step t: decode token t-1 of every row."""
        cache = self.new_cache(batch.num_rows, batch.longest_prompt + params.max_new_tokens)
        prompt_lens = batch.row_prompt_lens()

        def next_logits(t: int, tokens: torch.Tensor) -> torch.Tensor:
            if t == 0:
                return self.prefill(batch, cache)
            positions = prompt_lens + (t - 1)
            return self._decode(tokens[:, t - 1], positions, batch.longest_prompt + t, cache)

        return next_logits

    def prefill(self, batch: PromptBatch, cache: KVCache) -> torch.Tensor:
        """Packed forward of the batch's prompts, each once, writing their keys and values to the
        first slots of ``cache``'s rows (``batch.num_rows`` of them); returns the rows' first logits."""
        ids, positions, seq_ids, last = pack_sequences([torch.tensor(p, device=self.device) for p in batch.prompts])
        samples = batch.num_samples
        # Token j goes to slot positions[j] of its prompt's rows seq_ids[j] * S + 0..S-1.
        rows = (seq_ids[:, None] * samples + torch.arange(samples, device=self.device)).flatten()
        slots = positions.repeat_interleave(samples)
        context = build_attention_context(self.args.attn_backend, seq_ids, positions)
        attention = PrefillAttention(context, cache, rows, slots, samples)
        vision = self._vision_inputs(batch, [len(p) for p in batch.prompts], list(range(len(batch.prompts))))
        return self.logits(ids, positions, seq_ids, attention, last, vision).repeat_interleave(samples, dim=0)

    def _decode(self, tokens, positions, span: int, cache: KVCache) -> torch.Tensor:
        """One token per row at its own position, attending to its cache slots 0..position.

        Only the first ``span`` slots are read: up to the furthest row's position.
        """
        rows = torch.arange(tokens.numel(), device=self.device)
        visible = (torch.arange(span, device=self.device)[None, :] <= positions[:, None])[:, None, None, :]
        attention = _DecodeAttention(cache, rows, positions, span, visible)
        return self.logits(tokens, positions, rows, attention)
