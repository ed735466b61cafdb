"""Environments a user would write, loaded by import path (``rl.env = "env_plugins:Echo"``) in
test_envs.py, and broken ones whose errors must name the problem."""

from torchtitan_rl.rl.envs import EnvStep


class Echo:
    """Ends after the policy repeats the problem's answer; answers "again" otherwise."""

    def __init__(self, problem):
        self.problem = problem

    def reset(self):
        return list(self.problem.messages)

    def step(self, completion):
        if completion == self.problem.answer:
            return EnvStep(None, 1.0, True, True)
        return EnvStep([{"role": "user", "content": "again"}], 0.0, False)


class NoStep:
    def __init__(self, problem):
        self.problem = problem

    def reset(self):
        return []


class ResetRaises(Echo):
    """A bug of its own: a ValueError, which train.py shows with its traceback."""

    def reset(self):
        return [{"role": "user", "content": f"Say {int(self.problem.source)}"}]


class NeedsTwoArguments(Echo):
    def __init__(self, problem, difficulty):
        super().__init__(problem)


def not_a_class(problem):
    return Echo(problem)
