"""The reward-model recipe (``job.recipe = "reward_model"``): a Bradley–Terry reward model
(``losses.reward_model``) trained on the chosen / rejected pairs of ``training.dataset``.

The model is the policy's body with a scalar score head (``Qwen3ModelArgs.score_head``), read at
each sequence's last token; it starts from ``checkpoint.initial_load_path`` (a language model's
weights with a fresh head, or a reward model's) and exports as a Hugging Face
``Qwen3ForSequenceClassification``. A sequence is the whole text of a pair's side (prompt and
completion, its last token included), so a score sees every token of the completion.

Everything else is the preference recipe's (``recipes.dpo``): data, held-out pairs,
checkpoints, and the step's shape: every score first with a gradient-free pass, the pairs
completed over the data-parallel ranks, then the update on ``Σ_i (∂L/∂s_i) s_i``.
"""

import logging

import torch

from torchtitan_rl.config import JobConfig
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.engine_scores import ScoreEngine
from torchtitan_rl.losses.loss_fns import ForwardBackwardMetrics
from torchtitan_rl.losses.preference import exchange_pairs
from torchtitan_rl.losses.reward_model import (
    RewardModelLoss,
    pair_losses,
    reward_model_metrics,
    score_coefficients,
)
from torchtitan_rl.recipes.dpo import DPORecipe
from torchtitan_rl.recipes.preference_eval import held_out_pairs

logger = logging.getLogger(__name__)


def whole_text(sample: Sample) -> Sample:
    """A pair side as a reward model reads it: every token of the text as input (a training
    sample's inputs lack the last one, which is only a label), with its pair, side and margin."""
    tokens = torch.cat((sample.input_ids, sample.labels[-1:]))
    whole = Sample(input_ids=tokens, labels=tokens, loss_mask=torch.ones(len(tokens), dtype=torch.bool))
    whole.group_id, whole.preferred, whole.margin = sample.group_id, sample.preferred, sample.margin
    return whole


def pair_scores(
    engine: ScoreEngine, samples: list[Sample], num_pairs: int
) -> tuple[list[Sample], torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's ``samples`` as whole texts, and every pair's chosen and rejected scores and
    its margin (float64 ``[num_pairs]`` each, identical on every rank). Collective over the
    training ranks."""
    texts = [whole_text(sample) for sample in samples]
    scores = engine.scores(texts)
    values = torch.stack((scores, torch.tensor([s.margin for s in texts], dtype=torch.float64)), dim=1)
    # Both sides carry their pair's margin; the chosen side's is the pair's.
    (chosen, margins), (rejected, _) = exchange_pairs(texts, values, num_pairs, engine.parallel_dims.mesh("batch"))
    return texts, chosen, rejected, margins


def reward_model_step(
    engine: ScoreEngine, samples: list[Sample], loss: RewardModelLoss, num_pairs: int
) -> tuple[ForwardBackwardMetrics, dict[str, float]]:
    """Accumulate the gradient of the mean Bradley–Terry loss over the mini-batch's ``num_pairs``
    pairs, of which this rank holds ``samples`` (a pair's two sides may sit on different ranks),
    and return the engine's metrics and the step's loss and ``rm/*`` values (identical on every
    rank). Collective over the training ranks."""
    texts, chosen, rejected, margins = pair_scores(engine, samples, num_pairs)
    grad_chosen, grad_rejected, value = score_coefficients(loss, chosen, rejected, margins)
    coefficients = torch.stack([(grad_chosen if s.preferred else grad_rejected)[s.group_id] for s in texts])
    fb = engine.score_backward(texts, coefficients if texts else torch.zeros(0, dtype=torch.float64))
    values = {
        "loss_metrics/global_avg_loss": value,
        "loss_metrics/global_max_loss": float(pair_losses(loss, chosen, rejected, margins).max()),
        **reward_model_metrics(chosen, rejected),
    }
    return fb, values


class RewardModelRecipe(DPORecipe):
    def __init__(self, job_config: JobConfig):
        self.loss = RewardModelLoss(job_config.loss.center_rewards_coefficient)
        held_out = self.build_pair_data(job_config, reward_model=True)
        self.evaluation = held_out_pairs(self, held_out) if held_out is not None else None
        self.reference = None  # a reward model has none
        self.checkpointer = self.build_checkpointer(self.dataloader)

    def step(self, samples: list[Sample], num_pairs: int) -> tuple[ForwardBackwardMetrics, dict[str, float]]:
        return reward_model_step(self.engine, samples, self.loss, num_pairs)

    def _evaluate(self, step: int) -> None:
        """``eval/loss`` and ``eval/rm/*`` of the held-out pairs (collective)."""
        pairs, samples = self.evaluation
        _, chosen, rejected, margins = pair_scores(self.engine, samples, len(pairs))
        values = {"eval/loss": float(pair_losses(self.loss, chosen, rejected, margins).mean())}
        values.update({f"eval/{tag}": value for tag, value in reward_model_metrics(chosen, rejected).items()})
        if self.rank == 0:
            logger.info(
                "step: %d  eval/loss: %.4f  eval/rm/accuracy: %.4f",
                step,
                values["eval/loss"],
                values["eval/rm/accuracy"],
            )
        self.metrics.write_scalars(step, values)
