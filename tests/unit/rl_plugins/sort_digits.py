"""A task of one's own: sort three digits. ``rl.task = "sort_digits:make_task"`` makes the
problems; its reward gives 1 for the sorted digits and 0.2 for using exactly the prompt's digits."""

import random
from types import SimpleNamespace

from torchtitan_rl.rl.tasks import Problem


def make_task(seed: int, num_eval_prompts: int):
    """64 problems to train on, the held-out ones, and the rest for the SFT warm-up."""
    rng = random.Random(seed)
    digits = rng.sample([f"{n:03d}" for n in range(1000)], 600)  # distinct prompts
    problems = [
        Problem(
            messages=({"role": "user", "content": f"Sort {d}"},),
            answer="".join(sorted(d)),
            source=f"sort_digits #{i}",
            extra={"digits": d},  # what the reward reads besides the answer
        )
        for i, d in enumerate(digits)
    ]
    held_out = 64 + num_eval_prompts
    return SimpleNamespace(
        train_problems=problems[:64],
        eval_problems=problems[64:held_out],
        spare_problems=problems[held_out:],
        reward=sorted_digits_reward,
    )


def sorted_digits_reward(problem, completion, stopped):
    """The reward is the sum of the components; each is logged as rl/reward_<name>."""
    answer = completion.strip()
    return {
        "correct": answer == problem.answer,
        "same_digits": 0.2 * (sorted(answer) == sorted(problem.extra["digits"])),
    }
