"""The GRPO rollout exchange inside the shared multi-rank launch (``layout_worker.run_all_layouts``).

On the layouts of ``EXCHANGE_LAYOUTS`` every rank takes its data-parallel rank's prompt slots
of a step (``rank_prompt_slots``, two mini-batches), generates its peer part
(``generate_share``) and receives its peers' parts (``exchange_among_peers``), then turns each
mini-batch's rollouts into samples and balances them over the data-parallel ranks
(``balance_over_data_parallel``), exactly as the GRPO trainer does. Rank 0 records every rank's
part and results for test_rollout_exchange.py.

On the layouts of ``DYNAMIC_SAMPLING_LAYOUTS`` (1, 2 and 4 data-parallel ranks, with and without
CP / TP peers) one step of dynamic sampling draws rounds of prompts from a ``PromptStream`` until
it has enough groups with signal, the way the GRPO trainer does: peers split each round's
generation, ranks share which of the round's groups have signal (``SignalExchange``), keep
the first ones (``select_groups_with_signal``) and send each kept group to the rank that trains
it; each rank records the problems kept and the groups it trains.

On the same layouts the trainer's ``StepSampler`` samples one step with a reward model in the
loop (``rl.reward_model``): its normalized scores added to a verifier's reward; each rank
records its groups' rewards.
"""

import torch
import torch.distributed as dist

import layout_cases as lc
from generator_cases import prompts
from torchtitan_rl.config import JobConfig
from torchtitan_rl.data.tokenizer import ByteTokenizer
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.models.qwen3.args import as_reward_model
from torchtitan_rl.models.qwen3.model import Qwen3Model
from torchtitan_rl.recipes.base import build_model
from torchtitan_rl.rl.dynamic_sampling import SignalExchange, round_offset, select_groups_with_signal
from torchtitan_rl.rl.generator import SamplingParams, TorchGenerator
from torchtitan_rl.rl.reward_model_scores import RewardModelScorer
from torchtitan_rl.rl.rollouts import (
    PromptStream,
    balance_over_data_parallel,
    exchange_among_peers,
    generate_share,
    rank_prompt_slots,
    rollout_metrics,
    rollout_sums,
    score_groups,
    to_samples,
)
from torchtitan_rl.rl.step_sampler import StepSampler
from torchtitan_rl.rl.tasks import Problem, Reward

# (dp_replicate, dp_shard, cp, tp): TP peers, CP peers, and CP peers alone.
EXCHANGE_LAYOUTS = ((1, 2, 1, 2), (1, 2, 2, 1), (1, 1, 2, 1))
NUM_SAMPLES, NUM_MINIBATCHES = 2, 2
# One prompt per generation batch: batches are the same on every layout, so rollouts must be
# bitwise the same as one process generating every prompt.
MAX_PROMPTS_PER_BATCH = 1
PARAMS = SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=(0,))
SEED, STEP = 11, 2

DYNAMIC_SAMPLING_LAYOUTS = ((1, 1, 1, 1), (1, 2, 1, 1), (1, 4, 1, 1), (2, 2, 1, 1), (1, 2, 1, 2), (1, 2, 2, 1))
# 8 prompts per round: divisible by the 2 mini-batches times every layout's 1, 2 or 4 DP ranks.
POOL_SIZE, PROMPTS_PER_STEP, MAX_SAMPLING_ROUNDS, STREAM_SEED = 12, 8, 3, 5


def layout_key(dp_replicate: int, dp_shard: int, cp: int, tp: int) -> str:
    return f"rollout_exchange/rep{dp_replicate}_shard{dp_shard}_cp{cp}_tp{tp}"


def summary(rollouts) -> list[tuple]:
    return [(r.prompt_index, r.sample_index, r.completion_tokens, r.logprobs) for r in rollouts]


def sample_summary(sample) -> tuple:
    """What identifies a sample (its prompt slot and tokens) and what it carries to the loss."""
    return (
        sample.group_id,
        sample.input_ids.tolist(),
        sample.labels.tolist(),
        sample.loss_mask.tolist(),
        sample.advantages.tolist(),
        sample.sampler_logprobs.tolist(),
    )


def reward(rollout) -> Reward:
    """Any reward that differs within a group will do: the test recomputes it."""
    return Reward(float(len(rollout.completion_tokens) % 2), False, {})


def component_reward(rollout, name: str = "parity") -> Reward:
    """A reward of two named components (a reward function's dict), the first named ``name``."""
    parity, first = float(len(rollout.completion_tokens) % 2), rollout.completion_tokens[0] % 3 / 2
    return Reward(parity + first, parity + first >= 1, {name: parity, "first": first})


def signal_reward(rollout) -> Reward:
    """A reward whose groups of two have signal about half of the time (first token's parity)."""
    return Reward(float(rollout.completion_tokens[0] % 2), False, {})


def dynamic_pool() -> list[list[int]]:
    """The task's prompt pool: ``POOL_SIZE`` prompts of 1 to 8 tokens."""
    gen = torch.Generator().manual_seed(9)
    lengths = torch.randint(1, 9, (POOL_SIZE,), generator=gen).tolist()
    return [torch.randint(0, lc.VOCAB, (n,), generator=gen).tolist() for n in lengths]


def run_rollout_exchange_checks(dims: ParallelDims, results: dict) -> None:
    layout = (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    if layout in EXCHANGE_LAYOUTS:
        run_exchange(dims, results)
    if layout in DYNAMIC_SAMPLING_LAYOUTS:
        run_dynamic_sampling(dims, results)
        run_reward_model_sampling(dims, results)


def generator_for(dims: ParallelDims) -> TorchGenerator:
    args = lc.model_args(False)
    model = build_model(args, parallel_dims=dims, device=torch.device("cpu"), seed=lc.SEED, param_dtype=torch.float32)
    generator = TorchGenerator(args, torch.device("cpu"), max_prompts_per_batch=MAX_PROMPTS_PER_BATCH)
    generator.update_weights(model)
    return generator


def gather_to_all(mine: dict) -> list[dict]:
    if not dist.is_initialized():
        return [mine]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def run_exchange(dims: ParallelDims, results: dict) -> None:
    generator = generator_for(dims)
    step_prompts = prompts()
    slots_by_minibatch = rank_prompt_slots(len(step_prompts), NUM_MINIBATCHES, dims.batch_rank(), dims.batch_degree)
    slots = [s for mb in slots_by_minibatch for s in mb]
    peer_mesh = dims.mesh("cp_tp")
    local = generate_share(generator, step_prompts, slots, NUM_SAMPLES, PARAMS, SEED, STEP, peer_mesh)
    rollouts = exchange_among_peers(local, peer_mesh)
    groups = score_groups(rollouts, [reward(r) for r in rollouts], NUM_SAMPLES, "grpo", 1e-6)
    minibatches = [to_samples([g for g in groups if g.slot in mb], 64) for mb in slots_by_minibatch]
    balanced, imbalance = balance_over_data_parallel(minibatches, dims.mesh("batch"), True)
    mine = {
        "batch_rank": dims.batch_rank(),
        "slots": slots,
        "local": summary(local),
        "all": summary(rollouts),
        "balanced": [[sample_summary(s) for s in mb] for mb in balanced],
        "imbalance": imbalance,
    }
    # Reward components: their means over the step; named differently on one data-parallel rank,
    # an error on every rank alike (never a collective that hangs).
    scored = score_groups(rollouts, [component_reward(r) for r in rollouts], NUM_SAMPLES, "grpo", 1e-6)
    mine["metrics"] = rollout_metrics(*rollout_sums(scored, 0), dims.mesh("batch"))
    name = "parity" if dims.batch_rank() == 0 else "oddness"
    renamed = score_groups(rollouts, [component_reward(r, name) for r in rollouts], NUM_SAMPLES, "grpo", 1e-6)
    try:
        rollout_metrics(*rollout_sums(renamed, 0), dims.mesh("batch"))
        mine["renamed_error"] = None
    except ValueError as err:
        mine["renamed_error"] = str(err)
    results[layout_key(dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)] = gather_to_all(mine)


def dynamic_sampling_key(dp_replicate: int, dp_shard: int, cp: int, tp: int) -> str:
    return f"dynamic_sampling/rep{dp_replicate}_shard{dp_shard}_cp{cp}_tp{tp}"


def run_dynamic_sampling(dims: ParallelDims, results: dict) -> None:
    generator = generator_for(dims)
    pool = dynamic_pool()
    stream = PromptStream(POOL_SIZE, PROMPTS_PER_STEP, STREAM_SEED)
    slots_by_minibatch = rank_prompt_slots(PROMPTS_PER_STEP, NUM_MINIBATCHES, dims.batch_rank(), dims.batch_degree)
    slots = [s for mb in slots_by_minibatch for s in mb]
    peer_mesh = dims.mesh("cp_tp")
    problem_of: dict[int, int] = {}  # candidate index -> problem id
    exchange = SignalExchange(slots, dims.mesh("batch"))

    def draw_round(round_index: int):
        offset = round_offset(round_index, PROMPTS_PER_STEP)
        problem_ids = stream.next_step()
        problem_of.update({offset + s: p for s, p in enumerate(problem_ids)})
        step_prompts = [pool[p] for p in problem_ids]
        local = generate_share(generator, step_prompts, slots, NUM_SAMPLES, PARAMS, SEED, STEP, peer_mesh, offset)
        rollouts = exchange_among_peers(local, peer_mesh)
        groups = score_groups(rollouts, [signal_reward(r) for r in rollouts], NUM_SAMPLES, "grpo", 1e-6)
        return exchange.round_with_signal(groups)

    selection = select_groups_with_signal(draw_round, PROMPTS_PER_STEP, MAX_SAMPLING_ROUNDS, warn=False)
    record = {
        "batch_rank": dims.batch_rank(),
        "kept_problems": [problem_of[candidate] for candidate in selection.candidates],
        "num_rounds": selection.num_rounds,
        "num_with_signal": selection.num_with_signal,
        "trained": [
            (g.slot, problem_of[g.rollouts[0].prompt_index], [r.completion_tokens for r in g.rollouts])
            for g in exchange.trained_groups(selection)
        ],
    }
    results[dynamic_sampling_key(dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)] = gather_to_all(record)


# A reward model in the loop (rl.reward_model): the GRPO trainer's StepSampler on the dynamic
# sampling layouts, one step without dynamic sampling, the reward model's normalized scores
# added to a verifier's reward. Peers split the scoring, the normalization spans every rank.
REWARD_MODEL_WEIGHT = 0.5
REWARD_MODEL_MAX_TOKENS = 24  # several packed batches per rank
REWARD_MODEL_SEED = 13


def reward_model() -> Qwen3Model:
    """A frozen random reward model of the layout model's body, the same on every rank."""
    model = Qwen3Model(as_reward_model(lc.model_args(False)))
    model.init_weights(REWARD_MODEL_SEED)
    with torch.no_grad():  # a head spread enough that the scores differ visibly
        model.score.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(REWARD_MODEL_SEED))
    return model.eval().requires_grad_(False)


class ParityTask:
    """A verifier that pays the completion's length parity, with a component."""

    name = "parity"
    train_problems = tuple(Problem(({"role": "user", "content": "?"},), "", f"pool #{i}") for i in range(POOL_SIZE))
    eval_problems = spare_problems = ()

    def reward(self, problem: Problem, completion: str, stopped: bool) -> Reward:
        parity = float(len(completion) % 2)
        return Reward(parity, parity == 1.0, {"parity": parity})


def reward_model_key(dp_replicate: int, dp_shard: int, cp: int, tp: int) -> str:
    return f"reward_model/rep{dp_replicate}_shard{dp_shard}_cp{cp}_tp{tp}"


def run_reward_model_sampling(dims: ParallelDims, results: dict) -> None:
    cfg = JobConfig()
    cfg.rl.group_size, cfg.rl.prompts_per_step = NUM_SAMPLES, PROMPTS_PER_STEP
    cfg.rl.reward_model, cfg.rl.reward_model_weight, cfg.rl.reward_model_normalize = "rm", REWARD_MODEL_WEIGHT, True
    cfg.generation.seed = SEED
    stream = PromptStream(POOL_SIZE, PROMPTS_PER_STEP, STREAM_SEED)
    scorer = RewardModelScorer(reward_model(), REWARD_MODEL_MAX_TOKENS)
    sampler = StepSampler(
        cfg, ParityTask(), dynamic_pool(), ByteTokenizer(), generator_for(dims), PARAMS, stream, reward_model=scorer
    )
    slots = [
        s
        for mb in rank_prompt_slots(PROMPTS_PER_STEP, NUM_MINIBATCHES, dims.batch_rank(), dims.batch_degree)
        for s in mb
    ]
    times: dict[str, float] = {}
    group = dist.group.WORLD if dist.is_initialized() else None
    sampled = sampler.sample(STEP, slots, dims.mesh("batch"), dims.mesh("cp_tp"), group, times)
    record = {
        "batch_rank": dims.batch_rank(),
        "groups": [
            (
                g.slot,
                [(r.completion_tokens, w.total, w.correct, dict(w.components)) for r, w in zip(g.rollouts, g.rewards)],
            )
            for g in sampled.kept
        ],
        "metrics": sampled.values,
        "timed": sorted(times),
    }
    results[reward_model_key(dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)] = gather_to_all(record)
