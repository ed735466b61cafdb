"""Bytes a forward keeps for backward, and the loss's buffers, counted tensor by tensor from
what the model's code saves (``models.qwen3.model``, ``models.moe``, ``losses.logprobs``).

Notation: ``T`` tokens of the micro-batch (a CP rank's share under context parallel), of which
the residual stream holds ``T / tp`` under sequence-parallel TP while attention and the MLP see
all ``T`` with ``1 / tp`` of the heads and hidden units; ``b`` bytes per activation element
(the compute dtype). What one dense block saves:

- each RMSNorm (two per block, over ``T/tp x dim``; QK-norm over ``T x heads x head_dim``): its
  input in float32 (the block's own tensor in float32, a copy in bfloat16), the normalized
  output in ``b`` and one float32 ``rstd`` per row;
- the gathered input of the attention projections and of the MLP (``T x dim``), once each;
- attention: rotated q and k (or their copies padded into the kernel's batch), v, the output,
  its copy in token order that ``wo`` reads, and the float32 log-sum-exp per query and head.
  (On the CPU, documents of a single length need no copy: the estimate is then
  ``T x heads x head_dim`` elements per block high);
- SwiGLU: ``w1 x``, ``silu(w1 x)``, ``w3 x`` and their product (``T x hidden/tp`` each).

An MoE block saves the router's float32 logits, probabilities and the statistics' copies of
them, each routed copy of a token (``T x top_k``), the experts' four SwiGLU tensors per routed
copy, their outputs before and after the router weights, and the routing's index tensors.
"""

from dataclasses import dataclass

from torchtitan_rl.distributed.activation_checkpoint import checkpointed_positions

FLOAT32 = 4
# The decoder's linear layers LoRA may adapt, in the names of ``lora.target_modules``.
ADAPTABLE = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


@dataclass(frozen=True)
class MicroBatch:
    """What a block's activations depend on besides the model: ``num_tokens`` of the micro-batch
    (a CP rank's share), the TP degree, ``b`` bytes per element of the compute dtype, and under
    LoRA its rank and the adapted layers (whose norms are frozen: a frozen norm weight needs no
    normalized input saved for its gradient, while each adapter saves its ``T x rank`` middle)."""

    num_tokens: int
    tp: int
    b: int
    lora_rank: int = 0
    adapted: frozenset[str] = frozenset()
    # The first block's input needs no gradient (LoRA with frozen embeddings): autograd records
    # nothing of that block's paths until an adapter joins them.
    frozen_input: bool = False

    @property
    def local(self) -> int:
        """Tokens of the residual stream (sequence-parallel TP splits them)."""
        return self.num_tokens // self.tp

    def norm(self, num_rows: int, width: int) -> int:
        """An RMSNorm's saved input in float32, its normalized output (trainable weight only),
        its float32 ``rstd`` per row."""
        normalized = 0 if self.lora_rank else num_rows * width * self.b
        return num_rows * width * FLOAT32 + normalized + num_rows * FLOAT32

    def adapters(self, *names: str) -> int:
        return sum(self.num_tokens * self.lora_rank * self.b for name in names if name in self.adapted)

    def input_of(self, *names: str) -> int:
        """1 when a layer reading the input is trained (its weight's gradient needs the input):
        always without LoRA, under LoRA when one of them is adapted."""
        return int(not self.lora_rank or any(name in self.adapted for name in names))


def attention_bytes(args, mb: MicroBatch, input_grad: bool = True) -> int:
    """Attention's share of a block (its input norm included); ``input_grad``: whether the
    block's input needs a gradient."""
    t, tp, b = mb.num_tokens, mb.tp, mb.b
    q_width, kv_width = args.n_heads * args.head_dim // tp, args.n_kv_heads * args.head_dim // tp
    q_heads, kv_heads = args.n_heads // tp, args.n_kv_heads // tp
    return (
        mb.norm(mb.local, args.dim) * input_grad
        + t * args.dim * b * mb.input_of("wq", "wk", "wv")  # the projections' gathered input
        + mb.norm(t * q_heads, args.head_dim) * (input_grad or "wq" in mb.adapted)  # q_norm
        + mb.norm(t * kv_heads, args.head_dim) * (input_grad or "wk" in mb.adapted)  # k_norm
        + t * (2 * q_width + 2 * kv_width) * b  # rotated q, k; v; attention output
        + t * q_heads * FLOAT32  # log-sum-exp
        + t * q_width * b * mb.input_of("wo")  # wo's input: the output copied back to token order
        + mb.adapters("wq", "wk", "wv", "wo")
    )


def mlp_bytes(args, layer: int, mb: MicroBatch) -> int:
    """The feed-forward half of block ``layer`` (its norm included)."""
    t, local, b = mb.num_tokens, mb.local, mb.b
    if not args.is_moe_layer(layer):
        return (
            mb.norm(local, args.dim)
            + t * args.dim * b * mb.input_of("w1", "w3")
            + (3 + mb.input_of("w2")) * t * args.hidden_dim // mb.tp * b  # w1 x, silu(w1 x), w3 x, the product
            + mb.adapters("w1", "w2", "w3")
        )
    routed = local * args.num_experts_per_tok
    return (
        mb.norm(local, args.dim)
        + local * args.dim * b  # the router's and the experts' input
        + 3 * local * args.num_experts * FLOAT32  # router logits, probabilities, their statistics
        + local * 21  # per token: its top-k bookkeeping, mask and sequence id
        + routed * 32  # per routed copy: expert id, sort order, token index, router weight
        + 3 * routed * args.dim * b  # routed inputs, expert outputs, weighted outputs
        + 4 * routed * args.moe_hidden_dim * b
    )


def layer_bytes(args, layer: int, mb: MicroBatch) -> int:
    """What decoder block ``layer`` keeps for backward without activation checkpointing."""
    return attention_bytes(args, mb, input_grad=layer != 0 or not mb.frozen_input) + mlp_bytes(args, layer, mb)


def vision_tower_bytes(vision_args, num_patches: int, b: int) -> int:
    """What the vision tower saves for ``num_patches`` patches (whole on every TP rank): the
    patches the patch embedding reads, its norm, the 2-D rotary tables, and per block what a
    dense block saves (no QK-norm, as many K/V heads as query heads)."""
    width = vision_args.dim
    norm = num_patches * width * (FLOAT32 + b) + num_patches * FLOAT32
    block = (
        2 * norm
        + 2 * num_patches * width * b  # the gathered inputs
        + 5 * num_patches * width * b  # rotated q and k, v, the output and its copy in patch order
        + num_patches * vision_args.n_heads * FLOAT32
        + 4 * num_patches * vision_args.hidden_dim * b
    )
    patches = num_patches * vision_args.patch_dim * b
    rotary = 2 * num_patches * vision_args.head_dim * b
    return patches + norm + rotary + vision_args.n_layers * block


@dataclass(frozen=True)
class ForwardMemory:
    """One micro-batch's forward and backward: ``saved`` bytes kept for backward by every block
    held, and ``rebuild`` the most alive while backward rebuilds a checkpointed block: the
    saved tensors of the blocks before it (those after it are consumed), its own activations
    again, and the gradients its backward makes of its MLP's activations (0 without
    checkpointing: backward then frees a block's saved tensors about as fast as it makes their
    gradients, so the end of the forward is the peak)."""

    saved: int
    rebuild: int


def forward_memory(args, stages: list[tuple[int, ...]], mb: MicroBatch, ac_mode: str, ac_every: int) -> ForwardMemory:
    """``stages``: the decoder layers of each pipeline stage the rank runs (one tuple without
    pipeline parallel); checkpointing picks its blocks per stage, counting from the stage's first."""
    recomputed = {stage[i] for stage in stages for i in checkpointed_positions(len(stage), ac_mode, ac_every)}
    layers = tuple(layer for stage in stages for layer in stage)
    per_layer = {layer: layer_bytes(args, layer, mb) for layer in layers}
    block_input = mb.local * args.dim * mb.b
    kept = {layer: block_input if layer in recomputed else size for layer, size in per_layer.items()}
    # The rotary tables every layer reads (cos, sin).
    rotary = 2 * mb.num_tokens * args.head_dim * mb.b
    # A block's backward holds the gradients of its SwiGLU's [T, hidden] tensors and of its input.
    gradients = (3 * mb.num_tokens * args.hidden_dim // mb.tp + mb.local * args.dim) * mb.b
    rebuild, before = 0, rotary
    for layer in layers:
        if layer in recomputed:
            rebuild = max(rebuild, before + per_layer[layer] + gradients)
        before += kept[layer]
    return ForwardMemory(saved=sum(kept.values()) + rotary, rebuild=rebuild)


def loss_bytes(args, mb: MicroBatch, output_rows: int, chunk_size: int, entropy: bool, head_trainable: bool) -> int:
    """The chunked loss's peak (``losses.logprobs.token_loss``): the final norm, the hidden states'
    gradient (``T x dim``; under TP the states of every token are gathered too), the head's
    float32 gradient and the product that is added to it, and one chunk's ``[C, V/tp]`` float32
    softmax buffer (a second one with the entropy) besides its logits in a lower compute dtype."""
    if output_rows == 0:
        return 0
    t, b = mb.num_tokens, mb.b
    chunk = min(chunk_size, t)
    head = output_rows * args.dim
    return (
        mb.norm(mb.local, args.dim)
        + t * args.dim * b * (2 if mb.tp > 1 else 1)  # the gradient (and under TP the gathered states)
        + (head * (FLOAT32 + b) if head_trainable else 0)
        + chunk * output_rows * ((b if b != FLOAT32 else 0) + FLOAT32 * (2 if entropy else 1))
    )
