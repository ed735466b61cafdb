"""Held-out evaluation of the preference recipe (``preference.eval_interval``): the pair loss and
``rewards/*`` of pairs never trained on (``eval/*``), and how often the greedy completion of a
pair's prompt is its chosen completion token for token (``eval/greedy_is_chosen``: on a task
whose chosen answers are the right ones, greedy pass@1).

The pairs are split over the data-parallel ranks whole (CP / TP peers hold copies) and their sums
completed like the training step's (``losses.preference.pair_sums``); the greedy prompts are split over
every training rank, each generating with an unsharded replica of the policy, as GRPO's
evaluation does.
"""

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from torchtitan_rl.data.preferences import plan_preference_row
from torchtitan_rl.data.rows import RowSelection, row_base_dir, row_where
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.data.tokenizer import stop_token_ids
from torchtitan_rl.data.vision_samples import PlannedSample, RowPlanner, build_sample
from torchtitan_rl.losses.preference import PreferenceLoss, pair_losses, pair_sums, preference_metrics
from torchtitan_rl.recipes.base import Recipe, vision_data_config
from torchtitan_rl.recipes.grpo_data import build_generator
from torchtitan_rl.rl.rollouts import split_among_peers
from torchtitan_rl.rl.sampling import SamplingParams


def hold_out(rows: Sequence, num_eval_pairs: int, seed: int) -> tuple[RowSelection, RowSelection]:
    """``(training rows, held-out rows)``: a seeded draw of ``num_eval_pairs`` rows held out."""
    if num_eval_pairs >= len(rows):
        raise ValueError(
            f"preference.num_eval_pairs={num_eval_pairs} holds out every one of the dataset's {len(rows)} rows; "
            "lower it or give more rows"
        )
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    return RowSelection(rows, sorted(order[num_eval_pairs:])), RowSelection(rows, sorted(order[:num_eval_pairs]))


def prompt_and_completion(planned: PlannedSample) -> tuple[list[int], list[int]]:
    """A pair side's prompt (the tokens before its loss targets) and completion (the targets: a
    conversational reply ends at its ``<|im_end|>``, not at the template's newline after it)."""
    mask = planned.target_mask
    start, end = mask.index(True), len(mask) - mask[::-1].index(True)
    return planned.tokens[:start], planned.tokens[start:end]


def held_out_pairs(recipe: Recipe, rows: Sequence) -> tuple[list, list[Sample]]:
    """Every held-out row planned as a pair, and this data-parallel rank's share of the pairs as
    samples (pairs split whole; each sample's ``group_id`` is its row's index)."""
    dims, vision = recipe.parallel_dims, vision_data_config(recipe.job_config, recipe.model_args)
    planner = RowPlanner(recipe.tokenizer, vision)
    pairs = [
        plan_preference_row(planner, rows[i], i, row_where(rows, i), row_base_dir(rows, i)) for i in range(len(rows))
    ]
    samples = []
    for index in split_among_peers(list(range(len(pairs))), dims.batch_rank(), dims.batch_degree):
        for preferred, planned in zip((True, False), pairs[index]):
            sample = build_sample(planned, vision)
            sample.group_id, sample.preferred, sample.margin = index, preferred, planned.margin
            samples.append(sample)
    return pairs, samples


class PreferenceEvaluation:
    """The held-out ``rows`` of ``recipe``, planned once; ``evaluate`` at a step."""

    def __init__(self, recipe: Recipe, rows: Sequence, loss: PreferenceLoss):
        cfg, dims = recipe.job_config, recipe.parallel_dims
        self.recipe, self.loss = recipe, loss
        vision = vision_data_config(cfg, recipe.model_args)
        pairs, self.samples = held_out_pairs(recipe, rows)
        self.num_pairs = len(pairs)
        self.prompt_indices = split_among_peers(list(range(len(pairs))), recipe.rank, dims.world_size)
        self.prompts, self.expected, self.images = [], [], []
        for index in self.prompt_indices:
            prompt, completion = prompt_and_completion(pairs[index][0])
            self.prompts.append(prompt)
            self.expected.append(completion)
            self.images.append(pairs[index][0].images)
        self.generator = build_generator(cfg, recipe.model_args, recipe.device, vision)
        stops = stop_token_ids(recipe.tokenizer, cfg.generation.stop_tokens)
        self.params = SamplingParams(cfg.generation.max_new_tokens, temperature=0.0, stop_token_ids=stops)

    def evaluate(self, step: int, reference_logprobs: Callable[[list[Sample]], list[torch.Tensor]] | None):
        """The ``eval/*`` values of the policy after ``step`` (collective over the training ranks)."""
        engine, dims = self.recipe.engine, self.recipe.parallel_dims
        policy = engine.forward(self.samples).logprobs
        reference = reference_logprobs(self.samples) if self.loss.needs_reference else None
        sums = pair_sums(self.samples, policy, reference, self.num_pairs, dims.mesh("batch"))
        values = {"eval/loss": float(pair_losses(self.loss, sums).mean())}
        values.update({f"eval/{tag}": value for tag, value in preference_metrics(self.loss, sums).items()})
        self.generator.update_weights_from(engine.full_parameters, step)
        images = self.images if any(self.images) else None
        rollouts = self.generator.generate(self.prompts, self.prompt_indices, 1, self.params, 0, -step, images)
        matches = torch.tensor([float(sum(r.completion_tokens == e for r, e in zip(rollouts, self.expected)))])
        if dist.is_initialized():
            dist.all_reduce(matches, group=dims.trainer_group())
        values["eval/greedy_is_chosen"] = float(matches[0]) / self.num_pairs
        return values
