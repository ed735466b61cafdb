"""Qwen3 decoder (dense, or Qwen3-MoE with some layers' SwiGLU replaced by experts),
single-device PyTorch on packed micro-batches.

Parallelism (FSDP, TP, CP) is applied from outside by ``parallelize.py``. The model has no
buffers: rotary tables are computed from the explicit per-token positions on every forward,
so a model built on the meta device only needs ``to_empty`` + ``init_weights``.
"""

import dataclasses
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_rl.models.attention import (
    AttentionState,
    LayerAttention,
    build_attention_context,
)
from torchtitan_rl.models.moe import MoE, RouterStats
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs

INIT_STD = 0.02
# The layers LoRA can adapt (``lora.target_modules`` names -> full module names they match).
LORA_TARGETS = {
    **{name: rf"layers\.\d+\.attention\.{name}" for name in ("wq", "wk", "wv", "wo")},
    **{name: rf"layers\.\d+\.feed_forward\.{name}" for name in ("w1", "w2", "w3")},
    "output": "output",
}


def param_seed(seed: int, fqn: str) -> int:
    """Seed for one parameter's generator: depends on the run seed and the parameter name only.

    Activation checkpointing, compile and FSDP2 keep the module tree (they replace ``forward``
    or the class of a module), so the names, and with them the seeds, are the same under any
    of them."""
    return (seed * 0x9E3779B1 + zlib.crc32(fqn.encode())) % (2**63)


def check_packed_inputs(tokens: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor) -> None:
    """ValueError unless the three per-token tensors of a packed micro-batch are 1-D of equal length."""
    if tokens.dim() != 1 or positions.shape != tokens.shape or seq_ids.shape != tokens.shape:
        raise ValueError(
            "tokens, positions and seq_ids must be 1-D of equal length, got "
            f"{tuple(tokens.shape)}, {tuple(positions.shape)}, {tuple(seq_ids.shape)}"
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 even for bf16 activations, as Qwen3 was trained.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[T, 1, head_dim]`` for each token's own position (HF Qwen3 layout)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device)
    inv_freq = 1.0 / (theta ** (exponents.float() / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` with the rotate-half convention."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, args: Qwen3ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        attention: LayerAttention,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        # -1 heads: under tensor parallel each rank holds only its share of the heads.
        q = self.wq(x).view(num_tokens, -1, self.head_dim)
        k = self.wk(x).view(num_tokens, -1, self.head_dim)
        v = self.wv(x).view(num_tokens, -1, self.head_dim)
        cos, sin = rotary
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(k), cos, sin)
        out = attention(q, k, v)
        return self.wo(out.reshape(num_tokens, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block, attention then SwiGLU; the vision tower reuses it with its own
    attention module (``attention(x, rotary, layer_attention)``)."""

    def __init__(self, attention: nn.Module, dim: int, hidden_dim: int, norm_eps: float):
        super().__init__()
        self.attention = attention
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.feed_forward = FeedForward(dim, hidden_dim)
        self.ffn_norm = RMSNorm(dim, norm_eps)

    def forward(self, x, rotary, attention: LayerAttention):
        x = x + self.attention(self.attention_norm(x), rotary, attention)
        return x + self.feed_forward(self.ffn_norm(x))


@dataclass(frozen=True)
class MoEContext:
    """Per-forward metadata of the MoE layers, built once per forward like the attention
    context: this rank's tokens' ``seq_ids`` and ``router_mask`` (what the residual stream
    holds, see ``Qwen3Model.shard_tokens``), the micro-batch's number of sequences and, when
    routing is replayed, this rank's tokens' recorded experts (``[T, k]`` for one layer, the
    block's; ``for_layer`` picks it from ``[T, L, k]``)."""

    seq_ids: torch.Tensor
    router_mask: torch.Tensor
    num_seqs: int
    replayed: torch.Tensor | None = None
    replay: bool = True  # False: the recorded experts are only compared with the router's choice

    def for_layer(self, slot: int) -> "MoEContext":
        """The context of the ``slot``-th MoE layer: its column of the replayed experts."""
        if self.replayed is None:
            return self
        return dataclasses.replace(self, replayed=self.replayed[:, slot])


class MoETransformerBlock(nn.Module):
    """Pre-norm residual block, attention then a mixture of experts (``moe``); returns the
    residual stream, the layer's router statistics ``(counts, prob_sums, z_sums, agreement)``
    and the experts its tokens used."""

    def __init__(self, args: Qwen3ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = MoE(
            args.dim,
            args.moe_hidden_dim,
            args.num_experts,
            args.num_experts_per_tok,
            args.norm_topk_prob,
            args.experts_impl,
        )
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, rotary, attention: LayerAttention, moe_context: MoEContext):
        x = x + self.attention(self.attention_norm(x), rotary, attention)
        out, *routing = self.moe(
            self.ffn_norm(x),
            moe_context.seq_ids,
            moe_context.router_mask,
            moe_context.num_seqs,
            moe_context.replayed,
            moe_context.replay,
        )
        return x + out, *routing


class WholeTokens:
    """The token shard of a model on one device: its residual stream holds every token of the
    micro-batch. Sequence-parallel TP declares a ``parallelize.TokenShard`` in its place."""

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def replicated(self, values: torch.Tensor) -> torch.Tensor:
        return values


class Qwen3Model(nn.Module):
    def __init__(self, args: Qwen3ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {
                str(i): MoETransformerBlock(args)
                if args.is_moe_layer(i)
                else TransformerBlock(Attention(args), args.dim, args.hidden_dim, args.norm_eps)
                for i in range(args.n_layers)
            }
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)
        if args.score_head:
            # One score per token, read at each sequence's last by a reward model (``engine_scores``)
            # and at every token by a critic (``engine_values``), whose HF form has a bias.
            self.score = nn.Linear(args.dim, 1, bias=args.score_per_token)
        else:
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # The tokens this rank's residual stream holds: all of them unless sequence-parallel
        # TP shards them (``set_token_shard``).
        self.token_shard = WholeTokens()

    def set_token_shard(self, token_shard) -> None:
        """Declare which tokens the residual stream holds (the TP parallelize step does), so
        that per-token inputs (MoE routing metadata, image features) line up with it."""
        self.token_shard = token_shard

    def shard_tokens(self, values: torch.Tensor) -> torch.Tensor:
        """The rows of a per-token tensor of the whole micro-batch that this rank's residual
        stream holds."""
        return self.token_shard(values)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        seq_ids: torch.Tensor,
        router_mask: torch.Tensor | None = None,
        num_seqs: int | None = None,
        *,
        attention: AttentionState | None = None,
        routed_experts: torch.Tensor | None = None,
        replay_routing: bool = True,
        record_routing: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, RouterStats]:
        """Final-normed hidden states ``[T, dim]`` of a packed micro-batch; for an MoE model
        ``(hidden, RouterStats)`` (see ``run_layers`` for ``router_mask``, ``num_seqs``,
        ``attention``, ``routed_experts``, ``replay_routing`` and ``record_routing``).

        Logits are left to the caller (``self.output``), which applies them in token chunks
        so that ``[T, vocab]`` is never materialized at once; so are a reward model's scores
        (``self.score``).
        """
        if self.tok_embeddings is None:
            # A pipeline stage after the first (``distributed.pipeline``): its input is the
            # previous stage's hidden states.
            h = tokens
        else:
            check_packed_inputs(tokens, positions, seq_ids)
            h = self.tok_embeddings(tokens)
        return self.run_layers(
            h,
            positions,
            seq_ids,
            router_mask,
            num_seqs,
            attention=attention,
            routed_experts=routed_experts,
            replay_routing=replay_routing,
            record_routing=record_routing,
        )

    def run_layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        seq_ids: torch.Tensor,
        router_mask: torch.Tensor | None = None,
        num_seqs: int | None = None,
        *,
        attention: AttentionState | None = None,
        routed_experts: torch.Tensor | None = None,
        replay_routing: bool = True,
        record_routing: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, RouterStats]:
        """The decoder stack on input embeddings ``h [T, dim]``: final-normed hidden ``[T, dim]``,
        and for an MoE model also the ``RouterStats`` of its MoE layers.

        Split from ``forward`` so a multimodal model can replace some token embeddings
        (image features) between the embedding lookup and the decoder. ``router_mask [T]``
        (bool, default all true) marks the real tokens whose routing the statistics count;
        ``num_seqs`` (default ``max(seq_ids) + 1``, a host sync) sizes their sequence axis and
        should be passed whenever ``seq_ids`` may not show the last sequence (context parallel).
        Dense models ignore both. ``attention`` (``models.attention.AttentionState``) is what the
        layers attend with: by default plain packed attention under ``args.attn_backend``;
        context parallel and a generator's KV cache pass their own.

        ``routed_experts [T, L, k]`` (int; L = every MoE layer of the model, a pipeline stage
        included): experts to route each token to instead of each layer's own top-k (routing
        replay, ``models.moe``), -1 where a token routes itself; with ``replay_routing`` false
        they are only compared with the layers' own choice (``RouterStats.agreement``).
        ``record_routing``: also return the experts every token used (``RouterStats.experts``).
        Dense models ignore all three.
        """
        # Only h's rank is checked: under sequence-parallel TP it holds this rank's share of
        # the T tokens, while positions and seq_ids describe all of them.
        if h.dim() != 2 or positions.dim() != 1 or seq_ids.shape != positions.shape:
            raise ValueError(
                "run_layers takes h [T, dim] and 1-D positions, seq_ids of equal length, got "
                f"{tuple(h.shape)}, {tuple(positions.shape)}, {tuple(seq_ids.shape)}"
            )
        if attention is None:
            attention = build_attention_context(self.args.attn_backend, seq_ids, positions)
        rotary = rotary_cos_sin(positions, self.args.head_dim, self.args.rope_theta, h.dtype)
        if not self.args.is_moe:
            for name, layer in self.layers.items():
                h = layer(h, rotary, attention.for_layer(int(name)))
            # A pipeline stage before the last has no final norm: the next stage continues from h.
            return h if self.norm is None else self.norm(h)

        moe_context = self._moe_context(h, seq_ids, router_mask, num_seqs, routed_experts, replay_routing)
        stats, experts = [], []
        moe_layers = list(self.args.moe_layers)
        # Layer kinds from the args, not isinstance: wrappers (activation checkpointing,
        # compile) hide the block class.
        for name, layer in self.layers.items():
            layer_attention = attention.for_layer(int(name))
            if self.args.is_moe_layer(int(name)):
                layer_context = moe_context.for_layer(moe_layers.index(int(name)))
                h, *layer_stats, layer_experts = layer(h, rotary, layer_attention, layer_context)
                stats.append(layer_stats)
                if record_routing:
                    experts.append(layer_experts)
            else:
                h = layer(h, rotary, layer_attention)
        if stats:
            counts, prob_sums, z_sums, agreement = (torch.stack(parts) for parts in zip(*stats))
        else:  # a pipeline stage of dense layers only
            counts = prob_sums = h.new_zeros(0, moe_context.num_seqs, self.args.num_experts, dtype=torch.float32)
            z_sums = h.new_zeros(0, moe_context.num_seqs, dtype=torch.float32)
            agreement = h.new_zeros(0, 2, dtype=torch.float32)
        if record_routing:
            k = self.args.num_experts_per_tok
            experts = torch.stack(experts) if experts else h.new_zeros(0, h.shape[0], k, dtype=torch.long)
        h = h if self.norm is None else self.norm(h)
        return h, RouterStats(counts, prob_sums, z_sums, agreement, experts if record_routing else None)

    def _moe_context(
        self,
        h: torch.Tensor,
        seq_ids: torch.Tensor,
        router_mask: torch.Tensor | None,
        num_seqs: int | None,
        routed_experts: torch.Tensor | None = None,
        replay_routing: bool = True,
    ) -> MoEContext:
        if router_mask is None:
            router_mask = torch.ones_like(seq_ids, dtype=torch.bool)
        elif router_mask.shape != seq_ids.shape or router_mask.dtype != torch.bool:
            raise ValueError(
                f"router_mask must be bool of seq_ids' shape {tuple(seq_ids.shape)}, "
                f"got {router_mask.dtype} {tuple(router_mask.shape)}"
            )
        if num_seqs is None:
            if seq_ids.numel() == 0:
                raise ValueError("an empty micro-batch needs an explicit num_seqs")
            num_seqs = int(seq_ids.max()) + 1
        elif isinstance(num_seqs, bool) or not isinstance(num_seqs, int) or num_seqs < 1:
            raise ValueError(f"num_seqs must be a positive int, got {num_seqs!r}")
        expected = (seq_ids.shape[0], len(self.args.moe_layers), self.args.num_experts_per_tok)
        if routed_experts is not None and (routed_experts.shape != expected or routed_experts.is_floating_point()):
            raise ValueError(
                f"routed_experts must be integer [T, MoE layers, top_k] = {expected}, got "
                f"{routed_experts.dtype} {tuple(routed_experts.shape)}"
            )
        local_seq_ids, local_mask = self.shard_tokens(seq_ids), self.shard_tokens(router_mask)
        if local_seq_ids.shape[0] != h.shape[0] or local_mask.shape[0] != h.shape[0]:
            raise ValueError(
                f"shard_tokens gives {local_seq_ids.shape[0]} tokens of metadata for the "
                f"{h.shape[0]} tokens of the residual stream"
            )
        replayed = None if routed_experts is None else self.shard_tokens(routed_experts)
        return MoEContext(local_seq_ids, local_mask, num_seqs, replayed, replay_routing)

    def _apply(self, fn, recurse=True):
        # Moving parameters across devices where ``.data`` cannot be swapped (``to_empty`` off
        # the meta device) creates a new Parameter per module, which would silently untie.
        module = super()._apply(fn, recurse)
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        return module

    def blocks(self) -> list[nn.Module]:
        """The repeated transformer blocks, in forward order (units of activation
        checkpointing and compilation)."""
        return list(self.layers.values())

    def num_params(self) -> int:
        """Distinct parameters (tied embeddings counted once)."""
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def init_param_(self, fqn: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Fill ``tensor`` (the full-shape parameter named ``fqn``) in place from ``generator``."""
        *_, module_name, param_name = fqn.split(".")
        if module_name == "experts" and param_name in ("w1", "w2", "w3"):
            # Stacked experts, each slice initialized like the dense SwiGLU's weight.
            std = INIT_STD if param_name != "w2" else INIT_STD / math.sqrt(2 * self.args.n_layers)
            nn.init.trunc_normal_(tensor, std=std, a=-3 * std, b=3 * std, generator=generator)
            return
        if fqn == "score.bias":
            tensor.zero_()
            return
        if param_name != "weight":
            raise ValueError(f"no init rule for parameter {fqn!r}")
        if module_name.endswith("norm"):
            tensor.fill_(1.0)
            return
        if module_name in ("tok_embeddings", "output", "score", "wq", "wk", "wv", "w1", "w3"):
            std = INIT_STD
        elif module_name == "router":
            # As HF and torchtitan. Small logits make routing near-uniform at first, where
            # top-k near-ties flip on float rounding: exactness tests draw their own router.
            std = INIT_STD
        elif module_name in ("wo", "w2"):
            # Residual-stream writers: keep the residual variance independent of depth.
            std = INIT_STD / math.sqrt(2 * self.args.n_layers)
        else:
            raise ValueError(f"no init rule for parameter {fqn!r}")
        nn.init.trunc_normal_(tensor, std=std, a=-3 * std, b=3 * std, generator=generator)

    def init_weights(self, seed: int) -> None:
        """Single-device init; each parameter depends only on (seed, name, shape, device type)."""
        for fqn, param in self.named_parameters():
            generator = torch.Generator(device=param.device)
            generator.manual_seed(param_seed(seed, fqn))
            self.init_param_(fqn, param, generator)
