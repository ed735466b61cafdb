"""Reward models (a Qwen3 with a scalar score head): against transformers'
``Qwen3ForSequenceClassification`` (export, import, a language model's checkpoint as the start)
and the score engine against the plain model, brute force."""

import dataclasses
import json
import os

import pytest
import torch
from transformers import AutoModelForSequenceClassification, Qwen3ForSequenceClassification

from torchtitan_rl.data.sample import Sample
from torchtitan_rl.data.tokenizer import build_tokenizer
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import EngineOptions
from torchtitan_rl.engine_scores import ScoreEngine, score_positions
from torchtitan_rl.hf_checkpoint import load_hf_weights, read_hf_model_args, save_hf_checkpoint
from torchtitan_rl.hf_tokenizer_files import ExportTokenizer
from torchtitan_rl.losses.reward_model import RewardModelLoss
from torchtitan_rl.models.qwen3.args import as_reward_model
from torchtitan_rl.models.qwen3.model import Qwen3Model
from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
from torchtitan_rl.recipes.base import build_model
from torchtitan_rl.recipes.reward_model import reward_model_step
from unit.test_hf_checkpoint import empty_model, hf_model, save_hf
from unit.test_qwen3_model import hf_config, pack, random_tokens, small_args

# The byte tokenizer's ids (its pad id is 256) must be embeddings of the model HF builds.
ARGS = as_reward_model(dataclasses.replace(small_args(tie_embeddings=False), vocab_size=264))
LENGTHS = [6, 1, 9, 4, 7]


def sequences(seed: int = 0) -> list[torch.Tensor]:
    # Below the pad id: transformers finds each row's last token as the last one that is not pad.
    return [random_tokens(n, 200, seed + i) for i, n in enumerate(LENGTHS)]


def random_reward_model(seed: int = 0) -> Qwen3Model:
    torch.manual_seed(seed)
    model = Qwen3Model(ARGS)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Norms randomized too, so a misplaced norm weight would show.
            param.uniform_(0.5, 1.5) if name.endswith("norm.weight") else param.normal_(0, 0.05)
    return model


def our_scores(model: Qwen3Model, seqs: list[torch.Tensor]) -> torch.Tensor:
    """Brute force: each sequence alone through the plain model, the score at its last token."""
    return torch.stack([model.score(model(*pack([s])))[-1, 0] for s in seqs])


def hf_scores(hf, seqs: list[torch.Tensor]) -> torch.Tensor:
    """transformers' scores of the sequences as one right-padded batch."""
    pad = hf.config.pad_token_id
    batch = torch.full((len(seqs), max(map(len, seqs))), pad)
    mask = torch.zeros_like(batch)
    for i, s in enumerate(seqs):
        batch[i, : len(s)], mask[i, : len(s)] = s, 1
    return hf(input_ids=batch, attention_mask=mask).logits[:, 0]


def test_export_loads_in_transformers_as_a_sequence_classifier_with_our_scores(tmp_path):
    model = random_reward_model()
    out = str(tmp_path / "rm")
    tokenizer = ExportTokenizer.for_run(build_tokenizer(""), "", ["<|im_end|>"])
    save_hf_checkpoint(model, out, torch.float32, tokenizer)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["Qwen3ForSequenceClassification"]
    assert config["pad_token_id"] == 256
    hf = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert type(hf) is Qwen3ForSequenceClassification and hf.config.num_labels == 1
    with torch.no_grad():
        torch.testing.assert_close(hf_scores(hf, sequences()), our_scores(model, sequences()), rtol=1e-5, atol=1e-5)
    assert read_hf_model_args(out) == ARGS  # and it imports as the same architecture


def test_import_of_a_transformers_sequence_classifier(tmp_path):
    config = hf_config(ARGS)
    config.num_labels, config.pad_token_id = 1, 256
    torch.manual_seed(1)
    hf = Qwen3ForSequenceClassification(config).eval()
    with torch.no_grad():
        hf.score.weight.normal_(0, 1.0)
    hf.save_pretrained(tmp_path / "hf")
    args = read_hf_model_args(str(tmp_path / "hf"))
    assert args.score_head and not args.tie_embeddings
    model = empty_model(args)
    load_hf_weights(model, str(tmp_path / "hf"))
    with torch.no_grad():
        torch.testing.assert_close(our_scores(model, sequences(3)), hf_scores(hf, sequences(3)), rtol=1e-5, atol=1e-5)


def test_two_label_classifier_is_refused(tmp_path):
    config = hf_config(ARGS)
    config.num_labels, config.pad_token_id = 2, 256
    Qwen3ForSequenceClassification(config).save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="2 labels; only one-label"):
        read_hf_model_args(str(tmp_path / "hf"))


@pytest.mark.parametrize("tie", [False, True])
def test_reward_model_starts_from_a_language_models_body_with_its_own_head(tmp_path, tie):
    path = save_hf(hf_model(tie), tmp_path / "lm", sharded=False)
    language_model = empty_model(read_hf_model_args(path))
    load_hf_weights(language_model, path)
    reward_model = empty_model(as_reward_model(read_hf_model_args(path)))
    with torch.no_grad():
        reward_model.score.weight.fill_(0.25)
    load_hf_weights(reward_model, path)
    assert torch.equal(reward_model.score.weight, torch.full((1, reward_model.args.dim), 0.25))
    tokens = pack([random_tokens(n, 96, i) for i, n in enumerate(LENGTHS)])
    with torch.no_grad():
        assert torch.equal(reward_model(*tokens), language_model(*tokens))


def test_score_positions_are_each_sequences_last_real_token():
    # Two sequences (3 and 2 tokens), then a padding pseudo-sequence; and a share whose
    # padding continues its sequence's positions past the end.
    positions, seq_ids = torch.tensor([0, 1, 2, 0, 1, 0, 1]), torch.tensor([0, 0, 0, 1, 1, 2, 2])
    assert score_positions([3, 2], positions, seq_ids).tolist() == [0, 0, 1, 0, 1, 0, 0]
    assert score_positions([3], torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0])).tolist() == [0, 1, 0]


def score_engine(max_tokens: int) -> ScoreEngine:
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes("cpu")
    model = build_model(ARGS, parallel_dims=dims, device=torch.device("cpu"), seed=0, param_dtype=torch.float32)
    optimizer = build_optimizer(model, 1e-3, 0.9, 0.95, 1e-8, 0.0)
    options = EngineOptions(
        reduction="sum",
        horizon=16,
        max_tokens_per_microbatch=max_tokens,
        logits_chunk_size=4,
        max_norm=0.0,
        # Several micro-batches packed costliest first: the samples' order is not the packing's.
        balance_microbatches=max_tokens > 0,
    )
    scheduler = build_lr_scheduler(optimizer, 10, 0, "linear", 0.1)
    return ScoreEngine(
        model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        parallel_dims=dims,
        device=torch.device("cpu"),
        options=options,
    )


def as_samples(seqs: list[torch.Tensor]) -> list[Sample]:
    return [Sample(input_ids=s, labels=s, loss_mask=torch.ones(len(s), dtype=torch.bool)) for s in seqs]


@pytest.mark.parametrize("max_tokens", [0, 12], ids=["one-microbatch", "several-microbatches"])
def test_score_engine_equals_the_plain_model(max_tokens):
    """Scores in the samples' order and the gradient of Σ c_i s_i, packed into micro-batches,
    equal each sequence alone through the plain model."""
    engine = score_engine(max_tokens)
    seqs = sequences(5)
    scores = engine.scores(as_samples(seqs))
    plain = Qwen3Model(ARGS)
    plain.load_state_dict(engine.model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(scores, our_scores(plain, seqs).double(), rtol=1e-6, atol=1e-6)
    coefficients = torch.tensor([0.5, -1.0, 2.0, 0.0, -0.25], dtype=torch.float64)
    engine.score_backward(as_samples(seqs), coefficients)
    (our_scores(plain, seqs) * coefficients.float()).sum().backward()
    for (name, param), (_, reference) in zip(engine.model.named_parameters(), plain.named_parameters(), strict=True):
        # float32 sums in another order (packed vs alone): within 1e-5 of the gradient's scale.
        scale = float(reference.grad.abs().max())
        torch.testing.assert_close(param.grad, reference.grad, rtol=0, atol=1e-5 * scale, msg=lambda m: f"{name}: {m}")
        assert scale > 0, name  # every parameter, the score head included, gets a gradient


# Per pair: no margin (0), a margin larger than the untrained scores' gaps, a negative one.
MARGINS = (0.0, 2.5, -1.5)


@pytest.mark.parametrize("margins", [(0.0, 0.0, 0.0), MARGINS], ids=["no-margins", "margins"])
def test_reward_model_step_equals_a_float64_reference(margins):
    """The Bradley–Terry loss with centering (and each pair's margin), its metrics and its
    gradient, from the step on pairs spread over micro-batches in shuffled order, equal the
    loss of every pair's whole texts through a float64 copy of the model, differentiated by
    autograd."""
    engine = score_engine(max_tokens=14)
    loss = RewardModelLoss(center_coef=0.3)
    seqs = [random_tokens(n, 200, 40 + i) for i, n in enumerate([5, 8, 3, 6, 9, 4])]
    # Pair k: chosen seqs[2k], rejected seqs[2k + 1]; the samples come rejected-first and interleaved.
    samples = []
    for i in (3, 0, 5, 2, 1, 4):
        # A training sample's inputs lack the text's last token, which is only a label.
        sample = Sample(
            input_ids=seqs[i][:-1], labels=seqs[i][1:], loss_mask=torch.ones(len(seqs[i]) - 1, dtype=torch.bool)
        )
        sample.group_id, sample.preferred, sample.margin = i // 2, i % 2 == 0, margins[i // 2]
        samples.append(sample)
    fb, values = reward_model_step(engine, samples, loss, num_pairs=3)
    reference = Qwen3Model(ARGS).double()
    reference.load_state_dict(engine.model.state_dict())
    scores = torch.stack([reference.score(reference(*pack([s])))[-1, 0] for s in seqs])
    chosen, rejected = scores[0::2], scores[1::2]
    pairs = torch.stack(
        [
            -torch.nn.functional.logsigmoid(chosen[k] - rejected[k] - m) + 0.3 * (chosen[k] + rejected[k]) ** 2
            for k, m in enumerate(margins)
        ]
    )
    value = pairs.mean()
    value.backward()
    assert values["loss_metrics/global_avg_loss"] == pytest.approx(float(value.detach()), rel=1e-5)
    assert values["loss_metrics/global_max_loss"] == pytest.approx(float(pairs.max().detach()), rel=1e-5)
    assert values["rm/accuracy"] == float((chosen > rejected).double().mean())
    assert values["rm/margin"] == pytest.approx(float((chosen - rejected).mean()), rel=1e-5, abs=1e-6)
    for (name, param), (_, ref) in zip(engine.model.named_parameters(), reference.named_parameters(), strict=True):
        scale = float(ref.grad.abs().max())
        torch.testing.assert_close(
            param.grad.double(), ref.grad, rtol=0, atol=1e-4 * scale, msg=lambda m: f"{name}: {m}"
        )
