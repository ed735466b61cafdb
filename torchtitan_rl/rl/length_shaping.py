"""Length shaping of GRPO rewards (DAPO's overlong penalty).

With L = ``generation.max_new_tokens`` and B = ``rl.overlong_buffer``, a completion of n tokens
(its stop token included) keeps its reward up to L - B tokens and then loses
``rl.overlong_penalty * (n - (L - B)) / B``: nothing at L - B, the whole penalty at L. The
penalty is added to the reward before the group advantages, and kept as the reward component
``overlong`` (logged as ``rl/reward_overlong``, the mean penalty).
"""

import dataclasses

from torchtitan_rl.rl.tasks import Reward
from torchtitan_rl.rl.tasks.rewards import OVERLONG_COMPONENT


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """The (non-positive) reward change of a completion of ``length`` tokens; 0 when ``buffer`` is 0."""
    assert 0 <= buffer < max_new_tokens, (buffer, max_new_tokens)
    excess = length - (max_new_tokens - buffer)
    if buffer == 0 or excess <= 0:
        return 0.0
    return -penalty * excess / buffer


def shape_overlong(reward: Reward, length: int, max_new_tokens: int, buffer: int, penalty: float) -> Reward:
    """``reward`` with the overlong penalty of a completion of ``length`` tokens added to its
    total and recorded as its ``overlong`` component."""
    value = overlong_penalty(length, max_new_tokens, buffer, penalty)
    return dataclasses.replace(
        reward, total=reward.total + value, components={**reward.components, OVERLONG_COMPONENT: value}
    )


def is_penalized(reward: Reward) -> bool:
    """Whether ``shape_overlong`` took something off ``reward``."""
    return reward.components.get(OVERLONG_COMPONENT, 0.0) < 0.0
