"""A reward model in the RL loop (``rl.reward_model``): its packed scores against transformers'
``Qwen3ForSequenceClassification``, the named errors of a path that is no usable reward model,
how its scores enter the reward (brute force), the config's rules, and prompt-only rows when
it rewards alone. The layouts are tests/distributed/test_reward_model_rollouts.py's."""

import dataclasses
import json
import math
import os

import pytest
import torch
from transformers import Qwen3ForSequenceClassification

from torchtitan_rl.config import ConfigManager
from torchtitan_rl.data.tokenizer import ByteTokenizer, build_tokenizer
from torchtitan_rl.hf_checkpoint import save_hf_checkpoint
from torchtitan_rl.hf_tokenizer_files import ExportTokenizer, byte_tokenizer_json
from torchtitan_rl.models.qwen3.model import Qwen3Model
from torchtitan_rl.recipes.reward_model_replica import load_reward_model, reward_model_args
from torchtitan_rl.rl.reward_model_scores import (
    RewardModelScorer,
    RewardModelSettings,
    normalized,
    with_model_scores,
)
from torchtitan_rl.rl.tasks import Reward, build_task
from unit.test_reward_model import ARGS, hf_scores, random_reward_model, sequences

BYTES = ByteTokenizer()


def export(model: Qwen3Model, path, with_tokenizer: bool = True) -> str:
    tokenizer = ExportTokenizer.for_run(build_tokenizer(""), "", ["<|im_end|>"]) if with_tokenizer else None
    save_hf_checkpoint(model, str(path), torch.float32, tokenizer)
    return str(path)


@pytest.mark.parametrize("max_tokens", [12, 1000], ids=["several-batches", "one-batch"])
def test_scores_equal_transformers_sequence_classifier(tmp_path, max_tokens):
    path = export(random_reward_model(4), tmp_path / "rm")
    args = reward_model_args(path, BYTES, "sdpa_dense")
    assert args == ARGS
    scorer = RewardModelScorer(load_reward_model(args, path, torch.device("cpu"), torch.float32), max_tokens)
    seqs = sequences(5)
    hf = Qwen3ForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        want = hf_scores(hf, seqs)
    got = torch.tensor(scorer.score([s.tolist() for s in seqs]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert want.std() > 1e-3  # not vacuous


def test_paths_that_are_no_reward_model_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"rl.reward_model = '.*missing': no such directory"):
        reward_model_args(str(tmp_path / "missing"), BYTES, "sdpa_dense")
    (tmp_path / "step-10").mkdir()  # a checkpoint folder of ours, not a Hugging Face directory
    with pytest.raises(ValueError, match=r"step-10'.*no config.json.*checkpoint.last_save_in_hf"):
        reward_model_args(str(tmp_path / "step-10"), BYTES, "sdpa_dense")
    language_model = Qwen3Model(dataclasses.replace(ARGS, score_head=False))
    path = export(language_model, tmp_path / "lm")
    with pytest.raises(ValueError, match="a language model, not a reward model"):
        reward_model_args(path, BYTES, "sdpa_dense")


def test_reward_models_of_another_vocabulary_are_named(tmp_path):
    path = export(random_reward_model(), tmp_path / "no_tokenizer", with_tokenizer=False)
    with pytest.raises(ValueError, match="no tokenizer.json to check"):
        reward_model_args(path, BYTES, "sdpa_dense")
    # The same byte tokenizer with one more special token: every id the policy uses still
    # exists, but the tokenizer is not the policy's.
    path = export(random_reward_model(), tmp_path / "other")
    other = byte_tokenizer_json()
    other.add_special_tokens(["<|extra|>"])
    other.save(os.path.join(path, "tokenizer.json"))
    with pytest.raises(ValueError, match=r"1 tokens differ, e.g. '<\|extra\|>' is id 262 there and None here"):
        reward_model_args(path, BYTES, "sdpa_dense")
    # Two tokens swapped.
    vocab = byte_tokenizer_json().get_vocab(with_added_tokens=True)
    spec = json.loads(byte_tokenizer_json().to_str())
    a, b = spec["model"]["vocab"]["a"], spec["model"]["vocab"]["b"]
    spec["model"]["vocab"]["a"], spec["model"]["vocab"]["b"] = b, a
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(spec, f)
    with pytest.raises(ValueError, match=rf"2 tokens differ, e.g. 'a' is id {vocab['b']} there and {vocab['a']} here"):
        reward_model_args(path, BYTES, "sdpa_dense")
    # An embedding too small for the tokenizer's ids.
    small = Qwen3Model(dataclasses.replace(ARGS, vocab_size=200))
    path = export(small, tmp_path / "small")
    with pytest.raises(ValueError, match="vocab_size 200 in its config.json is smaller than its 262 tokens"):
        reward_model_args(path, BYTES, "sdpa_dense")


def test_normalized_scores_are_standardized_over_all_of_them():
    scores = [0.3, -1.2, 2.5, 0.0, 0.7]
    mean = sum(scores) / len(scores)
    std = math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores))
    assert normalized(scores, None) == pytest.approx([(s - mean) / std for s in scores], rel=1e-12)
    assert normalized([4.0, 4.0, 4.0], None) == [0.0, 0.0, 0.0]
    assert normalized([], None) == []


def test_model_scores_are_added_to_the_verifier_or_replace_it():
    verdicts = [Reward(1.0, True, {"correct": 1.0}), Reward(0.25, False, {"correct": 0.0})]
    added = with_model_scores(verdicts, [0.5, -2.0], RewardModelSettings(weight=0.1))
    assert [(r.total, r.correct) for r in added] == [(pytest.approx(1.05), True), (pytest.approx(0.05), False)]
    assert added[1].components == {"correct": 0.0, "model": pytest.approx(-0.2)}
    alone = with_model_scores(verdicts, [0.5, -2.0], RewardModelSettings(weight=2.0, alone=True))
    assert [(r.total, r.correct, r.components) for r in alone] == [
        (1.0, True, {"model": 1.0}),
        (-4.0, False, {"model": -4.0}),
    ]
    with pytest.raises(ValueError, match="component named 'model'"):
        with_model_scores([Reward(1.0, True, {"model": 1.0})], [0.0], RewardModelSettings())


def config(*args: str):
    return ConfigManager().parse_args(["--job.recipe", "grpo", *args])


@pytest.mark.parametrize("key", ["reward_model_weight 2.0", "reward_model_normalize", "reward_model_alone"])
def test_reward_model_keys_need_a_reward_model(key):
    name, *value = key.split()
    with pytest.raises(ValueError, match=f"rl.{name}: only used with rl.reward_model"):
        config(f"--rl.{name}", *value)


def test_reward_model_is_refused_with_an_environment_or_images():
    with pytest.raises(ValueError, match="rl.reward_model: with rl.env the environment rewards"):
        config("--rl.reward_model", "rm", "--rl.env", "calculator", "--rl.task", "calculator")
    with pytest.raises(ValueError, match="cannot score the completions of a model.name = 'vlm'"):
        config("--rl.reward_model", "rm", "--model.name", "vlm", "--rl.task", "shapes")
    with pytest.raises(ValueError, match="rl.reward_model_weight"):
        config("--rl.reward_model", "rm", "--rl.reward_model_weight", "0")


def test_rows_without_answers_train_when_the_reward_model_rewards_alone(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "Say hi", "answer": "hi"}\n{"prompt": "Write a poem"}\n')
    with pytest.raises(ValueError, match="missing 'answer'"):
        build_task("dataset", path=str(data), num_train=0, num_eval=0, seed=0)
    task = build_task("dataset", path=str(data), num_train=0, num_eval=0, seed=0, answers_required=False)
    by_prompt = {p.messages[0]["content"]: p for p in task.train_problems}
    assert task.reward(by_prompt["Say hi"], "hi", True).correct
    assert task.reward(by_prompt["Write a poem"], "", True) == Reward(0.0, False, {})
