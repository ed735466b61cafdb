"""The project's rules on a ``JobConfig`` beyond each key's type and range that need nothing but
the config's values: keys that depend on each other and on the recipe.

``JobConfig.validate`` runs ``validate_job_config`` after every parse. This layer imports no
other part of the package: the rules that need a part's facts are stated by that part and run
by ``recipes/config_checks.py`` right after parsing (the loss's options, the task's keys, the
model's flavors and architecture; for ``model.flavor = "hf"`` once its config.json is read).
The checks that need the world size live with the mesh (``distributed/parallel_dims.py``).
Every error is a ``ValueError`` naming the key (and the file).

The section classes are not imported here (``job_config`` imports this module): a section's
defaults are ``type(section)()``.
"""

import dataclasses

# model.flavor value that takes the architecture from a Hugging Face config.json.
HF_FLAVOR = "hf"
# SFT data keys that the GRPO recipe does not read (it samples from [rl] task).
_SFT_DATA_KEYS = (
    "dataset",
    "dataset_path",
    "global_batch_size",
    "dataset_cache_dir",
    "dataset_cache_timeout_seconds",
    "dataset_prefetch",
)


def validate_job_config(cfg) -> None:
    """Every rule that spans keys of the ``JobConfig`` ``cfg``; the first broken one is a ValueError."""
    training = cfg.training
    if 0 < training.max_tokens_per_microbatch < training.seq_len:
        raise ValueError(
            f"training.max_tokens_per_microbatch: must be 0 or >= training.seq_len "
            f"({training.seq_len}) so every sequence fits, got {training.max_tokens_per_microbatch}"
        )
    loss = cfg.loss
    if loss.horizon is not None and loss.reduction != "seq_mean_token_sum_norm":
        # Fail closed: a horizon the chosen mode ignores is almost surely a mistaken mode.
        raise ValueError(
            f"loss.horizon: only used by loss.reduction = 'seq_mean_token_sum_norm', "
            f"but the reduction is {loss.reduction!r}; remove the key or change the mode"
        )
    shard = cfg.parallelism.data_parallel_shard_degree
    if shard != -1 and shard < 1:
        raise ValueError(f"parallelism.data_parallel_shard_degree: must be -1 or >= 1, got {shard}")
    _check_profiling(cfg)
    _check_checkpoint(cfg)
    _check_lora(cfg)
    _check_pipeline(cfg)
    _check_compile(cfg)
    _check_estimate(cfg)
    _check_recipe(cfg)
    if cfg.model.flavor == HF_FLAVOR:
        _check_hf_flavor(cfg)


def hf_config_dir(cfg) -> str:
    """The directory whose config.json defines the model of ``model.flavor = "hf"``."""
    ckpt = cfg.checkpoint
    return ckpt.initial_load_path if ckpt.initial_load_in_hf else cfg.model.hf_assets_path


def _check_hf_flavor(cfg) -> None:
    if not hf_config_dir(cfg):
        raise ValueError(
            "model.flavor: 'hf' takes the architecture from the config.json of checkpoint.initial_load_path "
            "(with checkpoint.initial_load_in_hf = true) or of model.hf_assets_path; set one of them"
        )


def _check_profiling(cfg) -> None:
    # The steps are checked even while snapshots are off: a recipe that lists a step the run
    # never reaches would otherwise fail only once someone turns snapshots on.
    profiling, steps = cfg.profiling, cfg.training.steps
    key = "profiling.memory_snapshot_steps"
    if profiling.enable_memory_snapshot and not profiling.memory_snapshot_steps:
        raise ValueError(
            f"{key}: is empty but profiling.enable_memory_snapshot = true; list the steps to "
            "record, e.g. [1], or turn snapshots off"
        )
    seen = set()
    for step in profiling.memory_snapshot_steps:
        if not 1 <= step <= steps:
            raise ValueError(f"{key}: step {step} is outside the run's steps 1..{steps} (training.steps)")
        if step in seen:
            raise ValueError(f"{key}: step {step} is listed more than once")
        seen.add(step)


def _check_estimate(cfg) -> None:
    # Without estimate.enable the run trains: a search or device size asked for would be ignored.
    keys = [key for key in non_default_keys(cfg.estimate) if key != "enable"]
    if keys and not cfg.estimate.enable:
        raise ValueError(
            f"estimate.{keys[0]}: only used with --estimate (estimate.enable = true), which prints the memory "
            "estimate instead of training; add --estimate or remove the key"
        )


def non_default_keys(section) -> list[str]:
    """Names of the keys of ``section`` that differ from their defaults."""
    defaults = type(section)()
    return [f.name for f in dataclasses.fields(section) if getattr(section, f.name) != getattr(defaults, f.name)]


def _check_recipe(cfg) -> None:
    """Fail closed on keys the chosen recipe ignores, and on impossible GRPO combinations."""
    if not (cfg.job.recipe == "grpo" and cfg.rl.advantage == "gae"):
        unused = [f"critic.{key}" for key in non_default_keys(cfg.critic)]
        unused += ["loss.value_clip"] if "value_clip" in non_default_keys(cfg.loss) else []
        if unused:
            raise ValueError(f"{unused[0]}: only used with job.recipe = 'grpo' and rl.advantage = 'gae' (the critic)")
    if cfg.job.recipe != "service" and non_default_keys(cfg.service):
        raise ValueError(f"service.{non_default_keys(cfg.service)[0]}: only used with job.recipe = 'service'")
    if cfg.job.recipe != "dpo":
        unused = [f"loss.{key}" for key in _PREFERENCE_LOSS_KEYS if key in non_default_keys(cfg.loss)]
        if cfg.job.recipe != "reward_model":
            unused += [f"preference.{key}" for key in non_default_keys(cfg.preference)]
        if unused:
            raise ValueError(f"{unused[0]}: only used with job.recipe = 'dpo' (preference learning)")
    if cfg.job.recipe != "reward_model" and "center_rewards_coefficient" in non_default_keys(cfg.loss):
        raise ValueError("loss.center_rewards_coefficient: only used with job.recipe = 'reward_model'")
    if cfg.job.recipe == "reward_model":
        _check_reward_model(cfg)
        return
    if cfg.job.recipe == "service":
        _check_service(cfg)
        return
    if cfg.job.recipe == "dpo":
        _check_dpo(cfg)
        return
    if cfg.job.recipe == "sft":
        for name in ("rl", "generation"):
            unused = non_default_keys(getattr(cfg, name))
            if unused:
                raise ValueError(f"{name}.{unused[0]}: only used with job.recipe = 'grpo'")
        if cfg.parallelism.rollout_ranks:
            raise ValueError("parallelism.rollout_ranks: only used with job.recipe = 'grpo'")
        return
    training_defaults = type(cfg.training)()
    unused = [key for key in _SFT_DATA_KEYS if getattr(cfg.training, key) != getattr(training_defaults, key)]
    if unused:
        raise ValueError(
            f"training.{unused[0]}: not used by job.recipe = 'grpo', which samples prompts of rl.task "
            "(rl.prompts_per_step per step)"
        )
    loss, rl, generation = cfg.loss, cfg.rl, cfg.generation
    if generation.top_p < 1 or generation.top_k > 0:
        key = "top_p" if generation.top_p < 1 else "top_k"
        raise ValueError(
            f"generation.{key}: truncated sampling draws from a distribution the trainer does not evaluate "
            f"(it sees the full softmax), which biases the ratio of loss.loss_fn = {loss.loss_fn!r}; use "
            "top_p = 1 and top_k = 0"
        )
    if loss.kl_coef > 0 and not rl.use_reference:
        raise ValueError("loss.kl_coef: the KL penalty needs the reference model; set rl.use_reference = true")
    if rl.kl_in_reward_coef > 0 and not rl.use_reference:
        raise ValueError("rl.kl_in_reward_coef: the KL penalty needs the reference model; set rl.use_reference = true")
    if rl.use_reference and loss.kl_coef == 0 and rl.kl_in_reward_coef == 0:
        raise ValueError(
            "rl.use_reference: the reference model only serves the KL penalty; set loss.kl_coef > 0 (or, with "
            "rl.advantage = 'gae', rl.kl_in_reward_coef > 0)"
        )
    _check_advantage(cfg)
    one_update = rl.ppo_epochs == 1 and rl.num_minibatches == 1 and rl.max_staleness == 0
    if rl.proximal == "recompute" and one_update and rl.rollout_correction == "none":
        raise ValueError(
            "rl.proximal: without rl.rollout_correction and with one optimizer step on fresh rollouts the ratio "
            "is to the sampler's log-probs and no proximal policy is computed; 'recompute' only applies with a "
            "correction, rl.ppo_epochs > 1, rl.num_minibatches > 1 or rl.max_staleness > 0"
        )
    _check_task(cfg)
    if cfg.checkpoint.initial_load_path and not cfg.checkpoint.initial_load_model_only:
        raise ValueError(
            "checkpoint.initial_load_model_only: job.recipe = 'grpo' starts from another run's model weights "
            "only (its optimizer and data position belong to that run)"
        )
    if rl.prompts_per_step % rl.num_minibatches != 0:
        raise ValueError(
            f"rl.prompts_per_step={rl.prompts_per_step} is not divisible by rl.num_minibatches={rl.num_minibatches}"
        )
    defaults = type(rl)()
    if not rl.env and rl.max_turns != defaults.max_turns:
        raise ValueError("rl.max_turns: only used with rl.env (a multi-turn environment)")
    if rl.env and rl.overlong_buffer:
        raise ValueError(
            "rl.overlong_buffer: shapes single-turn completions by length; with rl.env an episode's length is its "
            "environment's business (end it, or lower its reward)"
        )
    if rl.max_staleness and not cfg.parallelism.rollout_ranks:
        raise ValueError(
            f"rl.max_staleness={rl.max_staleness}: generating ahead of the trainers needs ranks of its own; set "
            "parallelism.rollout_ranks >= 1 (the colocated run is synchronous)"
        )
    _check_silent_peer_timeout(cfg)
    _check_rollout_correction(rl)
    _check_dapo(rl, generation)


def _check_silent_peer_timeout(cfg) -> None:
    comm = cfg.comm
    if cfg.parallelism.rollout_ranks and comm.silent_peer_timeout_seconds >= comm.collective_timeout_seconds:
        raise ValueError(
            f"comm.silent_peer_timeout_seconds={comm.silent_peer_timeout_seconds}: must be below "
            f"comm.collective_timeout_seconds={comm.collective_timeout_seconds}, so that a rank that stops is named "
            "before a collective it stalls times out with the backend's message; lower it or raise the other"
        )


def _check_task(cfg) -> None:
    """What evaluation, a reward function and the warm-up need (which keys go with which task is
    the tasks' rule: ``rl.tasks.check_task_settings``)."""
    rl = cfg.rl
    if rl.eval_task_path and not rl.eval_interval:
        raise ValueError("rl.eval_task_path: only used with evaluation; set rl.eval_interval > 0")
    if rl.eval_interval and not rl.num_eval_prompts and not rl.eval_task_path:
        raise ValueError(
            f"rl.num_eval_prompts = 0: rl.eval_interval={rl.eval_interval} evaluates on held-out prompts; hold some "
            "out (rl.num_eval_prompts >= 1), name a file of them (rl.eval_task_path), or set rl.eval_interval = 0"
        )
    defaults = type(rl)()
    if rl.reward_fn:
        if rl.env:
            raise ValueError("rl.reward_fn: with rl.env the environment rewards each episode; leave rl.reward_fn empty")
        for key in ("partial_credit", "format_reward", "answer_match"):
            if getattr(rl, key) != getattr(defaults, key):
                raise ValueError(f"rl.{key}: sets the task's verifier, which rl.reward_fn = {rl.reward_fn!r} replaces")
    _check_reward_model_in_rl(cfg)
    if rl.sft_warmup_only:
        if not rl.sft_warmup_steps:
            raise ValueError("rl.sft_warmup_only: set rl.sft_warmup_steps >= 1 (the warm-up is all this run does)")
        if not cfg.checkpoint.enable:
            raise ValueError(
                "rl.sft_warmup_only: the run saves the warmed-up model and exits; set checkpoint.enable = true"
            )
        if cfg.parallelism.rollout_ranks:
            raise ValueError("parallelism.rollout_ranks: rl.sft_warmup_only runs no RL step, so nothing to generate")


def _check_reward_model_in_rl(cfg) -> None:
    """A reward model scores single-turn text completions; its other keys need it."""
    rl = cfg.rl
    if not rl.reward_model:
        defaults = type(rl)()
        for key in ("reward_model_weight", "reward_model_normalize", "reward_model_alone"):
            if getattr(rl, key) != getattr(defaults, key):
                raise ValueError(f"rl.{key}: only used with rl.reward_model (the path of a reward model)")
        return
    if rl.env:
        raise ValueError(
            "rl.reward_model: with rl.env the environment rewards each episode; leave rl.reward_model empty"
        )
    if cfg.model.name != "qwen3":
        raise ValueError(
            f"rl.reward_model: a text reward model cannot score the completions of a model.name = {cfg.model.name!r} "
            "policy, whose prompts hold images"
        )


def _check_rollout_correction(rl) -> None:
    defaults = type(rl)()
    if rl.rollout_correction == "none":
        for key in ("rollout_correction_level", "rollout_correction_max", "rollout_correction_min"):
            if getattr(rl, key) != getattr(defaults, key):
                raise ValueError(f"rl.{key}: only used with rl.rollout_correction other than 'none'")
        return
    if rl.rollout_correction == "geo_mask" and rl.rollout_correction_level != "sequence":
        raise ValueError(
            f"rl.rollout_correction_level = {rl.rollout_correction_level!r}: geo_mask keeps or masks whole "
            "sequences by their geometric mean ratio; set rl.rollout_correction_level = 'sequence'"
        )
    if not rl.rollout_correction_min < rl.rollout_correction_max:
        raise ValueError(
            f"rl.rollout_correction_min={rl.rollout_correction_min} must be below "
            f"rl.rollout_correction_max={rl.rollout_correction_max}"
        )


_GAE_RL_KEYS = ("gamma", "lam", "kl_in_reward_coef")


def _check_advantage(cfg) -> None:
    """Group baselines need groups; the critic (rl.advantage = "gae") replaces them."""
    rl = cfg.rl
    if rl.advantage != "gae":
        unused = [key for key in _GAE_RL_KEYS if key in non_default_keys(rl)]
        if unused:
            raise ValueError(f"rl.{unused[0]}: only used with rl.advantage = 'gae' (PPO with a learned critic)")
        if rl.group_size < 2:
            raise ValueError(
                f"rl.group_size = {rl.group_size}: rl.advantage = {rl.advantage!r} takes its baseline from the "
                "prompt's group, which needs at least 2 completions (or use rl.advantage = 'gae', a learned critic)"
            )
        return
    for key in ("filter_zero_variance_groups", "dynamic_sampling"):
        if getattr(rl, key):
            raise ValueError(
                f"rl.{key}: drops groups whose rewards are all equal, but under rl.advantage = 'gae' the critic's "
                "values give such rollouts a signal too; set it to false"
            )
    if cfg.model.name != "qwen3":
        raise ValueError(f"rl.advantage = 'gae': the critic is a qwen3 text model; model.name = {cfg.model.name!r}")
    if cfg.critic.lora and not cfg.lora.enable:
        raise ValueError("critic.lora: trains adapters with [lora]'s settings; set lora.enable = true")
    if cfg.critic.warmup_steps >= cfg.training.steps:
        raise ValueError(
            f"critic.warmup_steps={cfg.critic.warmup_steps}: the policy would never train in "
            f"training.steps={cfg.training.steps}; set it below training.steps"
        )


def _check_dapo(rl, generation) -> None:
    defaults = type(rl)()
    if not rl.dynamic_sampling and rl.max_sampling_rounds != defaults.max_sampling_rounds:
        raise ValueError("rl.max_sampling_rounds: only used with rl.dynamic_sampling = true")
    if rl.dynamic_sampling and rl.filter_zero_variance_groups:
        raise ValueError(
            "rl.filter_zero_variance_groups: implied by rl.dynamic_sampling, which trains only groups with "
            "signal; remove the key"
        )
    if rl.overlong_buffer >= generation.max_new_tokens:
        raise ValueError(
            f"rl.overlong_buffer={rl.overlong_buffer} must be below generation.max_new_tokens="
            f"{generation.max_new_tokens}: the penalty grows over the last overlong_buffer tokens of a completion"
        )
    if not rl.overlong_buffer and rl.overlong_penalty != defaults.overlong_penalty:
        raise ValueError("rl.overlong_penalty: only used with rl.overlong_buffer > 0")


_PIPELINE_KEYS = (
    ("parallelism", ("pipeline_schedule", "pipeline_layers_per_stage")),
    ("training", ("pipeline_microbatches",)),
)


def _check_pipeline(cfg) -> None:
    """Pipeline keys only with pipeline parallel, and what it does not combine with yet."""
    p = cfg.parallelism
    if p.pipeline_parallel_degree == 1:
        for section, keys in _PIPELINE_KEYS:
            for key in keys:
                if key in non_default_keys(getattr(cfg, section)):
                    raise ValueError(f"{section}.{key}: only used with parallelism.pipeline_parallel_degree > 1")
        return
    pp = f"parallelism.pipeline_parallel_degree = {p.pipeline_parallel_degree}"
    if cfg.job.recipe not in ("sft", "grpo", "dpo"):
        raise ValueError(f"{pp}: pipeline parallel trains job.recipe = 'sft', 'grpo' or 'dpo', not {cfg.job.recipe!r}")
    others = (
        ("rl.advantage = 'gae' (the critic)", cfg.rl.advantage == "gae"),
        ("rl.reward_model", bool(cfg.rl.reward_model)),
    )
    for key, on in others:
        if on:
            raise ValueError(f"{pp}: not supported together with {key} yet")


def _check_compile(cfg) -> None:
    if not cfg.compile.enable and cfg.compile.backend != type(cfg.compile)().backend:
        # Fail closed, like checkpoint.*: a backend for a run that compiles nothing is a forgotten enable.
        raise ValueError("compile.backend: only used with compile.enable = true")


def _check_lora(cfg) -> None:
    lora = cfg.lora
    if not lora.enable:
        unused = [name for name in non_default_keys(lora) if name != "enable"]
        if unused:
            # Fail closed: adapter settings on a run that trains the full model are a forgotten lora.enable.
            raise ValueError(f"lora.{unused[0]}: only used with lora.enable = true")
        if cfg.checkpoint.initial_load_adapter_path:
            raise ValueError("checkpoint.initial_load_adapter_path: loading a PEFT adapter needs lora.enable = true")
        return
    if not lora.target_modules:
        raise ValueError("lora.target_modules: name at least one layer to adapt (e.g. ['wq', 'wv'])")
    if lora.dropout > 0 and cfg.parallelism.tensor_parallel_degree > 1:
        raise ValueError(
            "lora.dropout: not supported with parallelism.tensor_parallel_degree > 1 (the tensor-parallel ranks "
            "would draw different masks for the same replicated input); set it to 0"
        )
    if lora.dropout > 0 and "output" in lora.target_modules:
        raise ValueError(
            "lora.dropout: the output head's adapter is applied as a merged weight by the chunked loss, which "
            "cannot drop its input; set lora.dropout = 0 or remove 'output' from lora.target_modules"
        )
    if cfg.checkpoint.initial_load_adapter_path and not cfg.checkpoint.initial_load_path:
        raise ValueError(
            "checkpoint.initial_load_adapter_path: set checkpoint.initial_load_path to the base model the adapter "
            "was trained on"
        )
    if lora.export_merged and not cfg.checkpoint.last_save_in_hf:
        raise ValueError("lora.export_merged: only used with checkpoint.last_save_in_hf = true")


def _check_checkpoint(cfg) -> None:
    ckpt = cfg.checkpoint
    # The warm-up's save (rl.sft_warmup_only) is model only anyway.
    if ckpt.last_save_in_hf and not ckpt.last_save_model_only and not cfg.rl.sft_warmup_only:
        raise ValueError(
            "checkpoint.last_save_in_hf: a Hugging Face save holds only the model weights; "
            "set checkpoint.last_save_model_only = true as well"
        )
    if ckpt.initial_load_in_hf and not ckpt.initial_load_path:
        raise ValueError(
            "checkpoint.initial_load_in_hf: set checkpoint.initial_load_path to the Hugging Face directory"
        )
    if ckpt.initial_load_in_hf and not ckpt.initial_load_model_only:
        raise ValueError(
            "checkpoint.initial_load_model_only: must be true with checkpoint.initial_load_in_hf "
            "(a Hugging Face directory holds no optimizer, schedule or data state)"
        )
    if ckpt.load_step > cfg.training.steps:
        raise ValueError(
            f"checkpoint.load_step: step {ckpt.load_step} is past the run's last step "
            f"{cfg.training.steps} (training.steps)"
        )
    defaults = type(ckpt)()
    for key in ("load_step", "keep_latest_k", "last_save_model_only", "async_mode"):
        if not ckpt.enable and getattr(ckpt, key) != getattr(defaults, key):
            # Fail closed: a saving or resuming option on a run that never checkpoints is a
            # forgotten checkpoint.enable.
            raise ValueError(f"checkpoint.{key}: only used with checkpoint.enable = true")


# The keys of [loss] only the preference losses read, and those they never read.
_PREFERENCE_LOSS_KEYS = ("beta", "label_smoothing", "simpo_gamma", "nll_coef")
# What the preference evaluation's greedy generation reads of [generation].
_PREFERENCE_EVAL_GENERATION_KEYS = ("max_new_tokens", "stop_tokens", "dtype", "max_prompts_per_batch")
_POLICY_LOSS_KEYS = ("horizon", "clip_low", "clip_high", "dual_clip_c", "kl_coef", "kl_estimator", "entropy_coef")


def _check_dpo(cfg) -> None:
    """Preference learning trains on dataset pairs with a loss over whole pairs: no sampling, and
    none of the per-token policy loss's keys."""
    if non_default_keys(cfg.rl):
        raise ValueError(f"rl.{non_default_keys(cfg.rl)[0]}: only used with job.recipe = 'grpo'")
    unused = [key for key in non_default_keys(cfg.generation) if key not in _PREFERENCE_EVAL_GENERATION_KEYS]
    if unused or (non_default_keys(cfg.generation) and not cfg.preference.eval_interval):
        key = (unused or non_default_keys(cfg.generation))[0]
        raise ValueError(
            f"generation.{key}: job.recipe = 'dpo' generates only in its evaluation (preference.eval_interval > 0), "
            f"greedily, with generation.{', generation.'.join(_PREFERENCE_EVAL_GENERATION_KEYS)}"
        )
    if cfg.parallelism.rollout_ranks:
        raise ValueError("parallelism.rollout_ranks: only used with job.recipe = 'grpo'")
    if "num_eval_pairs" in non_default_keys(cfg.preference) and not cfg.preference.eval_interval:
        raise ValueError("preference.num_eval_pairs: only used with preference.eval_interval > 0")
    loss = cfg.loss
    unused = [key for key in _POLICY_LOSS_KEYS if key in non_default_keys(loss)]
    if unused:
        raise ValueError(f"loss.{unused[0]}: not used by job.recipe = 'dpo' (loss.loss_fn = {loss.loss_fn!r})")
    if loss.reduction != "sum":
        raise ValueError(
            f"loss.reduction: job.recipe = 'dpo' averages its loss over the mini-batch's pairs itself, and trains on "
            f"a plain weighted sum of token log-probs; set loss.reduction = 'sum', not {loss.reduction!r}"
        )
    if loss.loss_fn != "simpo" and "simpo_gamma" in non_default_keys(loss):
        raise ValueError(f"loss.simpo_gamma: only used with loss.loss_fn = 'simpo', not {loss.loss_fn!r}")


def _check_reward_model(cfg) -> None:
    """A reward model trains on dataset pairs with the Bradley–Terry loss of their scores: no
    sampling, no generation, and none of [loss]'s other keys."""
    for name in ("rl", "generation"):
        unused = non_default_keys(getattr(cfg, name))
        if unused:
            raise ValueError(f"{name}.{unused[0]}: not used by job.recipe = 'reward_model'")
    if cfg.parallelism.rollout_ranks:
        raise ValueError("parallelism.rollout_ranks: only used with job.recipe = 'grpo'")
    if "num_eval_pairs" in non_default_keys(cfg.preference) and not cfg.preference.eval_interval:
        raise ValueError("preference.num_eval_pairs: only used with preference.eval_interval > 0")
    unused = [key for key in non_default_keys(cfg.loss) if key != "center_rewards_coefficient"]
    if unused:
        raise ValueError(
            f"loss.{unused[0]}: not used by job.recipe = 'reward_model', whose loss is the Bradley–Terry loss "
            "of the pairs' scores (loss.center_rewards_coefficient is its only key)"
        )
    if cfg.model.name != "qwen3":
        raise ValueError(f"model.name: job.recipe = 'reward_model' builds a qwen3 reward model, not {cfg.model.name!r}")
    if cfg.lora.enable:
        raise ValueError("lora.enable: job.recipe = 'reward_model' trains the whole model (no LoRA reward models)")
    training = cfg.training
    if 0 < training.max_tokens_per_microbatch <= training.seq_len:
        raise ValueError(
            f"training.max_tokens_per_microbatch: a reward model reads whole texts of up to training.seq_len + 1 = "
            f"{training.seq_len + 1} tokens; set 0 or more, not {training.max_tokens_per_microbatch}"
        )


# How the service's sampler replica is built; what a sample request carries is the request's.
_SERVICE_GENERATION_KEYS = ("dtype", "max_prompts_per_batch", "compile")


def _check_service(cfg) -> None:
    """The service trains LoRA clients on plain sums (Tinker's losses), from requests, not data."""
    unused = [f"rl.{key}" for key in non_default_keys(cfg.rl)] + [
        f"generation.{key}" for key in non_default_keys(cfg.generation) if key not in _SERVICE_GENERATION_KEYS
    ]
    if unused:
        raise ValueError(f"{unused[0]}: not used by job.recipe = 'service' (sampling requests carry their own)")
    if cfg.checkpoint.enable:
        raise ValueError(
            "checkpoint.enable: job.recipe = 'service' saves each client's state when the client asks (save_state); "
            "set checkpoint.enable = false (checkpoint.initial_load_path still gives the base weights)"
        )
    if cfg.lora.train_embeddings:
        raise ValueError("lora.train_embeddings: Tinker's LoRA clients train adapters only; set it to false")
    if not cfg.lora.enable:
        raise ValueError("lora.enable: job.recipe = 'service' trains LoRA clients; set lora.enable = true")
    if cfg.lora.dropout > 0:
        raise ValueError("lora.dropout: Tinker's LoRA has no dropout; set lora.dropout = 0")
    if cfg.loss.reduction != "sum":
        raise ValueError(
            f"loss.reduction: job.recipe = 'service' computes Tinker's losses, plain sums over tokens and datums "
            f"(clients normalize through their weights); set loss.reduction = 'sum', not {cfg.loss.reduction!r}"
        )
    if not cfg.service.base_models:
        raise ValueError("service.base_models: name at least one base model")
    _check_silent_peer_timeout(cfg)
