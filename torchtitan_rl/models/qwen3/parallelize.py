"""Apply parallelism to a Qwen3 model from outside (torchtitan's model/parallelize split)."""

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan_rl.distributed.expert_parallel import ExpertParallel
from torchtitan_rl.distributed.fsdp import apply_fsdp
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.distributed.utils import all_reduce
from torchtitan_rl.models.lora_parallel import colwise, rowwise
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs


@dataclass(frozen=True)
class TokenShard:
    """Which tokens of the micro-batch this rank's residual stream holds: chunk ``rank`` of
    ``degree`` equal chunks over ``mesh`` (sequence-parallel TP, see ``parallelize.apply_tp``);
    the whole micro-batch when ``degree`` is 1 (``mesh`` None)."""

    rank: int = 0
    degree: int = 1
    mesh: DeviceMesh | None = None

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a per-token tensor of the whole micro-batch (dim 0 = tokens)."""
        if self.degree == 1:
            return values
        return values.chunk(self.degree)[self.rank]

    def replicated(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` computed alike on every rank of the shard, of which each rank's tokens
        use their own part (image features): identity forward; backward sums the gradient over
        the ranks, so it is whole and equal on every rank (Megatron's "copy to tensor-parallel
        region")."""
        if self.degree == 1:
            return values
        return _SumGradOverRanks.apply(values, self.mesh)


class _SumGradOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        ctx.mesh = mesh
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad.contiguous(), "sum", ctx.mesh), None


def parallelize_qwen3(
    model: nn.Module,
    parallel_dims: ParallelDims,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    extra_fsdp_units: list[nn.Module] = (),
    *,
    reshard_after_forward: str = "default",
) -> None:
    """Tensor parallel first (it changes parameters into TP DTensors), then FSDP2 on top,
    sharding over dp_shard × cp. Context parallel leaves the model as it is: the engine gives
    each forward its CP share of the tokens and an attention state whose keys are gathered
    over ``cp`` (``models.attention.cp_attention_context``).

    ``extra_fsdp_units`` are modules outside the decoder (a vision tower's blocks) that get
    their own FSDP groups before the decoder blocks, in forward order.
    ``reshard_after_forward``: the policy of ``parallelism.fsdp_reshard_after_forward``
    (``distributed.fsdp.reshards_after_forward``); MoE experts follow their block."""
    tp_mesh = parallel_dims.mesh("tp")
    if tp_mesh is not None:
        check_tp_divisibility(model.args, tp_mesh.size())
        # Some TP styles (SequenceParallel) re-create parameters as trainable: keep frozen ones
        # frozen (LoRA's base, a frozen vision tower), before FSDP fixes requires_grad per shard.
        frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
        apply_tp(model, tp_mesh)
        for name, param in model.named_parameters():
            if name in frozen:
                param.requires_grad_(False)
    blocks = list(model.layers.values())
    experts = [block.moe.experts for block in blocks if hasattr(block, "moe")]
    ep_mesh = parallel_dims.mesh("ep")
    if ep_mesh is not None:
        check_expert_parallel_divisibility(model.args, ep_mesh.size())
        for module in experts:
            parallelize_module(module, ep_mesh, ExpertParallel())
    expert_mesh = parallel_dims.expert_mesh()
    if expert_mesh is not None and experts:
        # Experts get their own FSDP groups over every rank of a replica (TP ranks included:
        # experts are not tensor-parallel) or, under expert parallel, over the ranks that hold
        # the same experts; before their blocks take the remaining parameters.
        # The last group of experts runs last only if it belongs to the last block.
        apply_fsdp(
            None,
            experts,
            expert_mesh,
            param_dtype,
            reduce_dtype,
            reshard_after_forward=reshard_after_forward,
            last_runs_last=hasattr(blocks[-1], "moe"),
        )
    mesh = parallel_dims.fsdp_mesh()
    if mesh is not None:
        apply_fsdp(
            model,
            [*extra_fsdp_units, *blocks],
            mesh,
            param_dtype,
            reduce_dtype,
            reshard_after_forward=reshard_after_forward,
        )


def check_expert_parallel_divisibility(args: Qwen3ModelArgs, ep: int) -> None:
    if args.num_experts % ep != 0:
        source = f" ({args.source})" if args.source else ""
        raise ValueError(
            f"parallelism.expert_parallel_degree ({ep}) must divide the number of experts "
            f"num_experts = {args.num_experts}{source}"
        )


def check_tp_divisibility(args: Qwen3ModelArgs, tp: int) -> None:
    """Every sharded dimension must split evenly over the TP ranks (errors name the config.json
    the args were read from, see ``Qwen3ModelArgs.check_tensor_parallel``)."""
    args.check_tensor_parallel(tp)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron-style TP with sequence parallel over the token dim (dim 0 of packed ``[T, D]``).

    Between blocks the residual stream is a plain local tensor holding this rank's ``T / tp``
    tokens; attention and MLP gather the tokens, work on this rank's heads / hidden units,
    and reduce-scatter back to token shards. Norm weights (QK-norm included) stay
    replicated DTensors, so their gradients from different token (or head) shards are summed.
    The output head is only sharded over the vocabulary here: the loss reads its local
    shard directly (``losses.logprobs``) and never materializes full logits. A reward model's
    score head (one row) stays replicated and scores this rank's token shard, like a norm: its
    gradients from the token shards are summed.
    """
    token_shards = Shard(0)
    head = (
        {"score": SequenceParallel(sequence_dim=0, use_local_output=True)}
        if model.args.score_head
        else {"output": colwise(model.output) if model.output is not None else None}
    )
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=token_shards),
        "norm": SequenceParallel(sequence_dim=0, use_local_output=True),
        **head,
    }
    # A pipeline stage holds some of these only (``models.stages``).
    parallelize_module(
        model, tp_mesh, {name: style for name, style in plan.items() if getattr(model, name) is not None}
    )
    if model.args.tie_embeddings:
        # Both layers shard the [vocab, dim] weight over the vocabulary (Shard(0)), so the
        # tied weight can stay one parameter: parallelize_module replaced each separately.
        model.output.weight = model.tok_embeddings.weight
    # Per-token metadata of the residual stream (MoE routing, image features) follows its
    # token shard: Shard(0) over tp gives rank r the r-th of tp equal chunks.
    model.set_token_shard(TokenShard(rank=tp_mesh.get_local_rank(), degree=tp_mesh.size(), mesh=tp_mesh))
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, _moe_plan() if hasattr(block, "moe") else _dense_mlp_plan(block))
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(sequence_dim=0, use_local_output=True),
                "attention": PrepareModuleInput(
                    input_layouts=(token_shards, None, None),
                    desired_input_layouts=(Replicate(), None, None),
                    use_local_output=True,
                ),
                "attention.wq": colwise(block.attention.wq),
                "attention.wk": colwise(block.attention.wk),
                "attention.wv": colwise(block.attention.wv),
                # [T, local heads, head_dim]: the heads dim is what TP shards here.
                "attention.q_norm": SequenceParallel(sequence_dim=1, use_local_output=True),
                "attention.k_norm": SequenceParallel(sequence_dim=1, use_local_output=True),
                "attention.wo": rowwise(block.attention.wo, output_layouts=token_shards),
                "ffn_norm": SequenceParallel(sequence_dim=0, use_local_output=True),
            },
        )


def _dense_mlp_plan(block: nn.Module) -> dict:
    token_shards = Shard(0)
    mlp = block.feed_forward
    return {
        "feed_forward": PrepareModuleInput(
            input_layouts=(token_shards,), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        "feed_forward.w1": colwise(mlp.w1),
        "feed_forward.w2": rowwise(mlp.w2, output_layouts=token_shards),
        "feed_forward.w3": colwise(mlp.w3),
    }


def _moe_plan() -> dict:
    """MoE layers route and compute this rank's token shard as it is (no gather): the router
    weight is replicated, so its gradients from the token shards are summed like a norm's;
    the experts stay whole here and are FSDP-sharded over a mesh that includes ``tp``, whose
    reduce-scatter sums their gradients over the token shards."""
    return {"moe.router": SequenceParallel(sequence_dim=0, use_local_output=True)}
