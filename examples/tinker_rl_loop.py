"""An RL loop written against the tinker SDK alone: sample -> reward -> importance_sampling
forward_backward -> optim_step, on the built-in arithmetic task, driving a running service.

    # 1. a warmed-up debug model (the GRPO recipe's SFT warm-up, saved as step-0):
    python train.py --job.config_file train_configs/debug_grpo.toml --rl.sft_warmup_only true \
        --checkpoint.enable true --job.dump_folder outputs/warmup
    # 2. the service on 2 CPU ranks, serving it:
    torchrun --nproc_per_node=2 train.py --job.config_file train_configs/service_debug.toml \
        --checkpoint.initial_load_path outputs/warmup/checkpoint/step-0
    # 3. this loop:
    TINKER_API_KEY=tml-local TINKER_TELEMETRY=0 python examples/tinker_rl_loop.py --base-url http://127.0.0.1:8000

Each step samples ``--group-size`` completions of ``--prompts-per-step`` prompts from the current
weights, rewards them with the task's verifier, and trains on group-centred advantages. Tinker's
losses are plain sums, so the loop normalizes itself: each token's advantage is divided by the
step's number of completion tokens (a token mean). Prompts and rewards come from this
repository's task (``torchtitan_rl.rl.tasks``); everything that trains goes through the SDK.
"""

import argparse
import json
import random

import tinker
from tinker import types

from torchtitan_rl.data.chat import tokenize_prompt_row
from torchtitan_rl.data.tokenizer import build_tokenizer, stop_token_ids
from torchtitan_rl.rl.tasks import build_task


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--base-model", default="Qwen/Qwen3-8B")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--num-prompts", type=int, default=8, help="the task's training pool")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--metrics", default="", help="append one JSON line per step to this file")
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    tokenizer = build_tokenizer("")  # the service's debug model's tokenizer
    stop = list(stop_token_ids(tokenizer, ["<|im_end|>", "<|endoftext|>"]))
    task = build_task("arithmetic", num_train=args.num_prompts, num_eval=0, seed=args.seed)
    prompts = [tokenize_prompt_row(list(p.messages), tokenizer).tokens for p in task.train_problems]
    rng = random.Random(args.seed)

    client = tinker.ServiceClient(base_url=args.base_url)
    trainer = client.create_lora_training_client(
        base_model=args.base_model, rank=args.lora_rank, seed=args.seed
    ).result()
    history = []
    for step in range(args.steps):
        sampler = trainer.save_weights_and_get_sampling_client().result()
        chosen = [rng.randrange(len(prompts)) for _ in range(args.prompts_per_step)]
        # A seed per request: the requests run in whatever order they reach the service.
        futures = [
            sampler.sample(
                types.ModelInput.from_ints(prompts[i]),
                num_samples=args.group_size,
                sampling_params=types.SamplingParams(
                    max_tokens=args.max_tokens, stop=stop, temperature=1.0, seed=(args.seed * 1009 + step) * 1009 + k
                ),
            )
            for k, i in enumerate(chosen)
        ]
        groups, rewards = [], []
        for i, future in zip(chosen, futures):
            sequences = future.result().sequences
            scores = []
            for seq in sequences:
                # Ids past the tokenizer's vocabulary (the model has more embeddings) have no text.
                text = tokenizer.decode([t for t in seq.tokens if t not in stop and t < tokenizer.vocab_size])
                scores.append(task.reward(task.train_problems[i], text, seq.stop_reason == "stop").total)
            groups.append((prompts[i], sequences, scores))
            rewards.extend(scores)
        num_tokens = sum(len(seq.tokens) for _, sequences, _ in groups for seq in sequences)
        data = []
        for prompt, sequences, scores in groups:
            mean = sum(scores) / len(scores)
            for seq, score in zip(sequences, scores):
                if score == mean or not seq.tokens:
                    continue  # no signal (a group where every sample scored alike)
                tokens = prompt + list(seq.tokens)
                num_prompt = len(prompt) - 1  # positions that predict prompt tokens
                advantage = (score - mean) / num_tokens
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": tokens[1:],
                            "logprobs": [0.0] * num_prompt + list(seq.logprobs),
                            "advantages": [0.0] * num_prompt + [advantage] * len(seq.tokens),
                        },
                    )
                )
        if data:
            trainer.forward_backward(data, "importance_sampling").result()
            trainer.optim_step(types.AdamParams(learning_rate=args.lr)).result()
        record = {"step": step, "reward_mean": sum(rewards) / len(rewards), "num_datums": len(data)}
        history.append(record)
        print(json.dumps(record), flush=True)
        if args.metrics:
            with open(args.metrics, "a") as f:
                f.write(json.dumps(record) + "\n")
    return history


if __name__ == "__main__":
    main()
