"""Rollout-correction weights and metrics against the formulas written out per token, in fp64."""

import math
import random

import pytest
import torch

from torchtitan_rl.data.sample import Sample
from torchtitan_rl.rl.rollout_correction import RolloutCorrection, apply_rollout_correction

MAX, MIN = 1.5, 0.7


def samples_with_mismatch(seed: int = 0) -> list[Sample]:
    """Completions whose proximal and sampler log-probs differ by up to ±0.8 nats per token
    (two sequences by ±0.05 only, one shifted up throughout), one without loss tokens."""
    rng = random.Random(seed)
    samples = []
    for i, n in enumerate((6, 9, 4, 12, 7, 5)):
        mask = torch.tensor([t >= 2 for t in range(n)]) if i != 4 else torch.zeros(n, dtype=torch.bool)
        behave = torch.tensor([-rng.uniform(0.5, 4.0) for _ in range(n)])
        spread = 0.05 if i in (0, 2) else 0.8
        shift = 0.7 if i == 3 else 0.0  # a sequence the trainer finds likelier throughout
        prox = torch.tensor([min(b + shift + rng.uniform(-spread, spread), 0.0) for b in behave.tolist()])
        samples.append(
            Sample(
                input_ids=torch.zeros(n, dtype=torch.long),
                labels=torch.zeros(n, dtype=torch.long),
                loss_mask=mask,
                sampler_logprobs=torch.where(mask, behave, 0.0),
                prox_logprobs=torch.where(mask, prox, 0.0),
            )
        )
    return samples


def expected_weights(sample: Sample, mode: str, level: str) -> list[float]:
    mask = sample.loss_mask.tolist()
    logs = [float(p) - float(b) for p, b in zip(sample.prox_logprobs.double(), sample.sampler_logprobs.double())]
    loss_logs = [x for x, m in zip(logs, mask) if m]
    if mode == "geo_mask":
        mean = sum(loss_logs) / max(len(loss_logs), 1)
        keep = MIN <= math.exp(mean) <= MAX
        return [float(m and keep) for m in mask]
    out = []
    for x, m in zip(logs, mask):
        if not m:
            out.append(0.0)
            continue
        rho = math.exp(sum(loss_logs)) if level == "sequence" else math.exp(x)
        out.append(
            {
                "none": 1.0,
                "tis": min(rho, MAX),
                "mis": rho if rho <= MAX else 0.0,
                "icepop": rho if MIN <= rho <= MAX else 0.0,
            }[mode]
        )
    return out


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["none", "tis", "mis", "icepop", "geo_mask"])
def test_weights_follow_each_formula(mode, level):
    config = RolloutCorrection(mode, level, MAX, MIN)
    weights = []
    samples = samples_with_mismatch()
    apply_rollout_correction(samples, config, None)
    for sample in samples:
        got = sample.rollout_weights
        assert got.dtype == torch.float32
        expected = expected_weights(sample, mode, level)
        assert got.tolist() == pytest.approx(expected, rel=1e-6, abs=1e-7)
        weights += [w for w, m in zip(expected, sample.loss_mask.tolist()) if m]
    if mode in ("mis", "icepop", "geo_mask"):
        assert 0 < sum(w == 0 for w in weights) < len(weights)  # masks some tokens, not all
    if mode == "tis":
        assert max(weights) == pytest.approx(MAX) and min(weights) < 1  # the cap binds


def test_metrics_are_sums_over_every_loss_token():
    samples = samples_with_mismatch(1)
    config = RolloutCorrection("icepop", "token", MAX, MIN)
    got = apply_rollout_correction(samples, config, None)
    weights, logs, seqs = [], [], []
    for sample in samples:
        mask = sample.loss_mask.tolist()
        if not any(mask):
            continue
        w = [x for x, m in zip(expected_weights(sample, "icepop", "token"), mask) if m]
        weights += w
        seqs.append(any(x == 0 for x in w))
        logs += [float(p) - float(b) for p, b, m in zip(sample.prox_logprobs, sample.sampler_logprobs, mask) if m]
        assert sample.rollout_weights.tolist() == pytest.approx(expected_weights(sample, "icepop", "token"), rel=1e-6)
    n = len(weights)
    expected = {
        "rl/rollout_corr/weight_mean": sum(weights) / n,
        "rl/rollout_corr/weight_max": max(weights),
        "rl/rollout_corr/masked_fraction_token": sum(w == 0 for w in weights) / n,
        "rl/rollout_corr/masked_fraction_seq": sum(seqs) / len(seqs),
        "rl/rollout_corr/ess": sum(weights) ** 2 / (n * sum(w * w for w in weights)),
        "rl/rollout_corr/kl_k1": sum(-x for x in logs) / n,
        "rl/rollout_corr/kl_k3": sum(math.exp(x) - 1 - x for x in logs) / n,
    }
    assert got.keys() == expected.keys()
    for tag, value in expected.items():
        assert got[tag] == pytest.approx(value, rel=1e-6), tag
    assert 0 < expected["rl/rollout_corr/masked_fraction_token"] < 1 and expected["rl/rollout_corr/kl_k3"] > 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "clip"}, "rl.rollout_correction: 'clip' is not one of"),
        ({"level": "batch"}, "rl.rollout_correction_level: 'batch'"),
        ({"min_ratio": 2.0, "max_ratio": 1.5}, "need 0 <= min < max"),
    ],
)
def test_bad_settings_name_their_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutCorrection(**kwargs)
