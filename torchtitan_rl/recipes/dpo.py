"""The preference recipe (``job.recipe = "dpo"``): DPO, IPO or SimPO on the chosen / rejected
pairs of ``training.dataset``, one optimizer step per mini-batch of ``training.global_batch_size``
pairs.

A pair's loss depends on the whole-sequence log-prob sums of both its completions
(``losses.preference``). The two completions are packed like any samples (into different
micro-batches, onto different data-parallel ranks, split over context-parallel ranks), so a step
(``preference_step``) first takes every completion's sum with a gradient-free forward, and the
reference's, adds them up per pair over the data-parallel ranks, computes each completion's
coefficient ``c = ∂L/∂S``, and then trains on ``Σ c Σ_t logp_θ`` (cross-entropy weighted by
``-c`` per token, reduction "sum"), whose gradient is the loss's exactly under any layout. The
price is one extra forward of the policy per step.
"""

import logging
import time
from collections.abc import Callable

import torch

from torchtitan_rl.config import JobConfig
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.engine import Engine
from torchtitan_rl.losses.loss_fns import ForwardBackwardMetrics
from torchtitan_rl.losses.preference import (
    PreferenceLoss,
    pair_losses,
    pair_sums,
    preference_loss_from_config,
    preference_metrics,
    sequence_coefficients,
)
from torchtitan_rl.losses.reduction import NUM_TOKENS, SUM_SQUARED_SEQ_LENS
from torchtitan_rl.recipes.base import Recipe, start_run
from torchtitan_rl.recipes.preference_eval import PreferenceEvaluation, hold_out
from torchtitan_rl.recipes.reference import ReferencePolicy
from torchtitan_rl.recipes.sft import training_loader, training_rows

logger = logging.getLogger(__name__)

_REFERENCE_REMEDY = "use loss.loss_fn = 'simpo', which needs no reference"


def preference_step(
    engine: Engine,
    samples: list[Sample],
    loss: PreferenceLoss,
    num_pairs: int,
    reference_logprobs: Callable[[list[Sample]], list[torch.Tensor]] | None,
) -> tuple[ForwardBackwardMetrics, dict[str, float]]:
    """Accumulate the gradient of the mean preference loss over the mini-batch's ``num_pairs``
    pairs, of which this rank holds ``samples`` (each with its pair's ``group_id`` and whether
    it is the ``preferred`` completion; a pair's two samples may sit on different ranks), and
    return the engine's metrics and the step's loss and ``rewards/*`` / ``logps/*`` values
    (identical on every rank). Collective over the training ranks."""
    policy = engine.forward(samples).logprobs
    reference = reference_logprobs(samples) if loss.needs_reference else None
    sums = pair_sums(samples, policy, reference, num_pairs, engine.parallel_dims.mesh("batch"))
    grad_chosen, grad_rejected, value = sequence_coefficients(loss, sums)
    for sample in samples:
        coefficient = float((grad_chosen if sample.preferred else grad_rejected)[sample.group_id])
        # cross_entropy's token loss is -w * logp: w = -c gives the gradient c * ∇logp.
        sample.loss_weights = torch.where(sample.loss_mask, -coefficient, 0.0)
    fb = engine.forward_backward(samples, "cross_entropy", {"loss_weights": True})
    values = {
        "loss_metrics/global_avg_loss": value,
        "loss_metrics/global_max_loss": float(pair_losses(loss, sums).max()),
        **preference_metrics(loss, sums),
    }
    return fb, values


class DPORecipe(Recipe):
    def __init__(self, job_config: JobConfig):
        self.loss = preference_loss_from_config(job_config.loss)
        held_out = self.build_pair_data(job_config)
        self.evaluation = PreferenceEvaluation(self, held_out, self.loss) if held_out is not None else None
        self.reference = ReferencePolicy(self, _REFERENCE_REMEDY) if self.loss.needs_reference else None
        extra = self.reference.checkpointed() if self.reference is not None else None
        self.checkpointer = self.build_checkpointer(self.dataloader, extra)

    def build_pair_data(self, job_config: JobConfig, reward_model: bool = False):
        """Start the run, read the pairs, build what every recipe has (``Recipe``: with a score
        head for a ``reward_model``) and the pair loader; the held-out rows (None without evaluation)."""
        run = start_run(job_config)
        rows = training_rows(job_config, run)
        held_out = None
        if job_config.preference.eval_interval:
            rows, held_out = hold_out(rows, job_config.preference.num_eval_pairs, job_config.debug.seed)
        Recipe.__init__(self, run, num_optimizer_steps=job_config.training.steps, reward_model=reward_model)
        self.dataloader = training_loader(self, rows, preference_pairs=True)
        return held_out

    def setup(self) -> bool:
        """Resume from the latest checkpoint (the reference's weights included); or, on a fresh
        run, the reference := the policy it starts from (with LoRA: checked to be the base)."""
        resumed = super().setup()
        if not resumed and self.reference is not None:
            self.reference.start()
        return resumed

    def train(self) -> None:
        cfg = self.job_config
        log_freq, steps = cfg.metrics.log_freq, cfg.training.steps
        num_pairs = cfg.training.global_batch_size
        data_iter = iter(self.dataloader)
        window_start = time.perf_counter()
        window_tokens = window_squared_lens = 0
        first = self.train_state.step + 1
        logger.info("preference steps %d..%d on %d rank(s)", first, steps, self.parallel_dims.world_size)
        interval = cfg.preference.eval_interval
        if self.evaluation is not None and first == 1:
            self._evaluate(0)  # the model the run starts from: the held-out curves' baseline
        for step in range(first, steps + 1):
            samples = next(data_iter)
            with self.memory_profiler.step(step):
                fb, values = self.step(samples, num_pairs)
                optim = self.engine.optim_step()
            window_tokens = window_tokens + fb.counts[NUM_TOKENS]
            window_squared_lens = window_squared_lens + fb.counts[SUM_SQUARED_SEQ_LENS]
            self.train_state.step = step
            self.train_state.tokens_seen = self.train_state.tokens_seen + fb.counts[NUM_TOKENS]
            if step % log_freq == 0 or step == first or step == steps:
                dataset = self.dataloader.dataset
                # The engine's loss is the weighted log-prob sum it trained on; the step's is the pairs'.
                self.metrics.emit(
                    step,
                    {**self.metrics.reduce_update(fb, optim, with_terms=False), **values},
                    window_tokens=window_tokens,
                    window_squared_lens=window_squared_lens,
                    window_seconds=time.perf_counter() - window_start,
                    data_stats={**dataset.stats(), **dataset.balance_stats()},
                )
                window_start = time.perf_counter()
                window_tokens = window_squared_lens = 0
            if self.evaluation is not None and (step % interval == 0 or step == steps):
                self._evaluate(step)
            self.checkpointer.maybe_save(step, last=step == steps)
        self.checkpointer.wait()

    def step(self, samples: list[Sample], num_pairs: int) -> tuple[ForwardBackwardMetrics, dict[str, float]]:
        """Accumulate the gradient of one mini-batch of ``num_pairs`` pairs (this rank's
        ``samples``); the engine's metrics and the step's values (a pair recipe's own)."""
        return preference_step(self.engine, samples, self.loss, num_pairs, self._reference_logprobs())

    def _reference_logprobs(self):
        return self.reference.logprobs if self.reference is not None else None

    def _evaluate(self, step: int) -> None:
        values = self.evaluation.evaluate(step, self._reference_logprobs())
        if self.rank == 0:
            logger.info(
                "step: %d  eval/loss: %.4f  eval/rewards/accuracies: %.4f  eval/greedy_is_chosen: %.4f",
                step,
                values["eval/loss"],
                values["eval/rewards/accuracies"],
                values["eval/greedy_is_chosen"],
            )
        self.metrics.write_scalars(step, values)

    def close(self) -> None:
        try:
            self.dataloader.dataset.close()  # its prefetch thread
        finally:
            super().close()
