"""What both sides of a GRPO run read from the config: the task's prompts (tokenized and
checked; with a vision-language model, their images planned from their headers), the
sampler's replica and its sampling parameters. Training ranks and rollout ranks
(``recipes/rollout_worker.py``) build them the same way."""

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan_rl.config import JobConfig
from torchtitan_rl.data.chat import tokenize_prompt_row
from torchtitan_rl.data.tokenizer import stop_token_ids
from torchtitan_rl.data.vision_samples import RowPlanner, VisionDataConfig
from torchtitan_rl.recipes.base import (
    RunContext,
    check_divisible_by_data_parallel,
    compute_dtype,
    lora_settings,
    model_args_from_config,
    vision_data_config,
)
from torchtitan_rl.recipes.reward_model_replica import load_reward_model, reward_model_args
from torchtitan_rl.rl.envs import load_environment
from torchtitan_rl.rl.generator import PromptImages, SamplingParams, TorchGenerator
from torchtitan_rl.rl.plugins import calling_user_code
from torchtitan_rl.rl.reward_model_scores import RewardModelScorer
from torchtitan_rl.rl.tasks import GENERATED_TASKS, Problem, Task, task_from_config

_GENERATION_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # generation.dtype but "auto"


@dataclass(frozen=True)
class TaskData:
    """A GRPO run's task and its prompts, tokenized and checked."""

    task: Task
    train_prompts: list[list[int]]
    eval_prompts: list[list[int]]
    stop_token_ids: tuple[int, ...]
    env_class: type | None  # rl.env's environment, None for a single-turn task
    vision: VisionDataConfig | None = None  # how a vision-language model takes images; None: a text model
    train_images: list[PromptImages] | None = None  # per train prompt (a vision-language model only)
    eval_images: list[PromptImages] | None = None
    reward_model_args: Any = None  # rl.reward_model's model args, checked; None: no reward model


def read_task(run: RunContext) -> TaskData:
    """The task's prompts, tokenized and checked against the layout and ``training.seq_len``
    (before any collective)."""
    cfg = run.job_config
    rl, generation = cfg.rl, cfg.generation
    dims = run.parallel_dims
    per_minibatch = rl.prompts_per_step // rl.num_minibatches
    if per_minibatch % dims.batch_degree != 0:
        raise ValueError(
            f"rl.prompts_per_step={rl.prompts_per_step} / rl.num_minibatches={rl.num_minibatches} = "
            f"{per_minibatch} prompts per mini-batch is not divisible by the data-parallel degree "
            f"{dims.batch_degree} (dp_replicate * dp_shard)"
        )
    warmup = warms_up(cfg)
    if warmup:
        check_divisible_by_data_parallel("rl.sft_warmup_batch_size", rl.sft_warmup_batch_size, dims)
        if not rl.sft_warmup_only:
            check_lora_reference(cfg)
    generated = rl.task in GENERATED_TASKS
    # Rows held out for an evaluation that never runs would only be lost to training.
    task = task_from_config(rl, cfg.debug.seed, num_eval=rl.num_eval_prompts if rl.eval_interval else 0)
    if warmup and not generated and not task.spare_problems:
        # Warming up on the RL prompts' own answers would hand RL the rewards it is meant to find.
        raise ValueError(
            f"rl.sft_warmup_steps={rl.sft_warmup_steps}: the warm-up of task {rl.task!r} trains on problems outside "
            f"the RL pool and the held-out prompts (a dataset's rows left out of rl.num_train_prompts, a task "
            f"factory's spare_problems), and there are none besides the {len(task.train_problems)} RL prompts; set "
            "rl.num_train_prompts below that, or rl.sft_warmup_steps = 0"
        )
    tokenizer = run.tokenizer
    stop_ids = stop_token_ids(tokenizer, generation.stop_tokens)
    env_class = load_environment(rl.env) if rl.env else None
    if warmup and rl.sft_warmup_demonstration_steps:
        if rl.sft_warmup_demonstration_steps > rl.sft_warmup_steps:
            raise ValueError(
                f"rl.sft_warmup_demonstration_steps={rl.sft_warmup_demonstration_steps} exceeds "
                f"rl.sft_warmup_steps={rl.sft_warmup_steps}: they are the first steps of the warm-up"
            )
        if getattr(env_class, "demonstration", None) is None:
            raise ValueError(
                f"rl.sft_warmup_demonstration_steps={rl.sft_warmup_demonstration_steps}: "
                + (f"rl.env = {rl.env!r} has no demonstration(problem)" if rl.env else "no rl.env to demonstrate")
                + " to train on; set it to 0"
            )
    model_args = model_args_from_config(cfg, run.device, tokenizer)
    vision = vision_data_config(cfg, model_args)
    reward_model = reward_model_args(rl.reward_model, tokenizer, model_args.attn_backend) if rl.reward_model else None
    planner = RowPlanner(tokenizer, vision) if vision is not None else None

    def prompt_of(index: int, problem: Problem) -> tuple[list[int], PromptImages]:
        # An environment opens its episodes with messages of its own (e.g. its tools' manual).
        messages = list(problem.messages) if env_class is None else first_messages(env_class, rl.env, problem)
        try:
            tokenized = tokenize_prompt_row(messages, tokenizer)
        except ValueError as err:
            raise ValueError(f"{problem.source}: {err}") from err
        if planner is None:
            if tokenized.images:
                raise ValueError(
                    f"{problem.source}: the prompt has {len(tokenized.images)} image(s), but model.name = "
                    f"{cfg.model.name!r} is a text model; train a vision-language model (model.name = 'vlm')"
                )
            return tokenized.tokens, ()
        # Image sizes come from the headers alone: an unreadable image fails here, naming its row.
        planned = planner.plan_tokenized(tokenized, index, problem.source)
        if planned.images and env_class is not None:
            raise ValueError(f"{problem.source}: rl.env = {rl.env!r} runs multi-turn episodes of text prompts only")
        images = tuple(dataclasses.replace(i, where=f"{problem.source} {i.where}") for i in planned.images)
        return planned.tokens, images

    train = [prompt_of(i, p) for i, p in enumerate(task.train_problems)]
    evaluation = [prompt_of(i, p) for i, p in enumerate(task.eval_problems)]
    problems = [*task.train_problems, *task.eval_problems]
    for problem, (prompt, _) in zip(problems, [*train, *evaluation]):
        if len(prompt) - 1 + generation.max_new_tokens > cfg.training.seq_len:
            raise ValueError(
                f"{problem.source}: a prompt of {len(prompt)} tokens plus generation.max_new_tokens="
                f"{generation.max_new_tokens} does not fit training.seq_len={cfg.training.seq_len}"
            )
    images = ([i for _, i in train], [i for _, i in evaluation]) if vision is not None else (None, None)
    return TaskData(
        task, [t for t, _ in train], [t for t, _ in evaluation], stop_ids, env_class, vision, *images, reward_model
    )


def warms_up(job_config: JobConfig) -> bool:
    """Whether a run that does not resume starts with the SFT warm-up: when it has steps and the
    run starts from scratch, or it is the warm-up alone (which may start from initial weights)."""
    rl = job_config.rl
    return bool(rl.sft_warmup_steps) and (not job_config.checkpoint.initial_load_path or rl.sft_warmup_only)


def check_lora_reference(job_config: JobConfig) -> None:
    """With LoRA the reference policy is the policy's own model with its adapters skipped: the
    base. That is the policy RL starts from only while the adapters add nothing; an SFT warm-up
    trains them, and the KL term would then pull RL back towards the model before the warm-up.
    Call when the run warms up."""
    cfg = job_config
    if cfg.lora.enable and cfg.rl.use_reference:
        raise ValueError(
            f"rl.sft_warmup_steps={cfg.rl.sft_warmup_steps} with lora.enable and rl.use_reference: the warm-up "
            "trains the adapters, and the KL reference (the base, adapters off) would not be the policy RL starts "
            "from. Warm up in a run of its own (rl.sft_warmup_only) and start from its merged export "
            "(checkpoint.initial_load_path), "
            "or set rl.sft_warmup_steps = 0, or loss.kl_coef = 0 and rl.use_reference = false"
        )


def first_messages(env_class: type, env_name: str, problem: Problem) -> list[dict]:
    """``env_class(problem).reset()``; what it raises becomes a ``UserCodeError``, what it
    returns other than a list a ValueError, both naming the environment and the problem."""
    with calling_user_code(f"rl.env = {env_name!r} on {problem.source}: reset()"):
        messages = env_class(problem).reset()
    if not isinstance(messages, list):
        raise ValueError(
            f"rl.env = {env_name!r} on {problem.source}: reset() returned {type(messages).__name__}, not a list of "
            "messages"
        )
    return messages


def build_generator(
    job_config: JobConfig, model_args, device: torch.device, vision: VisionDataConfig | None = None
) -> TorchGenerator:
    """An unsharded replica of the policy for sampling (with LoRA: of its merged weights);
    ``vision``: how it reads a vision-language model's prompt images."""
    generation = job_config.generation
    return TorchGenerator(
        model_args,
        device,
        generation_dtype(job_config, device),
        generation.max_prompts_per_batch,
        lora=lora_settings(job_config),
        vision=vision,
        freeze_vision=job_config.model.freeze_vision,
        compile=generation.compile,
        record_routing=routing_record_mode(job_config),
    )


def routing_record_mode(job_config: JobConfig) -> str:
    """What the generator records of a MoE policy's routing for ``moe.router_replay``: nothing,
    the positions from the last prompt token on, or every position."""
    moe = job_config.moe
    if moe.router_replay == "off":
        return "off"
    return "all" if moe.router_replay_prompt else "completion"


def build_reward_model(job_config: JobConfig, data: TaskData, device: torch.device) -> RewardModelScorer | None:
    """The replica of ``rl.reward_model`` that scores the rollouts made on this rank, in
    ``generation.dtype``; None without one."""
    if data.reward_model_args is None:
        return None
    training = job_config.training
    args, path = data.reward_model_args, job_config.rl.reward_model
    model = load_reward_model(args, path, device, generation_dtype(job_config, device))
    return RewardModelScorer(model, training.max_tokens_per_microbatch or training.seq_len)


def generation_dtype(job_config: JobConfig, device: torch.device) -> torch.dtype:
    """``generation.dtype`` on ``device``: "auto" is the trainer's compute dtype there."""
    name = job_config.generation.dtype
    return compute_dtype(job_config, device) if name == "auto" else _GENERATION_DTYPES[name]


def sampling_params(job_config: JobConfig, stop_token_ids: tuple[int, ...]) -> SamplingParams:
    g = job_config.generation
    return SamplingParams(g.max_new_tokens, g.temperature, g.top_k, g.top_p, stop_token_ids)
