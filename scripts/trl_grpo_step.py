"""Wall time of one GRPO optimizer step of TRL's ``GRPOTrainer`` on the embedded GRPO recipe's
model and task: the reference the recipe's own RL step time is compared with.

The task, its prompts and its reward come from this repository's code, read from the recipe's
config (``train_configs/debug_grpo.toml`` by default): the same train problems, the same chat
prompt token ids (checked against ``data.chat.tokenize_prompt_row`` before training), and the
reward the recipe gives a completion (decoded with the run's tokenizer, without its stop token).
TRL then trains the model of ``--model`` (an HF export of the warmed-up recipe model) on one
process, on CPU in float32, without vLLM: one optimizer step generates ``group_size`` completions
for each of ``prompts_per_step`` prompts with ``model.generate``, scores them, and takes one
PPO-clip update (``num_iterations=1``, DAPO's global token mean, no KL term, so no reference
model). A ``TrainerCallback`` reads the wall clock at ``on_step_begin`` and ``on_step_end``;
the interval holds generation, rewards, advantages, forward, backward, clipping and the
optimizer step, and leaves out TRL's logging after the step.

    HF_HUB_OFFLINE=1 /path/to/trl/venv/bin/python scripts/trl_grpo_step.py \\
        --model outputs/debug_grpo/checkpoint/step-0 --steps 10 --json trl.json

Needs trl, transformers, accelerate, datasets and pillow next to torch; imports
``torchtitan_rl`` from this checkout.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from torchtitan_rl.config import ConfigManager  # noqa: E402
from torchtitan_rl.data.chat import tokenize_prompt_row  # noqa: E402
from torchtitan_rl.data.tokenizer import build_tokenizer, stop_token_ids  # noqa: E402
from torchtitan_rl.rl.env_rollouts import decode_completion  # noqa: E402
from torchtitan_rl.rl.length_shaping import shape_overlong  # noqa: E402
from torchtitan_rl.rl.tasks import task_from_config  # noqa: E402


class StepClock(TrainerCallback):
    """Seconds from each optimizer step's ``on_step_begin`` to its ``on_step_end``."""

    def __init__(self):
        self.seconds: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._start)


def check_mirrored(cfg) -> None:
    """ValueError for a recipe setting this script does not reproduce in TRL."""
    rl, loss = cfg.rl, cfg.loss
    unsupported = {
        "loss.loss_fn": (loss.loss_fn, "ppo"),
        "loss.reduction": (loss.reduction, "token_mean"),
        "loss.kl_coef": (loss.kl_coef, 0.0),
        "rl.ppo_epochs": (rl.ppo_epochs, 1),
        "rl.num_minibatches": (rl.num_minibatches, 1),
        "rl.max_staleness": (rl.max_staleness, 0),
        "rl.env": (rl.env, ""),
        "rl.dynamic_sampling": (rl.dynamic_sampling, False),
        "lr_scheduler.min_lr_factor": (cfg.lr_scheduler.min_lr_factor, 1.0),
        "lr_scheduler.warmup_steps": (cfg.lr_scheduler.warmup_steps, 0),
    }
    for key, (value, mirrored) in unsupported.items():
        if value != mirrored:
            raise ValueError(f"{key} = {value!r}: this script only mirrors {key} = {mirrored!r} in TRL")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF export folder of the warmed-up recipe model")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps to time")
    parser.add_argument("--json", required=True, help="where to write the step times and rewards")
    parser.add_argument("--config", default=os.path.join(REPO, "train_configs/debug_grpo.toml"))
    parser.add_argument("--micro-batch", type=int, default=0, help="sequences per forward; 0: the whole step")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the recipe benchmarks use 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    cfg = ConfigManager().parse_args(["--job.config_file", args.config])
    check_mirrored(cfg)
    rl, generation = cfg.rl, cfg.generation
    if rl.advantage not in ("grpo", "dr_grpo"):
        raise ValueError(f"rl.advantage = {rl.advantage!r}: TRL has the group-normalized advantages grpo and dr_grpo")
    task = task_from_config(rl, cfg.debug.seed, num_eval=0)  # the train pool does not depend on the eval pool
    problems = list(task.train_problems)
    run_tokenizer = build_tokenizer(cfg.model.hf_assets_path)
    stop_ids = set(stop_token_ids(run_tokenizer, generation.stop_tokens))
    hf_tokenizer = AutoTokenizer.from_pretrained(args.model)
    for problem in problems:
        messages = [dict(m) for m in problem.messages]
        ours = tokenize_prompt_row(messages, run_tokenizer).tokens
        theirs = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        if list(theirs["input_ids"]) != ours:
            raise RuntimeError(f"{problem.source}: the export's chat template gives other prompt ids than the recipe")

    step_rewards: list[float] = []

    def recipe_reward(prompts, completions, completion_ids, problem_index, **kwargs) -> list[float]:
        rewards = []
        for ids, index in zip(completion_ids, problem_index, strict=True):
            stopped = bool(ids) and ids[-1] in stop_ids
            text = decode_completion(run_tokenizer, list(ids[:-1] if stopped else ids))
            reward = task.reward(problems[index], text, stopped)
            if rl.overlong_buffer:
                reward = shape_overlong(
                    reward, len(ids), generation.max_new_tokens, rl.overlong_buffer, rl.overlong_penalty
                )
            rewards.append(float(reward.total))
        step_rewards.append(sum(rewards) / len(rewards))
        return rewards

    num_sequences = rl.prompts_per_step * rl.group_size
    micro_batch = args.micro_batch or num_sequences
    if num_sequences % micro_batch or micro_batch % rl.group_size:
        raise ValueError(f"--micro-batch={micro_batch} must divide {num_sequences} and be a multiple of the group size")
    settings = dict(
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=num_sequences // micro_batch,
        steps_per_generation=num_sequences // micro_batch,  # one generation batch per optimizer step
        num_generations=rl.group_size,
        num_iterations=1,
        max_completion_length=generation.max_new_tokens,
        temperature=generation.temperature,
        top_p=generation.top_p,
        top_k=generation.top_k,
        epsilon=cfg.loss.clip_low,
        epsilon_high=cfg.loss.clip_high,
        beta=0.0,
        loss_type="dapo",  # token losses summed over the step, divided by its number of completion tokens
        scale_rewards="group" if rl.advantage == "grpo" else "none",
        learning_rate=cfg.optimizer.lr,
        lr_scheduler_type="constant",
        weight_decay=cfg.optimizer.weight_decay,
        adam_beta1=cfg.optimizer.beta1,
        adam_beta2=cfg.optimizer.beta2,
        adam_epsilon=cfg.optimizer.eps,
        optim="adamw_torch_fused",
        max_grad_norm=cfg.training.max_norm,
        max_steps=args.steps,
        seed=cfg.debug.seed,
        bf16=False,
        gradient_checkpointing=False,
        use_vllm=False,
        use_cpu=True,
        remove_unused_columns=False,
        eval_strategy="no",
        save_strategy="no",
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    dataset = Dataset.from_list(
        [{"prompt": [dict(m) for m in p.messages], "problem_index": i} for i, p in enumerate(problems)]
    )
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    clock = StepClock()
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=recipe_reward,
            args=GRPOConfig(output_dir=output_dir, **settings),
            train_dataset=dataset,
            processing_class=hf_tokenizer,
            callbacks=[clock],
        )
        if set(trainer.eos_token_ids) != stop_ids:
            raise RuntimeError(f"TRL stops at ids {trainer.eos_token_ids}, the recipe at {sorted(stop_ids)}")
        trainer.train()
    if len(clock.seconds) != args.steps or len(step_rewards) != args.steps:
        raise RuntimeError(f"timed {len(clock.seconds)} steps and scored {len(step_rewards)} for --steps={args.steps}")
    result = {
        "step_seconds": clock.seconds,
        "reward_mean": step_rewards,
        "trl_version": trl.__version__,
        "settings": {**settings, "model": os.path.abspath(args.model), "config": args.config, "threads": args.threads},
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"TRL {trl.__version__}: median step {statistics.median(clock.seconds):.3f} s over {args.steps} steps")


if __name__ == "__main__":
    main()
