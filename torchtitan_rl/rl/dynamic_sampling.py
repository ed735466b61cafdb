"""Dynamic sampling of GRPO prompts (DAPO): draw further rounds of prompts until a step has
``rl.prompts_per_step`` groups with signal (rewards not all equal), at most
``rl.max_sampling_rounds`` rounds.

Layout independence (docs/design.md, 'The RL step'): round r of a step takes the next
``prompts_per_step`` (P) prompts of the ``PromptStream`` (so a resumed run draws the same
ones), and every data-parallel rank generates and scores its ``rank_prompt_slots`` of them as
in a step without dynamic sampling. Slot s of round r is *candidate* ``r·P + s``, which is the
rollouts' prompt index and so, with (seed, step, sample), the key of their randomness: round 0
keys its rollouts exactly like a plain step, a later round's keys (at least P) never meet round
0's, and other steps differ in the step. One object all-gather over the ``batch`` mesh per round
gives every rank the round's groups with signal, whatever rank generated them; every rank then
derives the same selection: the first P in (round, slot) order, renumbered as slots 0..P-1, of
which each rank trains its ``rank_prompt_slots``.
"""

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_rl.rl.rollouts import ScoredGroup, is_zero_variance

logger = logging.getLogger(__name__)


@dataclass
class SignalSelection:
    groups: list[ScoredGroup]  # the groups kept for training, renumbered as slots 0..len - 1
    num_rounds: int  # rounds drawn
    num_with_signal: int  # groups with signal found over those rounds, before keeping the first P


def round_offset(round_index: int, num_prompts: int) -> int:
    """The candidate index of slot 0 of round ``round_index`` (rounds of ``num_prompts`` slots)."""
    return round_index * num_prompts


def gather_groups_with_signal(groups: list[ScoredGroup], batch_mesh: DeviceMesh | None) -> list[ScoredGroup]:
    """Every data-parallel rank's ``groups`` with signal, in slot order, on every rank.

    CP / TP peers hold identical groups: each of their ``batch`` meshes gathers the same copies.
    """
    mine = [g for g in groups if not is_zero_variance(g)]
    if batch_mesh is None:
        return mine
    gathered: list = [None] * batch_mesh.size()
    dist.all_gather_object(gathered, mine, group=batch_mesh.get_group())
    return sorted((g for part in gathered for g in part), key=lambda g: g.slot)


def select_groups_with_signal(
    draw_round: Callable[[int], list[ScoredGroup]], num_prompts: int, max_rounds: int, warn: bool
) -> SignalSelection:
    """Call ``draw_round(0)``, ``draw_round(1)``, ... (each returns a whole round's groups, of
    every rank) until ``num_prompts`` groups with signal are found or ``max_rounds`` rounds are
    drawn; keep the first ``num_prompts`` in (round, slot) order, renumbered 0..num_prompts - 1.

    A pure function of what ``draw_round`` returns. Falling short is not an error (the step
    trains the groups found, ``warn`` logs it): a policy that solves, or fails, nearly every
    prompt is a state of training, not a mistake.
    """
    assert max_rounds >= 1, max_rounds
    found: list[ScoredGroup] = []
    num_rounds = 0
    while num_rounds < max_rounds and len(found) < num_prompts:
        round_groups = sorted(draw_round(num_rounds), key=lambda g: g.slot)
        found += [g for g in round_groups if not is_zero_variance(g)]
        num_rounds += 1
    if warn and len(found) < num_prompts:
        logger.warning(
            "dynamic sampling: %d of rl.prompts_per_step=%d groups with signal after rl.max_sampling_rounds=%d "
            "rounds; training on those",
            len(found),
            num_prompts,
            max_rounds,
        )
    kept = [dataclasses.replace(group, slot=slot) for slot, group in enumerate(found[:num_prompts])]
    return SignalSelection(kept, num_rounds, len(found))
