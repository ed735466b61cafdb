"""Run under torchrun: build every layout of this world size, record gradients and metrics.

Usage: torchrun --nproc_per_node=N layout_worker.py OUT.pt
Rank 0 writes {case name: results} to OUT.pt; the pytest driver compares it to references.
"""

import sys

import torch
import torch.distributed as dist

import layout_cases as lc
import torchtitan_rl.engine as engine_module
from critic_cases import run_critic_checks
from generator_cases import run_generator_checks
from lora_cases import run_lora_checks
from moe_cases import run_moe_checks
from pipeline_cases import run_pipeline_checks
from preference_cases import run_preference_checks
from proximal_cases import run_proximal_checks
from reshard_cases import run_reshard_checks
from rl_cases import run_rollout_exchange_checks
from rollout_rank_cases import run_rollout_rank_checks
from rollout_timeout_cases import run_rollout_timeout_checks
from tinker_cases import run_tinker_checks
from torchtitan_rl.compat import all_gather_autograd
from torchtitan_rl.data.balance import assign_to_ranks
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.clip import clip_grad_norm_
from torchtitan_rl.distributed.context_parallel import (
    ZigzagLayout,
    gather_from_cp_ranks,
)
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.distributed.utils import init_distributed, shutdown_distributed
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.losses.logprobs import token_loss
from torchtitan_rl.losses.reduction import NUM_LOSS_TOKENS, REDUCTION_MODES
from torchtitan_rl.metrics import MetricsLogger
from torchtitan_rl.models.attention import cp_attention_context, packed_attention
from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
from torchtitan_rl.recipes.base import build_model
from vlm_cases import run_vlm_checks
from vlm_grpo_cases import run_vlm_grpo_checks


def share(samples, dims: ParallelDims, balance: bool = False, budget: int = 0):
    """This DP rank's samples: a contiguous slice, or (``balance``) the compute-balanced
    assignment for micro-batches of ``budget`` tokens."""
    if balance:
        indices = assign_to_ranks([len(s) for s in samples], dims.batch_degree, max_tokens=budget)
        return [samples[i] for i in indices[dims.batch_rank()]]
    n = lc.GLOBAL_BATCH_SIZE // dims.batch_degree
    r = dims.batch_rank()
    return samples[r * n : (r + 1) * n]


def run_layout(dims: ParallelDims, tie: bool, results: dict, cases, attn_backend: str = "sdpa_dense") -> None:
    """Every case on this layout; keys start with the layout's name, ``_tied`` for tied
    embeddings and ``_varlen`` for the sdpa_varlen backend."""
    device = torch.device("cpu")
    model = build_model(
        lc.model_args(tie, attn_backend), parallel_dims=dims, device=device, seed=lc.SEED, param_dtype=torch.float32
    )
    prefix = f"rep{dims.dp_replicate}_shard{dims.dp_shard}_cp{dims.cp}_tp{dims.tp}" + ("_tied" if tie else "")
    prefix += {"sdpa_dense": "", "sdpa_varlen": "_varlen"}[attn_backend]
    results[f"{prefix}/init"] = {fqn: lc.full(p) for fqn, p in model.named_parameters()}
    optimizer = build_optimizer(model, lc.LR, 0.9, 0.95, lc.ADAM_EPS, 0.1)
    scheduler = build_lr_scheduler(optimizer, 10, 0, "linear", 0.0)
    rank = dist.get_rank() if dist.is_initialized() else 0
    metrics = MetricsLogger(dims, device, rank, tb_folder=None, num_params=1, flops_per_token_context=1)
    if not tie:
        # Log-probs and entropies of this rank's share (rank 0's is saved), before any step moves the weights.
        engine = Engine(
            model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            parallel_dims=dims,
            device=device,
            options=EngineOptions(
                reduction="token_mean",
                horizon=lc.HORIZON,
                max_tokens_per_microbatch=24,
                logits_chunk_size=16,
                max_norm=0.0,
                balance_microbatches=True,  # packed out of order: results must come back in order
            ),
        )
        out = engine.forward(share(lc.global_batch("uneven"), dims), with_entropy=True)
        results[f"{prefix}/forward"] = {"logprobs": out.logprobs, "entropies": out.entropies}
    for loss_fn, mode, budget, variants, step in cases:
        # Compute balancing (ranks and micro-batches) for every mode but the one whose loss
        # depends on the packing on purpose: its reference replays contiguous, in-order packing.
        balance = mode != "token_mean_legacy"
        options = EngineOptions(
            reduction=mode,
            horizon=lc.HORIZON,
            max_tokens_per_microbatch=budget,
            logits_chunk_size=16,
            max_norm=lc.MAX_NORM if step else 0.0,
            balance_microbatches=balance,
        )
        engine = Engine(
            model, optimizer=optimizer, lr_scheduler=scheduler, parallel_dims=dims, device=device, options=options
        )
        for variant in variants:
            samples = share(lc.global_batch(variant), dims, balance, budget)
            fb = engine.forward_backward(samples, loss_fn, lc.RL_LOSS_FNS.get(loss_fn))
        grads = {fqn: lc.full(p.grad) for fqn, p in model.named_parameters()}
        if step:
            optim = engine.optim_step()
        else:
            optim = {"grad_norm": clip_grad_norm_(list(model.parameters()), 0.0), "lr": lc.LR}
            model.zero_grad(set_to_none=True)
        # Window tokens of the loss-token count over 1 s: throughput must come out as that / world size.
        logged = metrics.log(
            1,
            fb=fb,
            optim=optim,
            window_tokens=fb.counts[NUM_LOSS_TOKENS],
            window_squared_lens=fb.counts[NUM_LOSS_TOKENS],
            window_seconds=1.0,
            data_stats={},
        )
        entry = {"grads": grads, "logged": logged}
        if step:
            entry["params"] = {fqn: lc.full(p) for fqn, p in model.named_parameters()}
        results[case_key(prefix, loss_fn, mode, budget, variants, step)] = entry


def case_key(prefix: str, loss_fn: str, mode: str, budget: int, variants: tuple, step: bool = False) -> str:
    head = prefix if loss_fn == "cross_entropy" else f"{prefix}/rl/{loss_fn}"
    return f"{head}/{mode}/budget{budget}/{'+'.join(variants)}" + ("/step" if step else "")


def run_gspo_cp_mutant(dims: ParallelDims, results: dict) -> None:
    """GSPO with each CP share's own sequence means (the sum over ``cp`` left out), on the RL
    layouts with context parallel: the layout check must reject it (``mutant/...`` keys)."""
    layout = (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    if dims.cp == 1 or layout not in lc.RL_LAYOUTS:
        return
    sequence_inputs = engine_module.Engine._sequence_inputs
    reduce = engine_module.all_reduce

    def per_share(self, *args):
        engine_module.all_reduce = lambda t, op, mesh: t
        try:
            return sequence_inputs(self, *args)
        finally:
            engine_module.all_reduce = reduce

    case = ("gspo", "sequence_mean", 24, ("rl",), False)
    mutant: dict = {}
    engine_module.Engine._sequence_inputs = per_share
    try:
        run_layout(dims, False, mutant, [case])
    finally:
        engine_module.Engine._sequence_inputs = sequence_inputs
    prefix = f"rep{dims.dp_replicate}_shard{dims.dp_shard}_cp{dims.cp}_tp{dims.tp}"
    results[f"mutant/{case_key(prefix, *case)}"] = mutant[case_key(prefix, *case)]


# (loss_fn, reduction mode, micro-batch budget, data passed to successive forward_backward
# calls, step?). prompt_mean needs prompt groups, which only the RL data has.
SFT_MODES = [mode for mode in REDUCTION_MODES if mode != "prompt_mean"]
CASES = [("cross_entropy", mode, budget, ("uneven",), False) for mode in SFT_MODES for budget in lc.BUDGETS] + [
    ("cross_entropy", "token_mean", 24, ("uneven", "other"), False),  # two calls accumulate (Tinker)
    ("cross_entropy", "token_mean", 24, ("no_loss",), False),  # zero loss tokens: zero gradient, no NaN
    ("cross_entropy", "token_mean", 24, ("uneven",), True),  # clipped AdamW step; must stay last
]
TIED_CASES = [("cross_entropy", "token_mean", 24, ("uneven",), False)]
# Layouts that combine several parallel dims, and those of more than 2 ranks: every mode once, at
# the budget that gives several micro-batches per rank (CI time on 2 cores). The single-dim
# layouts of 1 and 2 ranks run every budget.
COMPOSITE_CASES = [case for case in CASES if case[2] == 24]
# Every RL loss with KL and entropy on, every mode, two budgets; on lc.RL_LAYOUTS. Layouts that
# combine several parallel dims, or span more than 2 ranks, run the budget of several
# micro-batches per rank only.
RL_CASES = [
    (loss_fn, mode, budget, ("rl",), False)
    for loss_fn in lc.RL_LOSS_FNS
    for mode in REDUCTION_MODES
    for budget in lc.RL_BUDGETS
]
COMPOSITE_RL_CASES = [case for case in RL_CASES if case[2] == 24]
# Layouts of more than 2 ranks (dp 4 and the combined ones): every mode with ppo, the other
# losses with WIDE_RL_MODES (CI time on 2 cores). Every layout still runs every loss and every
# mode, and every (loss, mode) pair runs on the layouts of 1 and 2 ranks.
WIDE_RL_MODES = ("token_mean", "sequence_mean")
WIDE_RL_CASES = [case for case in COMPOSITE_RL_CASES if case[0] == "ppo" or case[1] in WIDE_RL_MODES]


def run_logprobs(tp_mesh, results: dict) -> None:
    """Vocab-parallel log-probs and entropies of lc.logprob_inputs(), with their gradients."""
    hidden_full, weight_full, labels = lc.logprob_inputs()
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    # Any per-token scalar of both outputs; the reference differentiates the same one.
    token_scale = torch.arange(1.0, lc.LOGPROB_TOKENS + 1)
    for loss_parallel in (True, False):
        for chunk in lc.LOGPROB_CHUNKS:
            hidden = hidden_full.chunk(tp)[rank].clone().requires_grad_()  # sequence-parallel shard
            weight = weight_full.chunk(tp)[rank].clone().requires_grad_()  # vocabulary shard
            loss, logprobs, entropy = token_loss(
                hidden,
                weight,
                labels,
                chunk,
                lambda start, end, lp, ent: (lp * token_scale[start:end]).sum().add(ent.sum()),
                tp_mesh,
                loss_parallel,
                with_entropy=True,
            )
            loss.backward()
            results[f"tp{tp}/logprobs/parallel{int(loss_parallel)}/chunk{chunk}"] = {
                "logprobs": logprobs.detach(),
                "entropy": entropy.detach(),
                "grad_hidden": all_gather_autograd(hidden.grad, tp_mesh).clone(),  # clone waits
                "grad_weight": all_gather_autograd(weight.grad, tp_mesh).clone(),
            }


def run_cp_attention(cp_mesh, results: dict) -> None:
    """Packed attention with this rank's zigzag share of the queries and K/V gathered over cp."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    layout = ZigzagLayout.build(list(lc.CP_ATTENTION_LENS), cp)
    for backend in lc.CP_ATTENTION_BACKENDS:
        inputs = [layout.split(t, rank).requires_grad_() for t in lc.cp_attention_inputs()[:3]]
        out_weights = layout.split(lc.cp_attention_inputs()[3], rank)
        context = cp_attention_context(cp_mesh, backend, layout.seq_ids(rank), layout.positions(rank))
        out = packed_attention(*inputs, context)
        (out * out_weights).sum().backward()
        entry = {"out": gather_from_cp_ranks(out.detach(), layout, cp_mesh).clone()}
        for name, t in zip(("q", "k", "v"), inputs):
            entry[f"grad_{name}"] = gather_from_cp_ranks(t.grad, layout, cp_mesh).clone()
        results[f"cp{cp}/attention/{backend}"] = entry


def run_bad_inputs(dims: ParallelDims, results: dict) -> None:
    """Samples only one DP rank finds wrong: every rank must raise (no hang), naming the cause.

    Records each rank's message per case (all-gathered), then runs one good step to show the
    process group is still in step.
    """
    device = torch.device("cpu")
    model = build_model(
        lc.model_args(False), parallel_dims=dims, device=device, seed=lc.SEED, param_dtype=torch.float32
    )
    engine = Engine(
        model,
        optimizer=None,
        lr_scheduler=None,
        parallel_dims=dims,
        device=device,
        options=EngineOptions(
            reduction="prompt_mean",
            horizon=lc.HORIZON,
            max_tokens_per_microbatch=24,
            logits_chunk_size=16,
            max_norm=0.0,
        ),
    )
    rank = dims.batch_rank()
    cases = {
        "no_advantages": lambda s: setattr(s[0], "advantages", None),
        "nan_sampler_logprobs": lambda s: s[1].sampler_logprobs.__setitem__(2, float("nan")),
        "group_id_out_of_range": lambda s: setattr(s[0], "group_id", 10**6),
        "too_long_for_budget": lambda s: s.append(
            Sample(
                input_ids=torch.zeros(30, dtype=torch.long),
                labels=torch.zeros(30, dtype=torch.long),
                loss_mask=torch.ones(30, dtype=torch.bool),
                advantages=torch.zeros(30),
                sampler_logprobs=torch.zeros(30),
                group_id=0,
            )
        ),
    }
    for name, spoil in cases.items():
        samples = share(lc.global_batch("rl"), dims)
        if rank == 1:
            spoil(samples)
        try:
            engine.forward_backward(samples, "ppo")
            message = None
        except ValueError as err:
            message = str(err)
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, message)
        results[f"bad_input/{name}"] = messages
    engine.forward_backward(share(lc.global_batch("rl"), dims), "ppo", lc.RL_LOSS_FNS["ppo"])
    results["bad_input/then_good_step_grad"] = {fqn: lc.full(p.grad) for fqn, p in model.named_parameters()}


# (dp_replicate, dp_shard, cp, tp) layouts that also run with activation checkpointing.
AC_LAYOUTS = ((1, 2, 1, 1), (1, 2, 1, 2))
AC_CASE = ("cross_entropy", "token_mean", 24, ("uneven",), False)


def count_forwards(model) -> dict[str, list[int]]:
    """{"blocks": runs of each block, "model": runs of the whole model}, updated as it runs.

    A block is counted by a pre-hook on its first submodule, which the checkpoint's
    recomputation calls again (it calls the block's original ``forward``, so a hook on the
    block itself would not fire); the final norm runs once per micro-batch, never recomputed.
    """
    runs = {"blocks": [0] * len(model.blocks()), "model": [0]}

    def counter(counts: list[int], i: int):
        return lambda module, args: counts.__setitem__(i, counts[i] + 1)

    for i, block in enumerate(model.blocks()):
        block.attention_norm.register_forward_pre_hook(counter(runs["blocks"], i))
    model.norm.register_forward_pre_hook(counter(runs["model"], 0))
    return runs


def run_activation_checkpointing(dims: ParallelDims, results: dict) -> None:
    """The AC_CASE's gradients with every block recomputed, and with every second one, and
    how often each block ran (a checkpointed block runs again in backward)."""
    layout = (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    if layout not in AC_LAYOUTS:
        return
    device = torch.device("cpu")
    for mode, every in (("full", 1), ("selective", 2)):
        model = build_model(
            lc.model_args(False),
            parallel_dims=dims,
            device=device,
            seed=lc.SEED,
            param_dtype=torch.float32,
            ac_mode=mode,
            ac_every=every,
        )
        runs = count_forwards(model)
        _, mode_name, budget, _, _ = AC_CASE
        options = EngineOptions(
            reduction=mode_name,
            horizon=lc.HORIZON,
            max_tokens_per_microbatch=budget,
            logits_chunk_size=16,
            max_norm=0.0,
        )
        engine = Engine(model, optimizer=None, lr_scheduler=None, parallel_dims=dims, device=device, options=options)
        engine.forward_backward(share(lc.global_batch(AC_CASE[3][0]), dims))
        results["ac/rep{}_shard{}_cp{}_tp{}/{}".format(*layout, mode)] = {
            "grads": {fqn: lc.full(p.grad) for fqn, p in model.named_parameters()},
            "block_runs": runs["blocks"],
            "micro_batches": runs["model"][0],
        }


# (dp_replicate, dp_shard, cp, tp) layouts that also run with every block compiled. The
# aot_eager backend (dynamo + AOT autograd, no code generation): inductor's kernels are checked
# on one rank (tests/unit/test_compile.py), its compile would cost each rank ~30 s here. The
# 2-rank layouts only: dp 2 x tp 2 compiled cost the 4-rank launch ~27 s of the suite's budget,
# and FSDP, TP and CP are each checked here.
COMPILE_LAYOUTS = ((1, 2, 1, 1), (1, 1, 1, 2), (1, 1, 2, 1))


def run_compile(dims: ParallelDims, results: dict) -> None:
    """The AC_CASE's gradients with every block compiled, under FSDP, TP, CP and FSDP x TP."""
    layout = (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    if layout not in COMPILE_LAYOUTS:
        return
    device = torch.device("cpu")
    model = build_model(
        lc.model_args(False),
        parallel_dims=dims,
        device=device,
        seed=lc.SEED,
        param_dtype=torch.float32,
        compile_backend="aot_eager",
    )
    _, mode_name, budget, variants, _ = AC_CASE
    engine = Engine(
        model,
        optimizer=None,
        lr_scheduler=None,
        parallel_dims=dims,
        device=device,
        options=EngineOptions(
            reduction=mode_name,
            horizon=lc.HORIZON,
            max_tokens_per_microbatch=budget,
            logits_chunk_size=16,
            max_norm=0.0,
        ),
    )
    engine.forward_backward(share(lc.global_batch(variants[0]), dims))
    results["compile/rep{}_shard{}_cp{}_tp{}".format(*layout)] = {
        fqn: lc.full(p.grad) for fqn, p in model.named_parameters()
    }


def run_all_layouts(world_size: int) -> dict:
    results: dict = {}
    for dp_replicate, dp_shard, cp, tp in lc.layouts(world_size):
        dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, world_size=world_size)
        dims.build_meshes("cpu")
        reduced = world_size > 2 or sum(d > 1 for d in (dp_replicate, dp_shard, cp, tp)) > 1
        rl_cases = (
            (WIDE_RL_CASES if world_size > 2 else COMPOSITE_RL_CASES if reduced else RL_CASES)
            if (dp_replicate, dp_shard, cp, tp) in lc.RL_LAYOUTS
            else []
        )
        # RL cases first: the last SFT case steps the optimizer.
        run_layout(dims, False, results, rl_cases + (COMPOSITE_CASES if reduced else CASES))
        run_gspo_cp_mutant(dims, results)
        if (dp_replicate, dp_shard, cp, tp) in lc.VARLEN_LAYOUTS:
            run_layout(dims, False, results, COMPOSITE_CASES, attn_backend="sdpa_varlen")
        if dp_replicate == 1:
            run_layout(dims, True, results, TIED_CASES)
        if 1 < tp == world_size:
            run_logprobs(dims.mesh("tp"), results)
        if 1 < cp == world_size:
            run_cp_attention(dims.mesh("cp"), results)
        if dp_shard == world_size == 2:
            run_bad_inputs(dims, results)
        run_generator_checks(dims, results)  # on generator_cases.GENERATOR_LAYOUTS only
        run_rollout_exchange_checks(dims, results)  # on rl_cases.EXCHANGE_LAYOUTS only
        run_vlm_checks(dims, results)  # on vlm_cases.VLM_LAYOUTS only
        run_vlm_grpo_checks(dims, results)  # on vlm_grpo_cases.VLM_GRPO_LAYOUTS only
        run_proximal_checks(dims, results)  # on proximal_cases.PROXIMAL_LAYOUTS only
        run_moe_checks(dims, results)  # on moe_cases.MOE_LAYOUTS only
        run_lora_checks(dims, results)  # on lora_cases.LORA_LAYOUTS only
        run_tinker_checks(dims, results)  # on tinker_cases.TINKER_LAYOUTS only
        run_preference_checks(dims, results)  # on preference_cases.PREFERENCE_LAYOUTS only
        run_critic_checks(dims, results)  # on critic_cases.CRITIC_LAYOUTS only
        run_activation_checkpointing(dims, results)  # on AC_LAYOUTS only
        run_compile(dims, results)  # on COMPILE_LAYOUTS only
        run_reshard_checks(dims, results)  # on reshard_cases.RESHARD_LAYOUTS only
    run_rollout_rank_checks(world_size, results)  # 2 training + 2 rollout ranks, world 4 only
    run_rollout_timeout_checks(world_size, results)  # the same, waits against a 2 s silent-peer timeout
    run_pipeline_checks(world_size, results)  # on pipeline_cases.PIPELINE_LAYOUTS only
    return results


def main(out_path: str) -> None:
    rank, world_size, _ = init_distributed(120)
    results = run_all_layouts(world_size)
    if rank == 0:
        torch.save(results, out_path)
    shutdown_distributed(clean=True)  # not left to interpreter shutdown, where gloo threads can abort it


if __name__ == "__main__":
    main(sys.argv[1])
