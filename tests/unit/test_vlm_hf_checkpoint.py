"""Hugging Face interop of the VLM through hf_checkpoint: a Mistral3 directory written by
transformers loads into our model, and our export loads in transformers with the same logits."""

import json
import os

import pytest
import torch
from transformers import AutoModelForImageTextToText

from test_vlm_model import hf_and_ours, hf_sample_logits, make_samples, pack
from torchtitan_rl.hf_checkpoint import load_hf_weights, read_hf_model_args, save_hf_checkpoint
from torchtitan_rl.models.qwen3.args import check_flavor
from torchtitan_rl.models.vlm.args import vlm_flavors
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
    with pytest.raises(ValueError, match=r"config.json says .*vision.dim=32, .*model.flavor=.debugmodel. has .*vision.dim=64"):
        check_flavor(read_hf_model_args(str(tmp_path / "hf")), "debugmodel", "config.json", vlm_flavors)
