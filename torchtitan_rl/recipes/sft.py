"""The SFT recipe: cross-entropy on the assistant tokens of chat rows, one optimizer step per
global mini-batch."""

import functools
import logging
import os
import time

from torchtitan_rl.config import JobConfig
from torchtitan_rl.data.datasets import load_rows
from torchtitan_rl.data.loader import build_sft_dataloader
from torchtitan_rl.losses.loss_fns import LossFn, loss_fn_from_config
from torchtitan_rl.losses.reduction import GROUPED_MODES, NUM_TOKENS, SUM_SQUARED_SEQ_LENS
from torchtitan_rl.recipes.base import (
    Recipe,
    RunContext,
    check_divisible_by_data_parallel,
    start_run,
    vision_data_config,
)

logger = logging.getLogger(__name__)


def sft_loss_fn(job_config: JobConfig) -> LossFn:
    """The ``[loss]`` of an SFT run; SFT rows carry no advantages, log-probs or prompt groups."""
    loss = job_config.loss
    if loss.loss_fn != "cross_entropy":
        raise ValueError(
            f"loss.loss_fn: {loss.loss_fn!r} needs advantages and sampler log-probs, which SFT data "
            "does not have; SFT trains with 'cross_entropy'"
        )
    if loss.kl_coef > 0:
        raise ValueError("loss.kl_coef: the KL penalty needs reference log-probs, which SFT data does not have")
    if loss.reduction in GROUPED_MODES:
        raise ValueError(f"loss.reduction: {loss.reduction!r} weighs prompt groups, which SFT data does not have")
    return loss_fn_from_config(loss)


def training_rows(job_config: JobConfig, run: RunContext):
    """The rows of ``training.dataset`` (a recipe that trains on a dataset: SFT, DPO), once the
    global batch is known to split evenly over the data-parallel ranks."""
    t = job_config.training
    check_divisible_by_data_parallel("training.global_batch_size", t.global_batch_size, run.parallel_dims)
    cache_dir = t.dataset_cache_dir or os.path.join(job_config.job.dump_folder, "dataset_cache")
    return load_rows(
        t.dataset,
        t.dataset_path,
        t.dataset_split,
        t.num_synthetic_samples,
        job_config.debug.seed,
        cache_dir=cache_dir,
        cache_timeout_s=t.dataset_cache_timeout_seconds,
    )


def training_loader(recipe: Recipe, rows, **options):
    """The checkpointable loader of ``rows`` as ``[training]`` sets it, for ``recipe``'s data-parallel
    rank and model; ``options``: further ``build_sft_dataloader`` keywords (``prepare``,
    ``preference_pairs``)."""
    cfg, t = recipe.job_config, recipe.job_config.training
    return build_sft_dataloader(
        rows,
        recipe.tokenizer,
        seq_len=t.seq_len,
        global_batch_size=t.global_batch_size,
        long_sample_policy=t.long_sample_policy,
        seed=cfg.debug.seed,
        batch_rank=recipe.parallel_dims.batch_rank(),
        batch_degree=recipe.parallel_dims.batch_degree,
        vision=vision_data_config(cfg, recipe.model_args),
        balance_dp_compute=t.balance_dp_compute,
        max_tokens_per_microbatch=t.max_tokens_per_microbatch,
        cost_model=recipe.engine.options.cost_model,
        prefetch=t.dataset_prefetch,
        **options,
    )


class SFTRecipe(Recipe):
    def __init__(self, job_config: JobConfig):
        self.loss_fn = sft_loss_fn(job_config)
        run = start_run(job_config)
        t = job_config.training
        rows = training_rows(job_config, run)
        super().__init__(run, num_optimizer_steps=t.steps)
        self.dataloader = training_loader(
            self,
            rows,
            # Checking, planning, packing and counting the micro-batches (and, on the CPU,
            # planning their attention) run on the prefetch thread too, off the step.
            prepare=functools.partial(
                self.engine.prepare, loss_fn=self.loss_fn.name, loss_fn_config=self.loss_fn.options
            ),
        )
        self.checkpointer = self.build_checkpointer(self.dataloader)

    def train(self) -> None:
        log_freq = self.job_config.metrics.log_freq
        steps = self.job_config.training.steps
        data_iter = iter(self.dataloader)
        window_start = time.perf_counter()
        window_tokens = window_squared_lens = 0
        first = self.train_state.step + 1
        logger.info("training steps %d..%d on %d rank(s)", first, steps, self.parallel_dims.world_size)
        for step in range(first, steps + 1):
            batch = next(data_iter)
            with self.memory_profiler.step(step):
                fb = self.engine.forward_backward(batch, self.loss_fn.name, self.loss_fn.options)
                optim = self.engine.optim_step()
            window_tokens = window_tokens + fb.counts[NUM_TOKENS]
            window_squared_lens = window_squared_lens + fb.counts[SUM_SQUARED_SEQ_LENS]
            self.train_state.step = step
            # Summed on the host only when a checkpoint is written.
            self.train_state.tokens_seen = self.train_state.tokens_seen + fb.counts[NUM_TOKENS]
            if step % log_freq == 0 or step == first or step == steps:
                dataset = self.dataloader.dataset
                self.metrics.log(
                    step,
                    fb=fb,
                    optim=optim,
                    window_tokens=window_tokens,
                    window_squared_lens=window_squared_lens,
                    window_seconds=time.perf_counter() - window_start,
                    data_stats={**dataset.stats(), **dataset.balance_stats()},
                )
                window_start = time.perf_counter()
                window_tokens = window_squared_lens = 0
            self.checkpointer.maybe_save(step, last=step == steps)
        self.checkpointer.wait()

    def close(self) -> None:
        try:
            self.dataloader.dataset.close()  # its prefetch thread
        finally:
            super().close()
