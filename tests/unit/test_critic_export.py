"""A critic's Hugging Face form, ``Qwen3ForTokenClassification`` with one label: our export
loads in ``transformers`` with a value at every token equal to ours, a transformers token
classifier imports with its values, and a reward model's checkpoint starts a critic (the same
head, read at every token) but is never taken for one."""

import dataclasses
import json
import os

import pytest
import torch
from transformers import AutoModelForTokenClassification, Qwen3ForTokenClassification

from torchtitan_rl.data.tokenizer import ByteTokenizer
from torchtitan_rl.hf_checkpoint import load_hf_weights, read_hf_model_args, save_hf_checkpoint
from torchtitan_rl.models.qwen3.args import as_critic
from torchtitan_rl.models.qwen3.model import Qwen3Model
from torchtitan_rl.recipes.reward_model_replica import reward_model_args
from unit.test_hf_checkpoint import empty_model
from unit.test_qwen3_model import hf_config, pack
from unit.test_reward_model import ARGS, random_reward_model, sequences

CRITIC_ARGS = as_critic(ARGS)


def our_values(model, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Brute force: each sequence alone through the plain model, the head at every token."""
    return [model.score(model(*pack([s])))[:, 0] for s in seqs]


def hf_values(hf, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """transformers' per-token values of the sequences as one right-padded batch."""
    batch = torch.zeros((len(seqs), max(map(len, seqs))), dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, s in enumerate(seqs):
        batch[i, : len(s)], mask[i, : len(s)] = s, 1
    logits = hf(input_ids=batch, attention_mask=mask).logits[..., 0]
    return [logits[i, : len(s)] for i, s in enumerate(seqs)]


def random_critic() -> Qwen3Model:
    torch.manual_seed(3)
    model = Qwen3Model(CRITIC_ARGS)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Norms randomized too, and the head's bias, so a misplaced one would show.
            param.uniform_(0.5, 1.5) if name.endswith("norm.weight") else param.normal_(0, 0.05)
    return model


def test_export_loads_in_transformers_as_a_token_classifier_with_our_values(tmp_path):
    model = random_critic()
    out = str(tmp_path / "critic")
    save_hf_checkpoint(model, out, torch.float32, None)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen3ForTokenClassification"]
    hf = AutoModelForTokenClassification.from_pretrained(out).eval()
    assert type(hf) is Qwen3ForTokenClassification and hf.config.num_labels == 1
    with torch.no_grad():
        for got, want in zip(hf_values(hf, sequences()), our_values(model, sequences()), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.cat(our_values(model, sequences())).std() > 1e-3  # not vacuous
    assert read_hf_model_args(out) == CRITIC_ARGS  # and it imports as a critic


def test_import_of_a_transformers_token_classifier(tmp_path):
    config = hf_config(ARGS)
    config.num_labels = 1
    torch.manual_seed(2)
    hf = Qwen3ForTokenClassification(config).eval()
    with torch.no_grad():
        hf.score.weight.normal_(0, 1.0)
        hf.score.bias.fill_(0.7)
    hf.save_pretrained(tmp_path / "hf")
    args = read_hf_model_args(str(tmp_path / "hf"))
    assert args.score_head and args.score_per_token and not args.tie_embeddings
    model = empty_model(args)
    load_hf_weights(model, str(tmp_path / "hf"))
    with torch.no_grad():
        for got, want in zip(our_values(model, sequences(4)), hf_values(hf, sequences(4)), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_reward_models_checkpoint_starts_a_critic_but_is_not_one(tmp_path):
    reward_model = random_reward_model(5)
    out = str(tmp_path / "rm")
    save_hf_checkpoint(reward_model, out, torch.float32, None)
    critic = Qwen3Model(CRITIC_ARGS)
    critic.init_weights(0)  # as the trainer does before it loads
    load_hf_weights(critic, out)
    assert float(critic.score.bias) == 0
    with torch.no_grad():
        for seq in sequences(6):
            values = our_values(critic, [seq])[0]
            # The critic's value at the last token is the reward model's score of the sequence
            # (its bias, which the reward model has not, starts at 0).
            assert float(values[-1]) == pytest.approx(float(reward_model.score(reward_model(*pack([seq])))[-1, 0]))
    critic_dir = str(tmp_path / "critic")
    save_hf_checkpoint(random_critic(), critic_dir, torch.float32, None)
    with pytest.raises(ValueError, match="a critic .*not a reward model"):
        reward_model_args(critic_dir, ByteTokenizer(), "sdpa_dense")


def test_a_token_head_without_a_score_head_is_refused():
    with pytest.raises(ValueError, match="score_per_token reads a score head"):
        dataclasses.replace(ARGS, score_head=False, score_per_token=True)
