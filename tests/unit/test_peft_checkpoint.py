"""LoRA adapters against PEFT itself: our adapter directories load in ``PeftModel`` with our
logits, our merged export is PEFT's ``merge_and_unload``, adapters PEFT wrote load into our
model with PEFT's logits and keep training, and settings that do not fit are refused.

The base is a random ``Qwen3ForCausalLM`` written by transformers; adapters (B included) are
random, so a misplaced or transposed matrix, a wrong scale or a wrong key would show.
"""

import json
import os

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, GenerationConfig, Mistral3ForConditionalGeneration, Qwen3ForCausalLM

from torchtitan_rl.data.tokenizer import ByteTokenizer
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.hf_checkpoint import load_hf_weights, save_hf_checkpoint
from torchtitan_rl.hf_tokenizer_files import ExportTokenizer
from torchtitan_rl.models.lora import LoRASettings, lora_modules
from torchtitan_rl.models.vlm.model import VLMModel
from torchtitan_rl.optim import build_optimizer
from torchtitan_rl.peft_checkpoint import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    load_peft_adapter,
    save_merged_hf,
    save_peft_adapter,
)
from torchtitan_rl.recipes.base import build_model
from unit.test_qwen3_model import hf_and_ours, hf_logits, our_logits, random_tokens, small_args
from unit.test_vlm_hf_checkpoint import packed_logits
from unit.test_vlm_model import hf_and_ours as vlm_hf_and_ours
from unit.test_vlm_model import hf_sample_logits, make_samples
from unit.test_vlm_model import small_args as vlm_args

ALL_LINEAR = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
PEFT_NAMES = {
    "wq": "q_proj",
    "wk": "k_proj",
    "wv": "v_proj",
    "wo": "o_proj",
    "w1": "gate_proj",
    "w2": "down_proj",
    "w3": "up_proj",
}
SEQUENCES = [random_tokens(9, 96, seed=1), random_tokens(5, 96, seed=2)]


def adapted_model(tie: bool, settings: LoRASettings, seed: int = 0):
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes("cpu")
    args = small_args(tie)
    return build_model(
        args, parallel_dims=dims, device=torch.device("cpu"), seed=seed, param_dtype=torch.float32, lora=settings
    )


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def base(request, tmp_path_factory):
    """A random HF Qwen3 and its directory."""
    hf, _ = hf_and_ours(request.param)
    path = tmp_path_factory.mktemp("base")
    hf.save_pretrained(path)
    return request.param, str(path)


def load_hf(path: str) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


@torch.no_grad()
def randomize(model, train_embeddings: bool, seed: int = 7) -> None:
    gen = torch.Generator().manual_seed(seed)
    for layer in lora_modules(model).values():
        for param in (layer.lora_a.weight, layer.lora_b.weight):
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    if train_embeddings:
        emb = model.tok_embeddings.weight
        emb.add_(torch.randn(emb.shape, generator=gen) * 0.5)


def hf_sequence_logits(hf, sequences=SEQUENCES) -> torch.Tensor:
    return torch.cat([hf_logits(hf, tokens) for tokens in sequences])


@pytest.mark.parametrize(
    "settings",
    [
        LoRASettings(rank=4, alpha=8.0, target_modules=ALL_LINEAR),
        LoRASettings(rank=3, alpha=5.0, target_modules=("wq", "wv", "w2"), init="gaussian", train_embeddings=True),
    ],
    ids=["all-linear", "some-with-embeddings"],
)
def test_adapter_and_merged_export_match_peft(base, tmp_path, settings):
    tie, base_dir = base
    model = adapted_model(tie, settings)
    init = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}
    load_hf_weights(model, base_dir)
    # The base loads, the adapters keep their init (B zero: the model is its base).
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert torch.equal(p, init[name]), name
    with torch.no_grad():
        torch.testing.assert_close(our_logits(model, SEQUENCES), hf_sequence_logits(load_hf(base_dir)))
        randomize(model, settings.train_embeddings)
        ours = our_logits(model, SEQUENCES)

    adapter_dir = str(tmp_path / "adapter")
    save_peft_adapter(model, adapter_dir, settings, torch.float32)
    config = json.load(open(os.path.join(adapter_dir, ADAPTER_CONFIG_FILE)))
    assert sorted(config["target_modules"]) == sorted(PEFT_NAMES[name] for name in settings.target_modules)
    peft = PeftModel.from_pretrained(load_hf(base_dir), adapter_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf_sequence_logits(peft), ours, rtol=1e-5, atol=1e-5)
    # Exactly PEFT's tensors: all ours are its adapters (and trained embedding), nothing missing.
    peft_state = {k.replace(".default", ""): v for k, v in peft.state_dict().items()}
    written = load_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS_FILE))
    expected = {k for k in peft_state if ".lora_" in k}
    if settings.train_embeddings:
        expected.add("base_model.model.model.embed_tokens.weight")
        if tie:
            expected.add("base_model.model.lm_head.weight")
    assert set(written) == expected
    for key in written:
        if ".lora_" in key:
            assert torch.equal(written[key], peft_state[key]), key

    with pytest.raises(ValueError, match="LoRA adapters.*save_merged_hf"):
        save_hf_checkpoint(model, str(tmp_path / "plain"), torch.float32)
    merged_dir = str(tmp_path / "merged")
    save_merged_hf(model, merged_dir, torch.float32)
    merged, reference = load_hf(merged_dir), peft.merge_and_unload()
    expected_state = reference.state_dict()
    for key, value in merged.state_dict().items():
        torch.testing.assert_close(value, expected_state[key], rtol=1e-6, atol=1e-6, msg=key)
    with torch.no_grad():
        torch.testing.assert_close(hf_sequence_logits(merged), ours, rtol=1e-5, atol=1e-5)


def test_adapter_written_by_peft_loads_and_trains(base, tmp_path):
    tie, base_dir = base
    hf = load_hf(base_dir)
    config = LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=True)
    peft = get_peft_model(hf, config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    peft.save_pretrained(tmp_path / "adapter")

    settings = LoRASettings(rank=4, alpha=6.0, target_modules=("wq", "wv", "w2"))
    model = adapted_model(tie, settings, seed=5)
    load_hf_weights(model, base_dir)
    load_peft_adapter(model, str(tmp_path / "adapter"), settings)
    with torch.no_grad():
        torch.testing.assert_close(our_logits(model, SEQUENCES), hf_sequence_logits(peft.eval()), rtol=1e-5, atol=1e-5)

    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = build_optimizer(model, 1e-2, 0.9, 0.95, 1e-8, 0.0)
    tokens = torch.cat(SEQUENCES)
    losses = []
    for _ in range(3):
        logits = our_logits(model, SEQUENCES)
        loss = torch.nn.functional.cross_entropy(logits[:-1], tokens[1:])
        loss.backward()
        for name, p in model.named_parameters():
            assert (p.grad is not None) == ("lora_" in name), name
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for name, p in model.named_parameters():
        if name in base_before:
            assert torch.equal(p, base_before[name]), name


@pytest.mark.parametrize(
    "change, key",
    [
        ({"rank": 2}, '"r" is 4'),
        ({"alpha": 16.0}, '"lora_alpha" is 6'),
        ({"target_modules": ("wq", "wk", "w2")}, '"target_modules"'),
        ({"train_embeddings": True}, '"modules_to_save"'),
    ],
    ids=["rank", "alpha", "targets", "embeddings"],
)
def test_adapter_of_other_settings_is_refused_naming_the_key(tmp_path, change, key):
    written = LoRASettings(rank=4, alpha=6.0, target_modules=("wq", "wv", "w2"))
    model = adapted_model(False, written)
    save_peft_adapter(model, str(tmp_path / "adapter"), written, torch.float32)
    settings = LoRASettings(**{**written.__dict__, **change})
    other = adapted_model(False, settings)
    with pytest.raises(ValueError, match=rf"adapter_config.json'?: {key}"):
        load_peft_adapter(other, str(tmp_path / "adapter"), settings)


def test_missing_or_foreign_tensor_is_named(tmp_path):
    settings = LoRASettings(rank=2, alpha=2.0, target_modules=("wq",))
    model = adapted_model(False, settings)
    path = tmp_path / "adapter"
    save_peft_adapter(model, str(path), settings, torch.float32)
    tensors = load_file(path / ADAPTER_WEIGHTS_FILE)
    key = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
    tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weght"] = tensors.pop(key)
    save_file(tensors, path / ADAPTER_WEIGHTS_FILE)
    with pytest.raises(ValueError, match=rf"adapter_model.safetensors' lacks '{key}'; has unexpected .*weght"):
        load_peft_adapter(model, str(path), settings)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_peft_adapter(model, str(tmp_path), settings)


def test_vlm_adapter_matches_peft_on_mistral3_and_merged_export_matches(tmp_path):
    """PEFT names the VLM's modules as transformers builds them in memory
    (``model.language_model.layers...``), not as its files do."""
    settings = LoRASettings(rank=2, alpha=3.0, target_modules=("wq", "w3", "projector"), train_embeddings=True)
    hf, _ = vlm_hf_and_ours()
    hf.save_pretrained(tmp_path / "base")
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes("cpu")
    args = vlm_args()
    model = build_model(
        args, parallel_dims=dims, device=torch.device("cpu"), seed=0, param_dtype=torch.float32, lora=settings
    )
    load_hf_weights(model, str(tmp_path / "base"))
    randomize(model, train_embeddings=True)
    samples = make_samples(args)
    with torch.no_grad():
        ours = packed_logits(model, samples)
    save_peft_adapter(model, str(tmp_path / "adapter"), settings, torch.float32)
    base = Mistral3ForConditionalGeneration.from_pretrained(tmp_path / "base", attn_implementation="eager").eval()
    peft = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    adapted = {name for name, _ in peft.named_modules() if name.endswith("lora_A")}
    assert len(adapted) == 2 * 2 + 3  # wq and w3 of both layers, the projector's three linears
    with torch.no_grad():
        for got, (ids, images) in zip(ours, samples):
            torch.testing.assert_close(got, hf_sample_logits(peft, ids, images), rtol=1e-5, atol=1e-5)

    save_merged_hf(model, str(tmp_path / "merged"), torch.float32)
    plain = VLMModel(args)
    load_hf_weights(plain, str(tmp_path / "merged"))
    with torch.no_grad():
        for got, expected in zip(packed_logits(plain, samples), ours):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_adapter_and_merged_exports_carry_the_run_tokenizer(tmp_path):
    """With the byte tokenizer: its tokenizer files, and the stop tokens' ids to generate with."""
    settings = LoRASettings(rank=2, alpha=4.0, target_modules=("wq", "w2"))
    model = adapted_model(tie=False, settings=settings)
    byte_tokenizer = ByteTokenizer()
    stop_tokens = ["<|im_end|>", "<|endoftext|>"]
    tokenizer = ExportTokenizer.for_run(byte_tokenizer, "", stop_tokens)
    save_peft_adapter(model, str(tmp_path / "adapter"), settings, torch.float32, tokenizer)
    save_merged_hf(model, str(tmp_path / "merged"), torch.float32, tokenizer)
    stop_ids = [byte_tokenizer.token_to_id(token) for token in stop_tokens]
    text = "Grüße, 你好 🙂\n  x"
    for directory in (tmp_path / "adapter", tmp_path / "merged"):
        assert AutoTokenizer.from_pretrained(directory).encode(text) == byte_tokenizer.encode(text)
        assert GenerationConfig.from_pretrained(directory).eos_token_id == stop_ids
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["eos_token_id"] == stop_ids
