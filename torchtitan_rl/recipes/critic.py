"""PPO's learned critic in the GRPO recipe (``rl.advantage = "gae"``): a value model beside the
policy, on the same meshes, with its own optimizer.

Per step, after the rollouts are balanced over the data-parallel ranks (and the reference's
log-probs, which a KL penalty in the reward reads, are in): the critic's values of every
rollout give its per-token advantages and value targets (``rl.gae``); then each mini-batch
trains the critic on its value loss (``CriticEngine.value_forward_backward``) beside the
policy's update, for as many epochs. During ``critic.warmup_steps`` only the critic trains.

The critic starts from ``critic.initial_load_path`` or from the policy's starting weights
(its body; the score head is fresh), is part of every checkpoint with its optimizer and LR
schedule, and is exported beside the policy by the last Hugging Face save, as a
``Qwen3ForTokenClassification`` in ``<step>/critic``.
"""

import dataclasses
import os

import torch

from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.fsdp import reshard
from torchtitan_rl.engine_values import CriticEngine, ValueMetrics
from torchtitan_rl.hf_checkpoint import load_hf_weights, read_hf_model_args
from torchtitan_rl.models.lora import is_adapter_key
from torchtitan_rl.models.qwen3.args import architecture_differences, as_critic
from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
from torchtitan_rl.recipes.base import REDUCE_DTYPES, Recipe, build_model, compute_dtype, lora_settings
from torchtitan_rl.rl.gae import set_critic_targets, target_metrics

CRITIC_FOLDER = "critic"  # where a Hugging Face save puts the critic, inside the step's folder


class Critic:
    """The value model of ``recipe`` (a GRPO recipe whose ``rl.advantage`` is ``gae``); its LR
    schedule spans ``num_optimizer_steps``."""

    def __init__(self, recipe: Recipe, num_optimizer_steps: int):
        cfg = recipe.job_config
        c, o, s = cfg.critic, cfg.optimizer, cfg.lr_scheduler
        self.job_config, self.policy = cfg, recipe.engine
        self.batch_mesh = recipe.parallel_dims.mesh("batch")
        self.args = as_critic(recipe.model_args)
        ac = cfg.activation_checkpoint
        model = build_model(
            self.args,
            parallel_dims=recipe.parallel_dims,
            device=recipe.device,
            seed=cfg.debug.seed,
            param_dtype=compute_dtype(cfg, recipe.device),
            reduce_dtype=REDUCE_DTYPES[cfg.training.mixed_precision_reduce],
            ac_mode=ac.mode,
            ac_every=ac.selective_every,
            compile_backend=cfg.compile.backend if cfg.compile.enable else None,
            reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
            lora=lora_settings(cfg) if c.lora else None,
        )
        optimizer = build_optimizer(model, c.lr, o.beta1, o.beta2, o.eps, c.weight_decay, o.implementation)
        scheduler = build_lr_scheduler(optimizer, num_optimizer_steps, c.lr_warmup_steps, s.decay_type, s.min_lr_factor)
        self.engine = CriticEngine(
            model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            parallel_dims=recipe.parallel_dims,
            device=recipe.device,
            options=dataclasses.replace(recipe.engine.options, max_norm=c.max_norm),
            autocast_dtype=recipe.engine.autocast_dtype,
        )

    def start(self) -> None:
        """On a fresh run, once the policy holds its start weights: the critic's start weights,
        from ``critic.initial_load_path`` or the policy's body (under LoRA, the base's)."""
        path = self.job_config.critic.initial_load_path
        if path:
            self._load(path)
            return
        reshard(self.policy.model)
        reshard(self.engine.model)
        body = {name: p for name, p in self.policy.model.named_parameters() if not is_adapter_key(name)}
        with torch.no_grad():
            for name, param in self.engine.model.named_parameters():
                # Every base parameter but the heads (output vs score); a LoRA critic's adapters
                # stay as initialized (B = 0: the critic is its base).
                if name in body:
                    param.copy_(body[name])

    def _load(self, path: str) -> None:
        key = f"critic.initial_load_path={path!r}"
        if not os.path.isdir(path):
            raise ValueError(f"{key} does not exist")
        stored = read_hf_model_args(path, self.args.attn_backend)
        if type(stored) is not type(self.args):
            raise ValueError(f"{key} holds a {type(stored).__name__} model, not the policy's architecture")
        differences = architecture_differences(as_critic(stored), self.args)
        if differences:
            field, theirs, ours = differences[0]
            raise ValueError(
                f"{key}: its {field} is {theirs!r} in {os.path.join(path, 'config.json')}, the policy's is {ours!r} "
                f"({len(differences)} difference(s)); the critic has the policy's architecture"
            )
        load_hf_weights(self.engine.model, path)

    def set_targets(self, samples: list[Sample]) -> dict[str, float]:
        """Give this rank's ``samples`` their advantages, returns and old values from the
        critic's values and their rollouts' rewards, and return the step's ``critic/*`` target
        metrics. Collective over the training ranks."""
        rl = self.job_config.rl
        values = self.engine.values(samples)
        # A rollout without loss tokens (rl.mask_truncated) trains nothing and has no token to
        # carry its reward: its targets are 0 and it stays out of the whitening.
        trained = [i for i, sample in enumerate(samples) if bool(sample.loss_mask.any())]
        for i in set(range(len(samples))) - set(trained):
            zeros = torch.zeros(len(samples[i]))
            samples[i].advantages, samples[i].returns, samples[i].old_values = zeros, zeros.clone(), values[i]
            samples[i].rollout_info["advantage"] = 0.0
        samples, values = [samples[i] for i in trained], [values[i] for i in trained]
        rewards = [sample.rollout_info["reward"] for sample in samples]
        kl = None
        if rl.kl_in_reward_coef:
            # k1 of the sampled tokens: the sampler's log-probs are the policy that chose them.
            kl = [sample.sampler_logprobs - sample.ref_logprobs for sample in samples]
        set_critic_targets(samples, values, rewards, rl.gamma, rl.lam, self.batch_mesh, kl, rl.kl_in_reward_coef)
        for sample in samples:  # the rollout dump's advantage: the mean over the sampled tokens
            sample.rollout_info["advantage"] = float(sample.advantages[sample.loss_mask].mean())
        return target_metrics(samples, self.batch_mesh)

    def update(self, samples: list[Sample]) -> dict[str, float]:
        """One optimizer step of the critic on the value loss of a mini-batch, of which this
        rank holds ``samples`` (with targets); its ``critic/*`` values. Collective."""
        c = self.job_config.critic
        metrics: ValueMetrics = self.engine.value_forward_backward(
            samples, self.job_config.loss.value_clip, c.value_coef
        )
        optim = self.engine.optim_step()
        values = metrics.reduce(self.policy.parallel_dims.trainer_group())
        values["critic/grad_norm"] = float(optim["grad_norm"])
        values["critic/lr"] = float(optim["lr"])
        return values
