"""Hugging Face interop of the VLM through hf_checkpoint: a Mistral3 directory written by
transformers loads into our model, and our export loads in transformers with the same logits;
what the recipe changes in the config.json's args is said, and errors name the file and field."""

import dataclasses
import json
import logging
import os

import pytest
import torch
from transformers import AutoModelForImageTextToText

from test_vlm_model import hf_and_ours, hf_sample_logits, make_samples, pack
from torchtitan_rl.hf_checkpoint import load_hf_weights, read_hf_model_args, save_hf_checkpoint
from torchtitan_rl.models.qwen3.args import check_flavor
from torchtitan_rl.models.vlm.args import vlm_flavors, with_image_token_id
from torchtitan_rl.models.vlm.model import VLMModel


def packed_logits(model, samples) -> list[torch.Tensor]:
    tokens, positions, seq_ids, vision = pack(samples, model.args.vision.patch_size)
    logits = model.output(model(tokens, positions, seq_ids, vision=vision))
    return list(logits.split([len(ids) for ids, _ in samples]))


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_hf_directory_loads_and_export_reloads_in_transformers(tmp_path, tie_embeddings):
    hf, ours = hf_and_ours(tie_embeddings=tie_embeddings)
    hf.save_pretrained(tmp_path / "hf")
    args = read_hf_model_args(str(tmp_path / "hf"))
    assert args == ours.args
    loaded = VLMModel(args)
    load_hf_weights(loaded, str(tmp_path / "hf"))
    samples = make_samples(args)
    with torch.no_grad():
        for got, (ids, images) in zip(packed_logits(loaded, samples), samples):
            torch.testing.assert_close(got, hf_sample_logits(hf, ids, images), rtol=1e-5, atol=1e-5)

    out = str(tmp_path / "export")
    save_hf_checkpoint(loaded, out, torch.float32)
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["model_type"] == "mistral3" and config["text_config"]["model_type"] == "qwen3"
    reloaded, info = AutoModelForImageTextToText.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}  # nothing missing, unexpected or mismatched
    assert type(reloaded).__name__ == "Mistral3ForConditionalGeneration"
    reloaded.config._attn_implementation = "eager"
    with torch.no_grad():
        for ids, images in samples:
            torch.testing.assert_close(
                hf_sample_logits(reloaded.eval(), ids, images), hf_sample_logits(hf, ids, images), rtol=1e-5, atol=1e-5
            )


def test_checkpoint_of_another_vision_tower_names_the_difference(tmp_path):
    hf, ours = hf_and_ours()
    hf.save_pretrained(tmp_path / "hf")
    with pytest.raises(
        ValueError, match=r"config.json says .*vision.dim=32, .*model.flavor=.debugmodel. has .*vision.dim=64"
    ):
        check_flavor(read_hf_model_args(str(tmp_path / "hf")), "debugmodel", "config.json", vlm_flavors)


def test_image_token_of_another_id_than_the_tokenizers_is_replaced_with_a_warning(tmp_path, caplog):
    hf, ours = hf_and_ours()
    hf.save_pretrained(tmp_path / "hf")
    args = read_hf_model_args(str(tmp_path / "hf"))
    written = json.load(open(tmp_path / "hf" / "config.json"))["image_token_index"]
    assert args.image_token_id == written == ours.args.image_token_id
    other = written + 1
    with caplog.at_level(logging.WARNING, logger="torchtitan_rl.models.vlm.args"):
        replaced = with_image_token_id(args, other, "<|image_pad|>")
    assert replaced == dataclasses.replace(args, image_token_id=other)
    assert [record.getMessage() for record in caplog.records] == [
        f"{tmp_path / 'hf' / 'config.json'}: image_token_index={written} differs from the tokenizer's id {other} "
        f"of model.image_token '<|image_pad|>'; using {other}"
    ]
    caplog.clear()
    # The same id, or args of a named flavor (no config.json to contradict), replace silently.
    with caplog.at_level(logging.WARNING, logger="torchtitan_rl.models.vlm.args"):
        assert with_image_token_id(args, written, "[IMG]") == args
        assert with_image_token_id(vlm_flavors["debugmodel"], 7, "[IMG]").image_token_id == 7
    assert caplog.records == []


@pytest.mark.parametrize(
    "where, change, message",
    [
        (
            "vision_config",
            {"num_attention_heads": 3, "head_dim": 10},
            "config.json vision_config: hidden_size=32 must be a multiple of num_attention_heads=3",
        ),
        (
            "vision_config",
            {"num_attention_heads": 16, "head_dim": 2},
            "config.json vision_config: head_dim = hidden_size / num_attention_heads = 2 must be a multiple of 4",
        ),
        (
            "",
            {"image_token_index": 64},
            "config.json: image_token_index must be a token id in [0, text_config.vocab_size=64), got 64",
        ),
        (
            "text_config",
            {"num_key_value_heads": 3},
            "config.json text_config: num_attention_heads=4 must be a multiple of num_key_value_heads=3",
        ),
    ],
)
def test_architecture_errors_of_a_config_name_the_file_and_field(tmp_path, where, change, message):
    hf, _ = hf_and_ours()
    hf.save_pretrained(tmp_path)
    config = json.load(open(tmp_path / "config.json"))
    (config[where] if where else config).update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        read_hf_model_args(str(tmp_path))
    assert str(error.value) == f"{tmp_path}/{message}"
