"""Hugging Face interop against transformers itself: config.json, weights in and out, bad input.

Tiny random Qwen3 models are written with ``save_pretrained`` (one file and sharded, tied and
untied); loading them must give HF's logits and losses, and exporting must give back HF's
tensors bit for bit and a directory ``from_pretrained`` reads without complaint.
"""

import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import Qwen3ForCausalLM

from torchtitan_rl import hf_checkpoint
from torchtitan_rl.data.tokenizer import build_tokenizer
from torchtitan_rl.hf_checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    load_hf_weights,
    read_hf_model_args,
    save_hf_checkpoint,
)
from torchtitan_rl.hf_tokenizer_files import ExportTokenizer
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs, check_flavor, find_flavor, qwen3_flavors
from torchtitan_rl.models.qwen3.model import Qwen3Model
from torchtitan_rl.models.qwen3.parallelize import check_tp_divisibility
from torchtitan_rl.models.qwen3.state_dict_adapter import to_hf

# Package paths (tests/ is on sys.path), so tests/distributed can import this module too.
from unit.test_qwen3_model import LENGTHS, hf_and_ours, hf_config, hf_logits, pack, random_tokens, small_args
from unit.test_tokenizer import make_hf_tokenizer_dir

SHARD_SIZE = 20_000  # bytes: the tiny model (~250 kB in fp32) is written as a dozen shards


def hf_model(tie: bool) -> Qwen3ForCausalLM:
    hf, _ = hf_and_ours(tie)  # random weights, norms randomized too
    return hf


def save_hf(hf: Qwen3ForCausalLM, directory, sharded: bool) -> str:
    hf.save_pretrained(directory, max_shard_size=SHARD_SIZE if sharded else "1GB")
    assert os.path.isfile(os.path.join(directory, INDEX_FILE if sharded else SINGLE_FILE))
    return str(directory)


def empty_model(args: Qwen3ModelArgs) -> Qwen3Model:
    """As the trainer builds it: on the meta device, then materialized uninitialized."""
    with torch.device("meta"):
        model = Qwen3Model(args)
    return model.to_empty(device="cpu")


def read_tensors(directory: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(directory, name)))
    return tensors


def reference_tensors(hf: Qwen3ForCausalLM) -> dict[str, torch.Tensor]:
    """HF's state dict as ``save_pretrained`` writes it (a tied head is not written)."""
    state_dict = hf.state_dict()
    if hf.config.tie_word_embeddings:
        del state_dict["lm_head.weight"]
    return state_dict


@pytest.fixture(
    scope="module",
    params=[(False, False), (False, True), (True, False), (True, True)],
    ids=["untied-single", "untied-sharded", "tied-single", "tied-sharded"],
)
def checkpoint(request, tmp_path_factory):
    tie, sharded = request.param
    hf = hf_model(tie)
    return hf, save_hf(hf, tmp_path_factory.mktemp("hf"), sharded)


# ---------------------------------------------------------------- config.json


def test_read_hf_model_args(checkpoint):
    hf, path = checkpoint
    expected = small_args(hf.config.tie_word_embeddings, attn_backend="sdpa_loop")
    assert read_hf_model_args(path, attn_backend="sdpa_loop") == expected


# Qwen/Qwen3-0.6B's config.json as published (transformers 4.51 layout: top-level integer
# rope_theta, rope_scaling null).
QWEN3_0_6B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_published_config_is_the_flavor(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_0_6B_CONFIG))
    args = read_hf_model_args(str(tmp_path))
    assert args == qwen3_flavors["0.6B"] and find_flavor(args) == "0.6B"
    assert args.to_hf_config("bfloat16").items() <= QWEN3_0_6B_CONFIG.items()  # same on every shared field


@pytest.mark.parametrize("flavor", sorted(qwen3_flavors))
def test_flavor_config_round_trip(flavor):
    args = qwen3_flavors[flavor]
    assert Qwen3ModelArgs.from_hf_config(args.to_hf_config("bfloat16")) == args


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "qwen2_moe"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_parameters"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"hidden_size": "64"}, "hidden_size"),
        ({"tie_word_embeddings": 1}, "tie_word_embeddings"),
        ({"num_key_value_heads": None}, "num_key_value_heads"),
    ],
)
def test_unsupported_config_names_file_and_field(tmp_path, change, field):
    config = {**small_args(tie_embeddings=False).to_hf_config("float32"), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"config\.json.*{field}"):
        read_hf_model_args(str(tmp_path))


def test_config_file_errors(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        read_hf_model_args(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "qwen3",')
    with pytest.raises(ValueError, match=r"config\.json.*not valid JSON"):
        read_hf_model_args(str(tmp_path))
    config = small_args(tie_embeddings=False).to_hf_config("float32")
    del config["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: missing required field 'hidden_size'"):
        read_hf_model_args(str(tmp_path))


def test_flavor_check_names_the_differences():
    published = dataclasses.replace(qwen3_flavors["0.6B"], max_seq_len=32768, attn_backend="sdpa_loop")
    assert find_flavor(published) == "0.6B"  # context length and backend are not the architecture
    check_flavor(published, "0.6B", "config.json")
    with pytest.raises(ValueError) as error:
        check_flavor(published, "debugmodel", "ckpt/config.json")
    message = str(error.value)
    assert message.startswith("checkpoint from another model flavor: ckpt/config.json says vocab_size=151936")
    assert "n_layers=28" in message and "model.flavor='debugmodel' has vocab_size=512" in message
    assert "n_layers=2," in message and "matches model.flavor='0.6B'" in message
    with pytest.raises(ValueError) as error:
        check_flavor(dataclasses.replace(published, n_layers=3), "0.6B", "ckpt/config.json")
    # The way out: take the architecture from that file.
    assert str(error.value).endswith(
        '(no named flavor matches it; model.flavor = "hf" takes the architecture from ckpt/config.json itself)'
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"num_attention_heads": 6, "num_key_value_heads": 4},
            "num_attention_heads=6 must be a multiple of num_key_value_heads=4",
        ),
        ({"head_dim": 15}, "head_dim=15 must be even for rotary embeddings"),
    ],
)
def test_architecture_errors_of_a_config_name_the_file_and_field(tmp_path, change, message):
    config = {**small_args(tie_embeddings=False).to_hf_config("float32"), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        read_hf_model_args(str(tmp_path))
    assert str(error.value) == f"{tmp_path / 'config.json'}: {message}"


def test_tensor_parallel_error_of_a_config_names_the_file_and_field(tmp_path):
    config = {**small_args(tie_embeddings=False).to_hf_config("float32"), "num_attention_heads": 6}
    (tmp_path / "config.json").write_text(json.dumps(config))
    # The recipe replaces runtime fields of the args it read; they still know their file.
    args = dataclasses.replace(read_hf_model_args(str(tmp_path)), attn_backend="sdpa_loop")
    check_tp_divisibility(args, 2)
    with pytest.raises(ValueError) as error:
        check_tp_divisibility(args, 4)
    assert str(error.value) == (
        f"{tmp_path / 'config.json'}: num_attention_heads=6 is not divisible by parallelism.tensor_parallel_degree=4"
    )
    # A named flavor has no file: its errors name its fields.
    with pytest.raises(ValueError, match="^n_kv_heads=2 is not divisible by parallelism.tensor_parallel_degree=4$"):
        check_tp_divisibility(small_args(tie_embeddings=False), 4)


# ---------------------------------------------------------------- loading


def test_loaded_model_matches_hf_on_packed_sequences(checkpoint):
    hf, path = checkpoint
    model = empty_model(read_hf_model_args(path))
    load_hf_weights(model, path)
    vocab_size = model.args.vocab_size
    sequences = [random_tokens(n, vocab_size, seed=50 + i) for i, n in enumerate(LENGTHS)]
    targets = torch.cat([random_tokens(n, vocab_size, seed=60 + i) for i, n in enumerate(LENGTHS)])
    with torch.no_grad():
        ours = model.output(model(*pack(sequences)))
        theirs = torch.cat([hf_logits(hf, s) for s in sequences])
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        F.cross_entropy(ours, targets, reduction="none"),
        F.cross_entropy(theirs, targets, reduction="none"),
        rtol=1e-5,
        atol=1e-5,
    )
    assert (model.output.weight is model.tok_embeddings.weight) == model.args.tie_embeddings


def test_load_casts_bfloat16_files(tmp_path):
    hf = hf_model(tie=False).to(torch.bfloat16)
    path = save_hf(hf, tmp_path, sharded=False)
    model = empty_model(read_hf_model_args(path))
    load_hf_weights(model, path)
    for key, tensor in to_hf(dict(model.named_parameters())).items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, hf.state_dict()[key].float()), key


def test_tied_checkpoint_with_lm_head_loads_the_embedding(tmp_path):
    hf = hf_model(tie=True)
    tensors = reference_tensors(hf)
    save_file(
        {**tensors, "lm_head.weight": torch.zeros_like(tensors["model.embed_tokens.weight"])},
        str(tmp_path / SINGLE_FILE),
    )
    model = empty_model(small_args(tie_embeddings=True))
    load_hf_weights(model, str(tmp_path))
    assert torch.equal(model.output.weight, tensors["model.embed_tokens.weight"])


# ---------------------------------------------------------------- bad checkpoints


@pytest.fixture
def sharded_copy(tmp_path):
    """A writable sharded untied checkpoint and its index."""
    path = save_hf(hf_model(tie=False), tmp_path / "hf", sharded=True)
    return path, os.path.join(path, INDEX_FILE)


def rewrite_index(index_path: str, edit) -> None:
    with open(index_path) as f:
        index = json.load(f)
    edit(index["weight_map"])
    with open(index_path, "w") as f:
        json.dump(index, f)


def test_index_naming_a_missing_shard(sharded_copy):
    path, index_path = sharded_copy
    rewrite_index(
        index_path, lambda weight_map: weight_map.update({"model.norm.weight": "model-00099-of-00099.safetensors"})
    )
    with pytest.raises(ValueError, match=r"index\.json.*lists shard file 'model-00099-of-00099\.safetensors'"):
        load_hf_weights(empty_model(small_args(tie_embeddings=False)), path)


def test_index_placing_a_tensor_in_the_wrong_shard(sharded_copy):
    path, index_path = sharded_copy
    with open(index_path) as f:
        other_shard = json.load(f)["weight_map"]["model.embed_tokens.weight"]
    rewrite_index(index_path, lambda weight_map: weight_map.update({"model.norm.weight": other_shard}))
    with pytest.raises(ValueError, match=rf"'model\.norm\.weight' in '.*{other_shard}', which does not contain it"):
        load_hf_weights(empty_model(small_args(tie_embeddings=False)), path)


@pytest.mark.parametrize("content", ['{"weight_map": {"a": ', '{"metadata": {}}', "[1, 2]"])
def test_corrupted_index(sharded_copy, content):
    path, index_path = sharded_copy
    with open(index_path, "w") as f:
        f.write(content)
    with pytest.raises(
        ValueError, match=r"model\.safetensors\.index\.json'? (is not valid JSON|has no \"weight_map\")"
    ):
        load_hf_weights(empty_model(small_args(tie_embeddings=False)), path)


def test_corrupted_shard(sharded_copy):
    path, index_path = sharded_copy
    with open(index_path) as f:
        shard = json.load(f)["weight_map"]["model.norm.weight"]
    with open(os.path.join(path, shard), "wb") as f:
        f.write(b"not a safetensors file")
    with pytest.raises(ValueError, match=rf"{shard}' is not a readable safetensors file"):
        load_hf_weights(empty_model(small_args(tie_embeddings=False)), path)


def test_no_weights(tmp_path):
    with pytest.raises(ValueError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        load_hf_weights(empty_model(small_args(tie_embeddings=False)), str(tmp_path))


def test_checkpoint_of_another_shape_names_key_and_shapes(tmp_path):
    other = dataclasses.replace(small_args(tie_embeddings=False), hidden_dim=96)
    path = save_hf(Qwen3ForCausalLM(hf_config(other)), tmp_path, sharded=False)
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \(96, 64\), "
        r"the model expects \(80, 64\)",
    ):
        load_hf_weights(empty_model(small_args(tie_embeddings=False)), path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
            r"has no tensor 'model\.layers\.1\.mlp\.up_proj\.weight'",
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}),
            r"has tensor 'model\.layers\.0\.self_attn\.q_proj\.bias' that the model does not have",
        ),
        (
            lambda t: t.update({"model.layers.2.input_layernorm.weight": torch.zeros(64)}),
            r"has tensor 'model\.layers\.2\.input_layernorm\.weight' that the model does not have",
        ),
    ],
)
def test_missing_and_unexpected_tensors(tmp_path, edit, message):
    tensors = reference_tensors(hf_model(tie=False))
    edit(tensors)
    save_file(tensors, str(tmp_path / SINGLE_FILE))
    with pytest.raises(ValueError, match=rf"model\.safetensors'? {message}"):
        load_hf_weights(empty_model(small_args(tie_embeddings=False)), str(tmp_path))


def test_tied_checkpoint_into_untied_model_misses_lm_head(tmp_path):
    path = save_hf(hf_model(tie=True), tmp_path, sharded=False)
    with pytest.raises(ValueError, match=r"has no tensor 'lm_head\.weight'"):
        load_hf_weights(empty_model(small_args(tie_embeddings=False)), path)


def test_meta_model_is_refused(tmp_path):
    path = save_hf(hf_model(tie=False), tmp_path, sharded=False)
    with torch.device("meta"):
        model = Qwen3Model(small_args(tie_embeddings=False))
    with pytest.raises(ValueError, match="meta device"):
        load_hf_weights(model, path)


# ---------------------------------------------------------------- export


def loaded(path: str) -> Qwen3Model:
    model = empty_model(read_hf_model_args(path))
    load_hf_weights(model, path)
    return model


@pytest.mark.parametrize("shard_bytes", [5 * 2**30, SHARD_SIZE], ids=["single", "sharded"])
def test_export_round_trip(checkpoint, tmp_path, shard_bytes):
    hf, path = checkpoint
    out = str(tmp_path / "export")
    save_hf_checkpoint(loaded(path), out, torch.float32, max_shard_bytes=shard_bytes)

    written = sorted(os.listdir(out))
    assert (INDEX_FILE in written) == (shard_bytes == SHARD_SIZE)
    assert (SINGLE_FILE in written) == (shard_bytes != SHARD_SIZE)
    assert not [name for name in os.listdir(tmp_path) if name != "export"]  # no staging left behind
    exported, expected = read_tensors(out), reference_tensors(hf)
    assert exported.keys() == expected.keys()
    for key, tensor in expected.items():
        assert exported[key].dtype == torch.float32 and torch.equal(exported[key], tensor), key
    assert read_hf_model_args(out) == read_hf_model_args(path)

    reloaded, info = Qwen3ForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}  # nothing missing, unexpected or mismatched
    assert reloaded.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert reloaded.config.rope_parameters["rope_theta"] == hf.config.rope_parameters["rope_theta"]
    tokens = random_tokens(13, hf.config.vocab_size, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(reloaded.eval(), tokens), hf_logits(hf, tokens), rtol=1e-5, atol=1e-5)


def test_export_sharded_index_matches_files(tmp_path):
    hf = hf_model(tie=False)
    out = str(tmp_path / "export")
    save_hf_checkpoint(
        loaded(save_hf(hf, tmp_path / "hf", sharded=False)), out, torch.float32, max_shard_bytes=SHARD_SIZE
    )
    with open(os.path.join(out, INDEX_FILE)) as f:
        index = json.load(f)
    for key, shard in index["weight_map"].items():
        with safe_open(os.path.join(out, shard), "pt") as f:
            assert key in f.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in reference_tensors(hf).values())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    for shard in shards:
        tensors = load_file(os.path.join(out, shard))
        # Only a tensor bigger than the limit on its own may exceed it.
        assert len(tensors) == 1 or sum(t.numel() * 4 for t in tensors.values()) <= SHARD_SIZE, shard


def test_export_bfloat16(tmp_path):
    hf = hf_model(tie=True)
    out = str(tmp_path / "export")
    save_hf_checkpoint(loaded(save_hf(hf, tmp_path / "hf", sharded=False)), out, torch.bfloat16)
    exported = read_tensors(out)
    for key, tensor in reference_tensors(hf).items():
        assert exported[key].dtype == torch.bfloat16 and torch.equal(exported[key], tensor.bfloat16()), key
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    assert Qwen3ForCausalLM.from_pretrained(out).dtype == torch.bfloat16


def test_export_with_tokenizer_is_one_hf_directory(tmp_path):
    """The export serves as both checkpoint.initial_load_path and model.hf_assets_path."""
    tokenizer_dir = make_hf_tokenizer_dir(tmp_path / "tokenizer")
    (tokenizer_dir / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    hf = hf_model(tie=True)
    out = str(tmp_path / "export")
    tokenizer = ExportTokenizer.for_run(build_tokenizer(str(tokenizer_dir)), str(tokenizer_dir), ["<|im_end|>"])
    save_hf_checkpoint(loaded(save_hf(hf, tmp_path / "hf", sharded=False)), out, torch.float32, tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tokenizer_dir / name).read_bytes() == open(os.path.join(out, name), "rb").read()
    original, exported = build_tokenizer(str(tokenizer_dir)), build_tokenizer(out)
    text = "<|im_start|>user\nWhat is 3 + 4?<|im_end|>"
    assert exported.encode(text) == original.encode(text)
    assert (exported.im_start_id, exported.im_end_id, exported.eos_id) == (
        original.im_start_id,
        original.im_end_id,
        original.eos_id,
    )
    assert read_hf_model_args(out) == small_args(tie_embeddings=True)
    # The run stops at <|im_end|> alone: one id, written as an int.
    for name in ("config.json", "generation_config.json"):
        with open(os.path.join(out, name)) as f:
            config = json.load(f)
        ids = {key: config[key] for key in ("eos_token_id", "pad_token_id", "bos_token_id")}
        assert ids == {
            "eos_token_id": original.im_end_id,
            "pad_token_id": original.eos_id,
            "bos_token_id": original.eos_id,
        }


def test_export_refuses_bad_targets_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    model = loaded(save_hf(hf_model(tie=False), tmp_path / "hf", sharded=False))
    with pytest.raises(ValueError, match="already exists"):
        save_hf_checkpoint(model, str(tmp_path / "hf"), torch.float32)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        save_hf_checkpoint(model, str(tmp_path / "export"), torch.float32, ExportTokenizer(str(tmp_path), (2,), 0))

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(hf_checkpoint, "_write_json", disk_full)  # after the weights are written
    with pytest.raises(OSError, match="No space left"):
        save_hf_checkpoint(model, str(tmp_path / "export"), torch.float32)
    assert sorted(os.listdir(tmp_path)) == ["hf"]
