"""The GRPO recipe: sample completions of a task's prompts, reward them with its verifier, and
train on group advantages with the engine's layout-exact RL loss.

Per step: refresh the generator's replica from the policy; take the step's
prompts from the global stream; every data-parallel rank generates ``group_size`` completions
of its share (its CP / TP peers split that work and exchange the rollouts); reward and
compute advantages (with ``rl.dynamic_sampling``, over further rounds of prompts until the
step has enough groups with signal); with ``training.balance_dp_compute`` (the default) move
samples between data-parallel ranks so each mini-batch's work is even; optionally recompute the policy's
log-probs before the update (the proximal policy, kept apart from the sampler's) with the
rollout correction's weights, unless the update's own forward provides them (``rl.proximal``),
and the reference's (KL); with a critic (``rl.advantage = "gae"``, ``recipes.critic``) the
per-token advantages and value targets from its values; then ``ppo_epochs`` passes of
``num_minibatches`` optimizer steps (of the critic's too).
With LoRA the reference is the policy's own model with its adapters off (no second copy of the
weights), and weight syncs after the first carry only the adapters.
The trainer knows prompts, groups and mini-batches; the engine knows micro-batches, meshes
and devices; the generator knows decoding.
"""

import dataclasses
import logging
import time

import torch
import torch.distributed as dist

from torchtitan_rl.config import JobConfig
from torchtitan_rl.data.loader import build_sft_dataloader
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.utils import failures_shared
from torchtitan_rl.losses.loss_fns import LossMetrics, loss_fn_from_config, resolve_loss_fn
from torchtitan_rl.losses.reduction import NUM_TOKENS
from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
from torchtitan_rl.recipes.base import (
    Recipe,
    RunContext,
    lora_settings,
    start_run,
)
from torchtitan_rl.recipes.critic import CRITIC_FOLDER, Critic
from torchtitan_rl.recipes.grpo_data import (
    build_generator,
    build_reward_model,
    first_messages,
    generation_dtype,
    read_task,
    sampling_params,
    warms_up,
)
from torchtitan_rl.recipes.reference import ReferencePolicy
from torchtitan_rl.recipes.rollout_worker import RolloutWorker
from torchtitan_rl.rl.advantages import pass_at_k
from torchtitan_rl.rl.env_rollouts import EpisodeRollout, EpisodeRunner
from torchtitan_rl.rl.generator import trained_parameters
from torchtitan_rl.rl.plugins import calling_user_code
from torchtitan_rl.rl.proximal import proximal_source, set_proximal_logprobs
from torchtitan_rl.rl.rollout_correction import RolloutCorrection, apply_rollout_correction
from torchtitan_rl.rl.rollout_dump import RolloutLog, completion_entry, eval_record
from torchtitan_rl.rl.rollout_ranks import (
    RolloutClient,
    WeightSender,
    is_version_sent,
)
from torchtitan_rl.rl.rollout_topology import build_rollout_topology
from torchtitan_rl.rl.rollouts import (
    PromptStream,
    ScoredGroup,
    balance_over_data_parallel,
    rank_prompt_slots,
    split_among_peers,
    to_samples,
)
from torchtitan_rl.rl.step_sampler import StepSampler, completion_text, timed
from torchtitan_rl.rl.tasks import GENERATED_TASKS, Reward, answered_rows, build_task

logger = logging.getLogger(__name__)

_WARMUP_POOL_SIZE = 4096  # distinct problems of a built-in task for the SFT warm-up, at most
_REFERENCE_REMEDY = "set rl.use_reference = false and loss.kl_coef = 0"


def build_grpo(job_config: JobConfig):
    """The GRPO recipe of this rank: a ``GRPORecipe`` on a training rank, a ``RolloutWorker``
    on a rollout rank (``parallelism.rollout_ranks``)."""
    run = start_run(job_config)
    if run.parallel_dims.is_trainer:
        return GRPORecipe(job_config, run)
    return RolloutWorker(run)


class GRPORecipe(Recipe):
    def __init__(self, job_config: JobConfig, run: RunContext | None = None):
        rl, generation = job_config.rl, job_config.generation
        self.correction = RolloutCorrection(
            rl.rollout_correction, rl.rollout_correction_level, rl.rollout_correction_max, rl.rollout_correction_min
        )
        self.proximal = proximal_source(rl, self.correction)
        corrected = self.correction.mode != "none"
        loss = loss_fn_from_config(job_config.loss)
        self.loss_fn = resolve_loss_fn(
            loss.name,
            {
                **loss.options,
                "proximal_logprobs": self.proximal == "recomputed",
                "current_proximal": self.proximal == "current",
                "rollout_weights": corrected and self.proximal == "recomputed",
                "rollout_correction": self.correction if corrected and self.proximal == "current" else None,
            },
            key_prefix="loss.",
        )
        run = run or start_run(job_config)
        data = read_task(run)
        self.task, self.train_prompts, self.eval_prompts = data.task, data.train_prompts, data.eval_prompts
        self.env_class = data.env_class
        self.vision, self.eval_images = data.vision, data.eval_images
        # The policy does not step in the critic's warm-up steps (0 without a critic).
        policy_steps = job_config.training.steps - job_config.critic.warmup_steps
        super().__init__(
            run,
            num_optimizer_steps=policy_steps * rl.ppo_epochs * rl.num_minibatches,
            temperature=generation.temperature,
        )
        num_updates = job_config.training.steps * rl.ppo_epochs * rl.num_minibatches
        self.critic = Critic(self, num_updates) if rl.advantage == "gae" else None
        dims = self.parallel_dims
        self.rollout_client = None
        if dims.num_rollout_ranks:
            comm = job_config.comm
            topology = build_rollout_topology(
                dims.world_size,
                dims.num_rollout_ranks,
                self.device.type,
                comm.silent_peer_timeout_seconds,
                comm.collective_timeout_seconds,
            )
            sources = trained_parameters(self.model_args, lora_settings(job_config), job_config.model.freeze_vision)
            sender = WeightSender(
                topology, generation_dtype(job_config, self.device), self.device, sources, dims.mesh("pp")
            )
            slots = rank_prompt_slots(rl.prompts_per_step, rl.num_minibatches, dims.batch_rank(), dims.batch_degree)
            self.rollout_client = RolloutClient(
                topology,
                sender,
                job_config.training.steps,
                rl.max_staleness,
                [s for minibatch in slots for s in minibatch],
                dims.mesh("batch"),
            )
        # The trainers' own replica: every rollout when colocated, evaluation only otherwise.
        needs_replica = self.rollout_client is None or rl.eval_interval > 0
        self.generator = (
            build_generator(job_config, self.model_args, self.device, data.vision) if needs_replica else None
        )
        self._synced_bytes = 0  # taken by the replica since the last step's log
        self.sampling = sampling_params(job_config, data.stop_token_ids)
        self.stream = PromptStream(len(self.train_prompts), rl.prompts_per_step, job_config.debug.seed)
        self.sampler = None
        if self.rollout_client is None:
            self.sampler = StepSampler(
                job_config,
                self.task,
                self.train_prompts,
                self.tokenizer,
                self.generator,
                self.sampling,
                self.stream,
                self.env_class,
                data.train_images,
                build_reward_model(job_config, data, self.device),
            )
        self.reference = ReferencePolicy(self, _REFERENCE_REMEDY) if rl.use_reference else None
        extra = self.reference.checkpointed() if self.reference is not None else None
        rollouts = {"rollouts": self.rollout_client} if self.rollout_client is not None else None
        critic = {CRITIC_FOLDER: self.critic.engine} if self.critic is not None else None
        self.checkpointer = self.build_checkpointer(self.stream, extra, rollouts, critic)
        self.rollout_log = RolloutLog(job_config, self.tokenizer, dims, self.rank, self.metrics.writer)

    def setup(self) -> bool:
        """Resume from the latest checkpoint; or, on a fresh run, the SFT warm-up (unless the run
        starts from a checkpoint of its own) and the reference := the policy RL starts from (with
        LoRA: checked to be the base).
        Then start the rollout ranks, if any, from the policy RL continues with."""
        resumed = super().setup()
        if resumed and self.job_config.rl.sft_warmup_only:
            raise ValueError(
                f"rl.sft_warmup_only: {self.checkpointer.folder} already holds a training checkpoint of step "
                f"{self.train_state.step}, which this run would resume instead of warming up; use another "
                "job.dump_folder (or checkpoint.folder)"
            )
        if not resumed:
            if warms_up(self.job_config):
                self._sft_warmup()
            if self.reference is not None:
                self.reference.start()
            if self.critic is not None:
                self.critic.start()
        self.rollout_log.start(self.train_state.step)
        if self.rollout_client is not None:
            sent = self.rollout_client.start(self.engine.model, self.train_state.step, self.stream.state_dict())
            if sent:
                # The rollout ranks' first weights (every parameter), logged at the step they are from.
                self.metrics.write_scalars(self.train_state.step, {"comm/weight_sync_bytes": float(sent)})
        return resumed

    def close(self) -> None:
        """Finish the recipe's asynchronous work (the rollout dump's writes, ``Recipe.close``),
        then stop this rank's heartbeat (with rollout ranks)."""
        try:
            try:
                self.rollout_log.close()
            finally:
                super().close()
        finally:
            if self.rollout_client is not None:
                self.rollout_client.topology.close()

    def _sft_warmup(self) -> None:
        """SFT on answered problems of the task that are neither RL nor held-out prompts, with a
        throw-away AdamW, so RL starts from a policy that earns rewards sometimes."""
        cfg = self.job_config
        rl, o = cfg.rl, cfg.optimizer
        optimizer = build_optimizer(
            self.engine.model, rl.sft_warmup_lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.implementation
        )
        scheduler = build_lr_scheduler(optimizer, rl.sft_warmup_steps, 0, "linear", 0.1)
        options = dataclasses.replace(self.engine.options, reduction="token_mean", temperature=1.0)
        engine = self.engine.over(self.engine.model, optimizer=optimizer, lr_scheduler=scheduler, options=options)
        problems = self._warmup_problems()
        # With rl.sft_warmup_demonstration_steps, demonstrations alone first: what they teach (e.g.
        # copying a tool's result into the answer) is learned without direct answers to the same
        # questions competing for those tokens; the mix then sets how often the policy uses it.
        num_demonstrating = rl.sft_warmup_demonstration_steps
        demonstrating = self._warmup_loader(self._answered(problems, demonstrations=1.0)) if num_demonstrating else None
        mixed = self._warmup_loader(self._answered(problems)) if num_demonstrating < rl.sft_warmup_steps else None
        logger.info("SFT warm-up: %d steps on the %s task's answers", rl.sft_warmup_steps, rl.task)
        if num_demonstrating:
            logger.info("SFT warm-up: the first %d steps on %s demonstrations only", num_demonstrating, rl.env)
        for step in range(1, rl.sft_warmup_steps + 1):
            loader = demonstrating if step <= num_demonstrating else mixed
            values = self.metrics.reduce_update(engine.forward_backward(next(loader)), engine.optim_step())
            if step % cfg.metrics.log_freq == 0 or step == rl.sft_warmup_steps:
                if self.rank == 0:
                    logger.info("sft warm-up step: %d  loss: %.5f", step, values["loss_metrics/global_avg_loss"])
                self.metrics.write_scalars(step, {"sft_warmup/loss": values["loss_metrics/global_avg_loss"]})

    def _warmup_loader(self, rows: list[dict]):
        cfg = self.job_config
        t = cfg.training
        return iter(
            build_sft_dataloader(
                rows,
                self.tokenizer,
                seq_len=t.seq_len,
                global_batch_size=cfg.rl.sft_warmup_batch_size,
                long_sample_policy="truncate",
                seed=cfg.debug.seed,
                batch_rank=self.parallel_dims.batch_rank(),
                batch_degree=self.parallel_dims.batch_degree,
                vision=self.vision,
                balance_dp_compute=t.balance_dp_compute,
                max_tokens_per_microbatch=t.max_tokens_per_microbatch,
                cost_model=self.engine.options.cost_model,
            )
        )

    def _warmup_problems(self) -> tuple:
        rl = self.job_config.rl
        if rl.task not in GENERATED_TASKS:
            return self.task.spare_problems
        # Other problems of the built-in task, none of them an RL or held-out prompt: the warm-up
        # teaches the format and some skill, RL still has to find the pool's answers.
        num_rows = min(rl.sft_warmup_steps * rl.sft_warmup_batch_size, _WARMUP_POOL_SIZE)  # the loader repeats them
        extra = build_task(rl.task, num_train=num_rows, num_eval=0, seed=self.job_config.debug.seed + 1)
        taken = {p.prompt_key() for p in (*self.task.train_problems, *self.task.eval_problems)}
        return tuple(p for p in extra.train_problems if p.prompt_key() not in taken)

    def _answered(self, problems, demonstrations: float | None = None) -> list[dict]:
        """SFT rows of ``problems``: their answers, or with an environment that can demonstrate
        them, whole episodes (its first messages, then the turns that solve the problem) for the
        fraction ``demonstrations`` of them (default rl.sft_warmup_demonstrations)."""
        demonstrate = getattr(self.env_class, "demonstration", None)
        if demonstrate is None:
            return answered_rows(problems)
        rl = self.job_config.rl
        fraction = rl.sft_warmup_demonstrations if demonstrations is None else demonstrations
        num_demonstrations = round(fraction * len(problems))  # the loader shuffles
        rows = answered_rows(problems[num_demonstrations:])
        for problem in problems[:num_demonstrations]:
            with calling_user_code(f"rl.env = {rl.env!r} on {problem.source}: demonstration()"):
                demonstration = demonstrate(problem)
            rows.append({"messages": first_messages(self.env_class, rl.env, problem) + demonstration})
        return rows

    # ------------------------------------------------------------------ the RL step

    def train(self) -> None:
        cfg = self.job_config
        if cfg.rl.sft_warmup_only:
            self._save_warmed_up()
            return
        steps = cfg.training.steps
        first = self.train_state.step + 1
        logger.info("RL steps %d..%d on %d training rank(s)", first, steps, self.parallel_dims.world_size)
        if cfg.rl.eval_interval and first == 1:
            # The policy RL starts from (after the warm-up): the baseline of the held-out curve.
            values = self.evaluate(0)
            if self.rank == 0:
                logger.info("step: 0  eval/pass@1: %.4f", values["eval/pass@1"])
            self.metrics.write_scalars(0, values)
        for step in range(first, steps + 1):
            with self.memory_profiler.step(step):
                values = self.train_step(step)
            evaluate = cfg.rl.eval_interval and (step % cfg.rl.eval_interval == 0 or step == steps)
            if evaluate:
                values.update(self.evaluate(step))
            self.train_state.step = step
            self.metrics.emit(
                step,
                values,
                window_tokens=values.pop("tokens/trained"),
                window_squared_lens=0.0,
                window_seconds=values["time/step_s"],
                data_stats={},
            )
            if self.rollout_client is not None and self.checkpointer.will_save(step, last=step == steps):
                # The steps the rollout ranks generate before seeing these weights are part of the state.
                self.rollout_client.receive_until(step + cfg.rl.max_staleness)
                self.rollout_client.prepare_checkpoint()
            self.checkpointer.maybe_save(step, last=step == steps)
        self.checkpointer.wait()
        if self.rollout_client is not None:
            self.rollout_client.finish()

    def _save_warmed_up(self) -> None:
        """``rl.sft_warmup_only``: evaluate the warmed-up policy (when evaluation is on) and save it
        as the model-only checkpoint step-0, the start of later GRPO runs."""
        if self.job_config.rl.eval_interval:
            values = self.evaluate(0)
            if self.rank == 0:
                logger.info("step: 0  eval/pass@1: %.4f", values["eval/pass@1"])
            self.metrics.write_scalars(0, values)
        self.checkpointer.save_model(0)
        logger.info("rl.sft_warmup_only: saved the warmed-up model; no RL step runs")

    def train_step(self, step: int) -> dict[str, float]:
        cfg = self.job_config
        rl = cfg.rl
        dims = self.parallel_dims
        times: dict[str, float] = {}
        start = time.perf_counter()
        slots_by_minibatch = rank_prompt_slots(
            rl.prompts_per_step, rl.num_minibatches, dims.batch_rank(), dims.batch_degree
        )
        slots = [s for mb in slots_by_minibatch for s in mb]
        if self.rollout_client is None:
            with timed(times, "weight_sync"):
                self._sync_replica(step - 1)
            kept, values, num_generated = self._rollout_groups(step, slots, times)
            # Everything the replica took since the last step's log: an evaluation's sync included.
            values["comm/weight_sync_bytes"] = float(self._synced_bytes)
            self._synced_bytes = 0
        else:
            kept, values, num_generated = self._received_groups(step, times)
        minibatches = self._minibatch_samples(kept, slots_by_minibatch)
        # Before the reference and pi_old forwards, so that they are balanced too.
        with timed(times, "balance"):
            minibatches, balance_stats = balance_over_data_parallel(
                minibatches,
                dims.mesh("batch"),
                cfg.training.balance_dp_compute,
                cfg.training.max_tokens_per_microbatch,
                cfg.training.max_patches_per_microbatch if self.vision is not None else None,
                self.engine.options.cost_model,
            )
        values.update({f"data/{key}": value for key, value in balance_stats.items()})

        all_samples = [s for mb in minibatches for s in mb]
        if rl.use_reference:
            with timed(times, "reference"):
                for sample, logprobs in zip(all_samples, self.reference.logprobs(all_samples)):
                    sample.ref_logprobs = logprobs
        if self.proximal == "recomputed":
            with timed(times, "old_logprobs"):
                values.update(
                    set_proximal_logprobs(
                        all_samples, self.engine.forward(all_samples).logprobs, step, dims.mesh("batch")
                    )
                )
            if self.correction.mode != "none":
                values.update(apply_rollout_correction(all_samples, self.correction, dims.mesh("batch")))

        if self.critic is not None:
            with timed(times, "critic_values"):
                values.update(self.critic.set_targets(all_samples))

        with timed(times, "train"):
            updates, terms, num_trained, logprobs, critic_updates = self._update(
                minibatches, train_policy=step > cfg.critic.warmup_steps
            )
        values.update(combine_updates(updates) or self._no_update_values())
        values.update(combine_updates(critic_updates))
        if terms:
            merged = LossMetrics.combine(terms).reduce(dims.mesh("loss"))
            values.update({tag: float(value) for tag, value in merged.items()})
        if self.proximal == "current" and logprobs is not None:
            # The update's own log-probs were pi_prox's: the same metrics as from a separate pass
            # (the correction's weights, set again here, are those the loss pass computed).
            values.update(set_proximal_logprobs(all_samples, logprobs, step, dims.mesh("batch")))
            if self.correction.mode != "none":
                values.update(apply_rollout_correction(all_samples, self.correction, dims.mesh("batch")))
        if self.proximal == "sampler" and "rl/logprob_diff_mean" in values:
            # One update at the sampler's weights (no staleness): its |logp - logp_sampler| is the mismatch.
            values["rl/sampler_logprob_diff_mean"] = values["rl/logprob_diff_mean"]
            values["rl/sampler_logprob_diff_max"] = values["rl/logprob_diff_max"]
        with timed(times, "rollout_log"):
            self.rollout_log.log_step(step, all_samples)
        if self.rollout_client is not None and is_version_sent(step, cfg.training.steps, rl.max_staleness):
            with timed(times, "weight_sync"):
                values["comm/weight_sync_bytes"] = float(self.rollout_client.send_weights(self.engine.model, step))
        values.update({f"time/{phase}_s": seconds for phase, seconds in times.items()})
        values["time/step_s"] = time.perf_counter() - start
        values["throughput/generate_tps"] = self._generate_tps(num_generated, times["generate"])
        values["throughput/train_tps"] = num_trained / dims.world_size / max(times["train"], 1e-9)
        values["tokens/trained"] = float(num_trained)
        return values

    def _sync_replica(self, version: int) -> None:
        """Load the policy (the weights after step ``version``) into the trainers' replica, unless
        it holds them already, counting the bytes taken. Collective over the training ranks."""
        if self.generator.version != version or not self.generator.is_loaded:
            self._synced_bytes += self.generator.update_weights_from(self.engine.full_parameters, version)

    def _rollout_groups(self, step: int, slots: list[int], times: dict) -> tuple[list[ScoredGroup], dict, int]:
        """This rank's scored groups to train (of ``slots``), the step's rollout metrics and the
        tokens this rank generated. The metrics cover every group generated in the step (with
        dynamic sampling, of every round), trained or not."""
        dims = self.parallel_dims
        # A failure on one rank stops all of them: the next collectives span every training rank.
        sampled = self.sampler.sample(
            step, slots, dims.mesh("batch"), dims.mesh("replica"), self._training_ranks(), times, self.rank == 0
        )
        return sampled.kept, dict(sampled.values), sampled.num_generated

    def _training_ranks(self) -> dist.ProcessGroup | None:
        """Every training rank's group (``failures_shared``), None when training alone."""
        if not dist.is_initialized():
            return None
        return self.parallel_dims.trainer_group() or dist.group.WORLD

    def _received_groups(self, step: int, times: dict) -> tuple[list[ScoredGroup], dict, int]:
        """Like ``_rollout_groups``, from the rollout ranks' batch of the step, which holds this
        rank's share alone (the groups of its slots) and the step's metrics, which the rollout
        ranks computed over the whole step; its generation time is theirs,
        ``time/wait_rollouts_s`` what the trainers waited for it."""
        with timed(times, "wait_rollouts"):
            batch, num_dropped = self.rollout_client.batch(step)
        self.stream.load_state_dict(batch.stream_state)
        times["generate"] = batch.generate_seconds
        values = dict(batch.values)
        values["rl/dropped_stale"] = float(num_dropped)
        return batch.kept, values, batch.num_generated

    def _minibatch_samples(self, groups: list[ScoredGroup], slots_by_minibatch: list[list[int]]) -> list[list[Sample]]:
        minibatch_of = {slot: m for m, slots in enumerate(slots_by_minibatch) for slot in slots}
        minibatches: list[list[ScoredGroup]] = [[] for _ in slots_by_minibatch]
        for group in groups:
            minibatches[minibatch_of[group.slot]].append(group)
        cfg = self.job_config
        return [to_samples(mb, cfg.training.seq_len, cfg.rl.mask_truncated, self.vision) for mb in minibatches]

    def _generate_tps(self, num_generated: int, seconds: float) -> float:
        """``throughput/generate_tps``: tokens generated per second per generating rank, i.e. the
        step's tokens of every generating rank over their number and the slowest one's
        generation seconds. Colocated, ``num_generated`` and ``seconds`` are this rank's own and
        are reduced here over the training ranks (collective); with rollout ranks they are
        already their total and their slowest."""
        dims = self.parallel_dims
        if self.rollout_client is not None:
            return num_generated / dims.num_rollout_ranks / max(seconds, 1e-9)
        tokens = torch.tensor([float(num_generated)], dtype=torch.float64)
        slowest = torch.tensor([seconds], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(tokens, group=dims.trainer_group())
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=dims.trainer_group())
        return float(tokens[0]) / dims.world_size / max(float(slowest[0]), 1e-9)

    def _update(
        self, minibatches: list[list[Sample]], train_policy: bool = True
    ) -> tuple[list[dict[str, float]], list[LossMetrics], int, list[torch.Tensor] | None, list[dict[str, float]]]:
        """``ppo_epochs`` passes of one optimizer step per mini-batch (of the critic too, when
        there is one; of the critic alone without ``train_policy``); a mini-batch that is empty
        on every rank (all its groups filtered) is skipped, not stepped with a zero gradient.
        With the current policy as pi_prox (one mini-batch, one epoch) also the update's own
        log-probs of the samples, detached (None when the mini-batch was skipped). Last, the
        critic's values of each of its steps."""
        rl = self.job_config.rl
        counts = torch.tensor([len(mb) for mb in minibatches], dtype=torch.int64)
        batch = self.parallel_dims.mesh("batch")
        if batch is not None:
            dist.all_reduce(counts, group=batch.get_group())
        updates, terms, num_trained, logprobs, critic_updates = [], [], 0, None, []
        with_logprobs = self.proximal == "current"
        assert not with_logprobs or (rl.ppo_epochs == 1 and len(minibatches) == 1), "pi_prox is the current policy"
        for _ in range(rl.ppo_epochs):
            for samples, count in zip(minibatches, counts.tolist()):
                if count == 0:
                    continue
                if self.critic is not None:
                    critic_updates.append(self.critic.update(samples))
                if not train_policy:
                    continue
                fb = self.engine.forward_backward(samples, self.loss_fn.name, self.loss_fn.options, with_logprobs)
                updates.append(self.metrics.reduce_update(fb, self.engine.optim_step(), with_terms=False))
                if fb.router is not None:
                    # Averaged over the step's optimizer steps, like the loss.
                    updates[-1].update(self.metrics.reduce_router(fb.router)[0])
                terms.append(fb.terms)
                num_trained += int(fb.counts[NUM_TOKENS])
                logprobs = fb.logprobs
        return updates, terms, num_trained, logprobs, critic_updates

    def _no_update_values(self) -> dict[str, float]:
        return {
            "loss_metrics/global_avg_loss": 0.0,
            "loss_metrics/global_max_loss": 0.0,
            "grad_norm": 0.0,
            "lr": self.engine.lr_scheduler.get_last_lr()[0],
        }

    # ------------------------------------------------------------------ evaluation

    def _eval_reward(self, problem, rollout) -> Reward:
        """An episode's environment's reward and verdict, or the task's of a single-turn completion."""
        if isinstance(rollout, EpisodeRollout):
            return Reward(rollout.reward, rollout.correct, {})
        return self.task.reward(problem, *completion_text(self.tokenizer, rollout))

    def evaluate(self, step: int) -> dict[str, float]:
        """Greedy pass@1 and sampled pass@k of the policy after ``step`` on the held-out
        prompts, split over the training ranks."""
        k = self.job_config.rl.eval_num_samples
        start = time.perf_counter()
        self._sync_replica(step)
        indices = split_among_peers(list(range(len(self.eval_prompts))), self.rank, self.parallel_dims.world_size)
        prompts = [self.eval_prompts[i] for i in indices]
        images = None if self.eval_images is None else [self.eval_images[i] for i in indices]
        seed = self.job_config.generation.seed
        # Step -step: evaluation draws its own random numbers, never a training rollout's.
        engine = self.generator
        if self.env_class is not None:
            problems = {i: self.task.eval_problems[i] for i in indices}
            engine = EpisodeRunner.for_run(self.job_config, self.generator, self.env_class, problems, self.tokenizer)
        greedy_params = dataclasses.replace(self.sampling, temperature=0.0)
        sums = torch.zeros(4, dtype=torch.float64)  # prompts, greedy correct, Σ pass@k, Σ sampled pass@1
        records = []
        # The environment's and the reward's code; no routing recorded: nothing trains on these.
        with failures_shared(self._training_ranks()), self.generator.not_recording():
            greedy = engine.generate(prompts, indices, 1, greedy_params, seed, -step, images)
            sampled = engine.generate(prompts, indices, k, self.sampling, seed, -step, images)
            for i, index in enumerate(indices):
                problem = self.task.eval_problems[index]
                rollouts = sampled[i * k : (i + 1) * k]
                rewards = [self._eval_reward(problem, r) for r in rollouts]
                num_correct = sum(r.correct for r in rewards)
                greedy_reward = self._eval_reward(problem, greedy[i])
                passed = pass_at_k(k, num_correct, k)
                sums += torch.tensor([1.0, float(greedy_reward.correct), passed, num_correct / k], dtype=torch.float64)
                samples = [completion_entry(r, reward) for r, reward in zip(rollouts, rewards)]
                greedy_entry = completion_entry(greedy[i], greedy_reward)
                records.append(eval_record(step, index, problem.answer, greedy_entry, samples, passed, greedy[i]))
        if dist.is_initialized():
            dist.all_reduce(sums, group=self.parallel_dims.trainer_group())
        self.rollout_log.log_eval(step, records, self.parallel_dims.trainer_group())
        n = float(sums[0].clamp(min=1))
        return {
            "eval/pass@1": float(sums[1]) / n,
            f"eval/pass@{k}": float(sums[2]) / n,
            "eval/sampled_pass@1": float(sums[3]) / n,
            "time/eval_s": time.perf_counter() - start,
        }


def combine_updates(updates: list[dict[str, float]]) -> dict[str, float]:
    """One step's values from its optimizer steps (loss, grad norm, lr, token counts): token
    counts add up, the largest loss stays the largest, everything else is the mean."""
    combined = {}
    for tag in updates[0] if updates else ():
        values = [u[tag] for u in updates]
        if tag.startswith("tokens/"):
            combined[tag] = sum(values)
        elif tag == "loss_metrics/global_max_loss":
            combined[tag] = max(values)
        else:
            combined[tag] = sum(values) / len(values)
    return combined
