"""GRPO rollouts under TP / CP: the peers of a data-parallel rank split the generation work and
all end with the same rollouts; data-parallel ranks hold disjoint prompts that together are the
step; and every rollout equals what one process generates (the layout changes nothing)."""

import pytest
import torch

import layout_cases as lc
import rl_cases
from generator_cases import prompts
from reference import one_thread
from torchtitan_rl.models.qwen3.model import Qwen3Model
from torchtitan_rl.rl.generator import TorchGenerator


def single_process_rollouts() -> dict:
    model = Qwen3Model(lc.model_args(False))
    model.init_weights(lc.SEED)  # what build_model gives every layout (test_layout_invariance checks)
    generator = TorchGenerator(lc.model_args(False), torch.device("cpu"), max_prompts_per_batch=1)
    generator.update_weights(model)
    step_prompts = prompts()
    with one_thread():  # the ranks' float kernels: bitwise equality is the claim
        rollouts = generator.generate(
            step_prompts,
            list(range(len(step_prompts))),
            rl_cases.NUM_SAMPLES,
            rl_cases.PARAMS,
            rl_cases.SEED,
            rl_cases.STEP,
        )
    return {(p, s): (tokens, logprobs) for p, s, tokens, logprobs in rl_cases.summary(rollouts)}


@pytest.mark.parametrize("layout", rl_cases.EXCHANGE_LAYOUTS)
def test_peers_share_identical_rollouts_and_data_parallel_ranks_disjoint_ones(layout_results, layout):
    world = layout[0] * layout[1] * layout[2] * layout[3]
    ranks = layout_results[world][rl_cases.layout_key(*layout)]
    reference = single_process_rollouts()
    by_batch_rank: dict[int, list[dict]] = {}
    for rank in ranks:
        by_batch_rank.setdefault(rank["batch_rank"], []).append(rank)
    assert len(by_batch_rank) == layout[0] * layout[1]
    seen = []
    for batch_rank, peers in by_batch_rank.items():
        assert len(peers) == layout[2] * layout[3]
        whole = peers[0]["all"]
        # Every peer ends with the same rollouts: its rank's slots x samples, in slot order ...
        assert all(p["all"] == whole for p in peers)
        assert [(p, s) for p, s, *_ in whole] == [
            (slot, s) for slot in peers[0]["slots"] for s in range(rl_cases.NUM_SAMPLES)
        ]
        # ... of which it generated its own, non-empty, disjoint part.
        parts = [p["local"] for p in peers]
        assert all(parts) and [r for part in parts for r in part] == whole
        seen += [(p, s) for p, s, *_ in whole]
        for p, s, tokens, logprobs in whole:
            assert (tokens, logprobs) == reference[(p, s)], (batch_rank, p, s)
    assert sorted(seen) == sorted(reference)  # data-parallel ranks: disjoint, the whole step
