"""Dynamic sampling of GRPO prompts (DAPO): draw further rounds of prompts until a step has
``rl.prompts_per_step`` groups with signal (rewards not all equal), at most
``rl.max_sampling_rounds`` rounds.

Layout independence (docs/design.md, 'The RL step'): round r of a step takes the next
``prompts_per_step`` (P) prompts of the ``PromptStream`` (so a resumed run draws the same
ones), and every data-parallel rank generates and scores its ``rank_prompt_slots`` of them as
in a step without dynamic sampling. Slot s of round r is *candidate* ``r·P + s``, which is the
rollouts' prompt index and so, with (seed, step, sample), the key of their randomness: round 0
keys its rollouts exactly like a plain step, a later round's keys (at least P) never meet round
0's, and other steps differ in the step. After every round the ranks all-gather which
candidates have signal (indices only, over the ``batch`` mesh); every rank then derives the
same selection: the first P in (round, slot) order, renumbered as slots 0..P-1, of which each
rank trains its ``rank_prompt_slots``. The groups stay where they were generated until the
selection is made; then each kept group travels once, to the rank that trains its new slot.
"""

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_rl.distributed.utils import all_to_all_objects
from torchtitan_rl.rl.rollouts import ScoredGroup, is_zero_variance

logger = logging.getLogger(__name__)


@dataclass
class SignalSelection:
    candidates: list[int]  # the kept groups' candidate indices in (round, slot) order: the i-th trains as slot i
    num_rounds: int  # rounds drawn
    num_with_signal: int  # groups with signal found over those rounds, before keeping the first P


def round_offset(round_index: int, num_prompts: int) -> int:
    """The candidate index of slot 0 of round ``round_index`` (rounds of ``num_prompts`` slots)."""
    return round_index * num_prompts


def select_groups_with_signal(
    draw_round: Callable[[int], list[int]], num_prompts: int, max_rounds: int, warn: bool
) -> SignalSelection:
    """Call ``draw_round(0)``, ``draw_round(1)``, ... (each returns the candidate indices of a
    whole round's groups with signal, of every rank, in any order) until ``num_prompts`` are
    found or ``max_rounds`` rounds are drawn; keep the first ``num_prompts`` in (round, slot)
    order.

    A pure function of what ``draw_round`` returns. Falling short is not an error (the step
    trains the groups found, ``warn`` logs it): a policy that solves, or fails, nearly every
    prompt is a state of training, not a mistake.
    """
    assert max_rounds >= 1, max_rounds
    found: list[int] = []
    num_rounds = 0
    while num_rounds < max_rounds and len(found) < num_prompts:
        found += sorted(draw_round(num_rounds))
        num_rounds += 1
    if warn and len(found) < num_prompts:
        logger.warning(
            "dynamic sampling: %d of rl.prompts_per_step=%d groups with signal after rl.max_sampling_rounds=%d "
            "rounds; training on those",
            len(found),
            num_prompts,
            max_rounds,
        )
    return SignalSelection(found[:num_prompts], num_rounds, len(found))


def route_selected(
    candidates: list[int], held: dict[int, ScoredGroup], slots_by_rank: list[list[int]]
) -> list[list[ScoredGroup]]:
    """Per rank r of the ``batch`` mesh (whose slots are ``slots_by_rank[r]``), the selected
    groups among ``held`` (this rank's, by candidate index) that r trains, renumbered: the i-th
    of ``candidates`` becomes slot i."""
    trainer = {slot: rank for rank, slots in enumerate(slots_by_rank) for slot in slots}
    outgoing: list[list[ScoredGroup]] = [[] for _ in slots_by_rank]
    for slot, candidate in enumerate(candidates):
        if candidate in held:
            outgoing[trainer[slot]].append(dataclasses.replace(held[candidate], slot=slot))
    return outgoing


class SignalExchange:
    """A step's dynamic-sampling messages over the ``batch`` mesh (None: one data-parallel
    rank). ``round_with_signal`` after every round: an all-gather of the candidate indices with
    signal (and of every rank's slots); the groups stay where they were generated.
    ``trained_groups`` once the selection is made: an all-to-all that takes each kept group to
    the rank that trains its new slot, and nowhere else. CP / TP peers hold identical groups:
    each of their ``batch`` meshes exchanges the same copies."""

    def __init__(self, slots: list[int], batch_mesh: DeviceMesh | None):
        self.slots, self.batch_mesh = slots, batch_mesh
        self.held: dict[int, ScoredGroup] = {}  # this rank's groups with signal, by candidate index
        self.slots_by_rank = [slots]

    def round_with_signal(self, groups: list[ScoredGroup]) -> list[int]:
        """Keep this rank's ``groups`` with signal (a round's, of its slots) and return the
        round's candidate indices with signal of every rank. Collective over the mesh."""
        mine = {g.slot: g for g in groups if not is_zero_variance(g)}
        self.held.update(mine)
        if self.batch_mesh is None:
            return list(mine)
        gathered: list = [None] * self.batch_mesh.size()
        dist.all_gather_object(gathered, (self.slots, list(mine)), group=self.batch_mesh.get_group())
        self.slots_by_rank = [slots for slots, _ in gathered]
        return [candidate for _, candidates in gathered for candidate in candidates]

    def trained_groups(self, selection: SignalSelection) -> list[ScoredGroup]:
        """This rank's groups to train of ``selection`` (renumbered, in slot order). Collective
        over the mesh."""
        outgoing = route_selected(selection.candidates, self.held, self.slots_by_rank)
        if self.batch_mesh is None:
            return outgoing[0]
        received = all_to_all_objects(outgoing, self.batch_mesh)
        return sorted((g for groups in received for g in groups), key=lambda g: g.slot)
