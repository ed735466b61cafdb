"""The ``guess_number`` environment: find a secret number from "higher" / "lower" feedback.

The problem's answer is the secret. Each turn the policy says a number; the environment answers
``higher`` or ``lower`` (a ``user`` message) until it is found. Reward: 1 for finding it in the
first turn, ``penalty`` less for every further turn, at least 0; a turn that is not a number
ends the episode with 0.
"""

from torchtitan_rl.data.questions import GUESS_LARGEST as LARGEST
from torchtitan_rl.rl.envs.base import EnvStep
from torchtitan_rl.rl.tasks.task import Problem


class GuessNumberEnv:
    def __init__(self, problem: Problem, penalty: float = 0.2):
        self.problem, self.penalty = problem, penalty
        self.secret = int(problem.answer)
        self.num_turns = 0

    def reset(self) -> list[dict]:
        return [dict(m) for m in self.problem.messages]

    @staticmethod
    def demonstration(problem: Problem) -> list[dict]:
        """Bisection turns that find the secret (for an SFT warm-up)."""
        secret, low, high, turns = int(problem.answer), 1, LARGEST, []
        while True:
            guess = (low + high) // 2
            turns.append({"role": "assistant", "content": str(guess)})
            if guess == secret:
                return turns
            turns.append({"role": "user", "content": "higher" if guess < secret else "lower"})
            low, high = (guess + 1, high) if guess < secret else (low, guess - 1)

    def step(self, completion: str) -> EnvStep:
        self.num_turns += 1
        try:
            guess = int(completion.strip())
        except ValueError:
            return EnvStep(None, 0.0, True)
        if guess == self.secret:
            return EnvStep(None, max(0.0, 1.0 - self.penalty * (self.num_turns - 1)), True, True)
        hint = "higher" if guess < self.secret else "lower"
        return EnvStep([{"role": "user", "content": hint}], 0.0, False)
