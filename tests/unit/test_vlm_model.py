"""The vision-language model against HF transformers' Mistral3ForConditionalGeneration with a
Pixtral vision config and a Qwen3 text config, built from tiny seeded configs offline."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    Qwen3Config,
)

from test_vision_model import hf_vision_config, padded_pixels, patchify
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs, architecture_differences, check_flavor, find_flavor
from torchtitan_rl.models.qwen3.model import Qwen3Model, param_seed
from torchtitan_rl.models.vision.args import VisionArgs
from torchtitan_rl.models.vlm.args import VLMModelArgs, vlm_flavors
from torchtitan_rl.models.vlm.model import VisionInputs, VLMModel, merge_vision_features
from torchtitan_rl.models.vlm.state_dict_adapter import from_hf, to_hf

IMG, IMG_BREAK, IMG_END = 10, 11, 12  # HF's image token; break / end are ordinary tokens
FIRST_TEXT_TOKEN = 13
# Pixel sizes; with patch 4 and merge 2 the merged grids are 2x4, 4x2, 1x1, 6x6, 2x3, 3x1. The
# first is not whole patches (HF crops it to 16 x 32).
SAMPLE_IMAGES = [[(18, 33)], [], [(32, 16), (8, 8), (48, 48)], [(16, 24), (24, 8)]]


def small_args(tie_embeddings=False, projector_bias=False, attn_backend="sdpa_dense") -> VLMModelArgs:
    return VLMModelArgs(
        vocab_size=64,
        dim=48,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=12,
        hidden_dim=80,
        # Far from Pixtral's 1e-5, so a projector norm with the vision eps would show.
        norm_eps=1e-3,
        rope_theta=10_000.0,
        tie_embeddings=tie_embeddings,
        max_seq_len=256,
        attn_backend=attn_backend,
        vision=VisionArgs(
            dim=32,
            n_layers=2,
            n_heads=4,
            hidden_dim=48,
            patch_size=4,
            rope_theta=1000.0,
            max_patches_per_side=16,
            attn_backend=attn_backend,
        ),
        spatial_merge_size=2,
        image_token_id=IMG,
        projector_bias=projector_bias,
    )


def hf_config(args: VLMModelArgs) -> Mistral3Config:
    """Written out field by field (transformers' defaults differ from shipped checkpoints)."""
    text = Qwen3Config(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.hidden_dim,
        hidden_act="silu",
        rms_norm_eps=args.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        tie_word_embeddings=args.tie_embeddings,
        max_position_embeddings=args.max_seq_len,
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
    )
    config = Mistral3Config(
        vision_config=hf_vision_config(args.vision),
        text_config=text,
        image_token_index=IMG,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        multimodal_projector_bias=args.projector_bias,
        spatial_merge_size=args.spatial_merge_size,
        tie_word_embeddings=args.tie_embeddings,
    )
    config._attn_implementation = "eager"  # plain math, independent of SDPA
    return config


def hf_and_ours(**kwargs):
    args = small_args(**kwargs)
    torch.manual_seed(0)
    hf = Mistral3ForConditionalGeneration(hf_config(args)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            # HF starts norms at 1 and biases at 0: randomize them so a misplaced one would show.
            if name.endswith(("norm.weight", "ln_pre.weight")):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.uniform_(-0.5, 0.5)
    ours = VLMModel(args)
    ours.load_state_dict(from_hf(hf.state_dict(), args), strict=True)
    return hf, ours


def image_placeholders(height: int, width: int, unit: int) -> list[int]:
    """Pixtral's layout: each row of merged units as image tokens then [IMG_BREAK]; [IMG_END] last."""
    rows, cols = height // unit, width // unit
    tokens = []
    for r in range(rows):
        tokens += [IMG] * cols + [IMG_END if r == rows - 1 else IMG_BREAK]
    return tokens


def make_samples(args: VLMModelArgs, seed: int = 0):
    """Per sample: (token ids, its images ``[C, h, w]`` at their own sizes)."""
    gen = torch.Generator().manual_seed(seed)
    unit = args.vision.patch_size * args.spatial_merge_size
    samples = []
    for sizes in SAMPLE_IMAGES:
        ids = torch.randint(FIRST_TEXT_TOKEN, args.vocab_size, (3,), generator=gen).tolist()
        images = []
        for h, w in sizes:
            images.append(torch.randn(args.vision.num_channels, h, w, generator=gen))
            ids += image_placeholders(h, w, unit)
            ids += torch.randint(FIRST_TEXT_TOKEN, args.vocab_size, (2,), generator=gen).tolist()
        samples.append((torch.tensor(ids), images))
    return samples


def pack(samples, patch_size: int):
    tokens = torch.cat([ids for ids, _ in samples])
    positions = torch.cat([torch.arange(len(ids)) for ids, _ in samples])
    seq_ids = torch.cat([torch.full((len(ids),), i) for i, (ids, _) in enumerate(samples)])
    parts = [patchify(image, patch_size) for _, images in samples for image in images]
    is_image = tokens == IMG
    # Image tokens take the features in order: the images are packed in the order of their tokens.
    vision_index = torch.where(is_image, is_image.long().cumsum(0) - 1, -1)
    vision = VisionInputs(torch.cat([p for p, _ in parts]), tuple(g for _, g in parts), vision_index)
    return tokens, positions, seq_ids, vision


def hf_sample_logits(hf, ids: torch.Tensor, images) -> torch.Tensor:
    if not images:
        return hf(input_ids=ids[None]).logits[0]
    sizes = [tuple(img.shape[1:]) for img in images]
    pixel_values = padded_pixels(sizes, images[0].shape[0], seed=99)  # random padding
    for i, img in enumerate(images):
        pixel_values[i, :, : img.shape[1], : img.shape[2]] = img
    return hf(input_ids=ids[None], pixel_values=pixel_values, image_sizes=torch.tensor(sizes)).logits[0]


def test_image_features_of_packed_images_match_hf():
    hf, ours = hf_and_ours()
    sizes = [(18, 33), (32, 16), (48, 48)]  # merged grids 2x4, 4x2, 6x6; the first is cropped
    pixel_values = padded_pixels(sizes, 3, seed=5)  # random padding: using it would show
    images = [img[:, :h, :w] for img, (h, w) in zip(pixel_values, sizes)]
    parts = [patchify(img, 4) for img in images]
    with torch.no_grad():
        expected = torch.cat(hf.get_image_features(pixel_values, torch.tensor(sizes)).pooler_output)
        ours_features = ours.encode_images(torch.cat([p for p, _ in parts]), [g for _, g in parts])
    assert ours_features.shape == (8 + 8 + 36, ours.args.dim)
    torch.testing.assert_close(ours_features, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn_backend", ["sdpa_dense", "sdpa_varlen", "sdpa_loop"])
def test_packed_logits_match_hf_per_sample(attn_backend):
    hf, ours = hf_and_ours(attn_backend=attn_backend)
    samples = make_samples(ours.args, seed=1)
    with torch.no_grad():
        logits = ours.output(ours(*pack(samples, ours.args.vision.patch_size)))
        expected = torch.cat([hf_sample_logits(hf, ids, images) for ids, images in samples])
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tie_embeddings, projector_bias", [(False, True), (True, False)])
def test_every_gradient_matches_hf(tie_embeddings, projector_bias):
    hf, ours = hf_and_ours(tie_embeddings=tie_embeddings, projector_bias=projector_bias)
    samples = make_samples(ours.args, seed=2)
    gen = torch.Generator().manual_seed(3)
    num_tokens = sum(len(ids) for ids, _ in samples)
    targets = torch.randint(ours.args.vocab_size, (num_tokens,), generator=gen)
    weights = torch.rand(num_tokens, generator=gen)

    logits = ours.output(ours(*pack(samples, ours.args.vision.patch_size)))
    ours_loss = (weights * F.cross_entropy(logits, targets, reduction="none")).sum()
    ours_loss.backward()
    hf_logits = torch.cat([hf_sample_logits(hf, ids, images) for ids, images in samples])
    hf_loss = (weights * F.cross_entropy(hf_logits, targets, reduction="none")).sum()
    hf_loss.backward()

    torch.testing.assert_close(ours_loss, hf_loss, rtol=1e-5, atol=1e-5)
    hf_grads = from_hf({name: p.grad for name, p in hf.named_parameters()}, ours.args)
    our_grads = {name: p.grad for name, p in ours.named_parameters()}
    assert our_grads.keys() <= hf_grads.keys() and len(our_grads) > 40
    for name, grad in our_grads.items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, hf_grads[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_adapter_matches_save_pretrained_and_round_trips(tmp_path, tie_embeddings):
    hf, ours = hf_and_ours(tie_embeddings=tie_embeddings, projector_bias=True)
    hf.save_pretrained(tmp_path)
    on_disk = load_file(tmp_path / "model.safetensors")
    # named_parameters lists a tied head once, as transformers saves it.
    exported = to_hf(dict(ours.named_parameters()))
    assert exported.keys() == on_disk.keys()
    for key, tensor in on_disk.items():
        assert exported[key].shape == tensor.shape, key
        torch.testing.assert_close(exported[key], tensor, rtol=0, atol=0, msg=key)
    assert "vision_tower.patch_conv.weight" in on_disk and "language_model.model.norm.weight" in on_disk
    assert ("language_model.lm_head.weight" in on_disk) != tie_embeddings

    restored = from_hf(on_disk, ours.args)
    assert restored.keys() == ours.state_dict().keys()
    assert (restored["output.weight"] is restored["tok_embeddings.weight"]) == tie_embeddings
    round_trip = to_hf({k: v for k, v in restored.items() if not (tie_embeddings and k == "output.weight")})
    assert round_trip.keys() == on_disk.keys()
    assert all(round_trip[k] is on_disk[k] for k in on_disk)
    # The in-memory names of transformers 5 map to the same.
    assert from_hf(hf.state_dict(), ours.args).keys() == restored.keys()


def test_adapter_rejects_unknown_keys():
    args = small_args()
    with pytest.raises(ValueError, match="unexpected key"):
        from_hf({"vision_tower.transformer.layers.0.attention.q_proj.bias": torch.zeros(1)}, args)
    with pytest.raises(ValueError, match="vision layer 7"):
        from_hf({"vision_tower.transformer.layers.7.ffn_norm.weight": torch.zeros(1)}, args)
    with pytest.raises(ValueError, match="no HF name"):
        to_hf({"vision_tower.layers.0.attention.q_norm.weight": torch.zeros(1)})


@pytest.mark.parametrize("flavor", ["debugmodel", "0.6B"])
def test_config_round_trip_and_hf_builds_the_same_shapes(flavor):
    args = vlm_flavors[flavor]
    config = args.to_hf_config("float32")
    json.dumps(config)  # plain JSON
    assert VLMModelArgs.from_hf_config(config) == args
    assert VLMModelArgs.from_dict(dataclasses.asdict(args)) == args
    hf_config_ = Mistral3Config(**config)
    assert type(AutoConfig.for_model(**config)) is Mistral3Config
    assert hf_config_.vision_config.hidden_act == "silu" and hf_config_.tie_word_embeddings == args.tie_embeddings
    with torch.device("meta"):
        hf = Mistral3ForConditionalGeneration(hf_config_)
        ours = VLMModel(args)
    hf_shapes = {k: v.shape for k, v in from_hf(hf.state_dict(), args).items()}
    assert hf_shapes == {k: v.shape for k, v in ours.state_dict().items()}
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())


def test_to_hf_config_builds_the_reference_model():
    """HF built from our config.json computes what the explicitly configured reference does."""
    hf, ours = hf_and_ours(projector_bias=True)
    rebuilt = Mistral3ForConditionalGeneration(Mistral3Config(**ours.args.to_hf_config("float32"))).eval()
    rebuilt.config._attn_implementation = "eager"
    rebuilt.load_state_dict(hf.state_dict())
    ids, images = make_samples(ours.args, seed=4)[2]
    with torch.no_grad():
        torch.testing.assert_close(hf_sample_logits(rebuilt, ids, images), hf_sample_logits(hf, ids, images))


@pytest.mark.parametrize(
    "where, change, match",
    [
        ("top", {"vision_feature_layer": -2}, "vision_feature_layer"),
        ("top", {"projector_hidden_act": "relu"}, "projector_hidden_act"),
        ("top", {"model_type": "llava"}, "model_type"),
        ("top", {"tie_word_embeddings": True}, "tie_word_embeddings"),
        ("text", {"model_type": "mistral"}, "model_type"),
        ("vision", {"hidden_act": "gelu"}, "hidden_act"),
        ("vision", {"hidden_act": None}, "hidden_act"),
        ("vision", {"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}}, "rope_type"),
        ("vision", {"patch_size": [14, 14]}, "patch_size"),
        ("vision", {"head_dim": 4}, "head_dim"),
        ("vision", {"model_type": "siglip"}, "model_type"),
    ],
)
def test_unsupported_hf_config_fields_raise(where, change, match):
    config = small_args().to_hf_config("float32")
    target = {"top": config, "text": config["text_config"], "vision": config["vision_config"]}[where]
    for key, value in change.items():
        if value is None:
            del target[key]
        else:
            target[key] = value
    with pytest.raises(ValueError, match=match) as error:
        VLMModelArgs.from_hf_config(config, source="ckpt/config.json")
    assert "ckpt/config.json" in str(error.value)


def test_architecture_differences_cover_vision_and_skip_runtime_fields():
    args = vlm_flavors["debugmodel"]
    assert find_flavor(args, vlm_flavors) == "debugmodel"
    runtime = dataclasses.replace(
        args,
        attn_backend="sdpa_loop",
        image_token_id=3,
        vision=dataclasses.replace(args.vision, attn_backend="sdpa_loop"),
    )
    assert architecture_differences(runtime, args) == []
    wider = dataclasses.replace(args, vision=dataclasses.replace(args.vision, n_layers=3), spatial_merge_size=1)
    assert architecture_differences(wider, args) == [("vision.n_layers", 3, 2), ("spatial_merge_size", 1, 2)]
    with pytest.raises(ValueError, match="vision.n_layers=3"):
        check_flavor(wider, "debugmodel", "config.json", vlm_flavors)
    assert architecture_differences(
        args, Qwen3ModelArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Qwen3ModelArgs)})
    )


def test_text_only_forward_equals_qwen3_model():
    _, ours = hf_and_ours()
    lm = Qwen3Model(Qwen3ModelArgs(**{f.name: getattr(ours.args, f.name) for f in dataclasses.fields(Qwen3ModelArgs)}))
    lm.load_state_dict(
        {k: v for k, v in ours.state_dict().items() if not k.startswith(("vision_tower.", "projector."))}
    )
    tokens = torch.randint(64, (20,), generator=torch.Generator().manual_seed(6))
    positions = torch.cat([torch.arange(12), torch.arange(8)])
    seq_ids = torch.cat([torch.zeros(12, dtype=torch.long), torch.ones(8, dtype=torch.long)])
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens, positions, seq_ids), lm(tokens, positions, seq_ids), rtol=0, atol=0)


def test_unused_image_still_gives_every_vision_parameter_a_zero_gradient():
    """A dummy image that no token uses: h is untouched, and every parameter gets a gradient."""
    _, ours = hf_and_ours()
    tokens = torch.randint(FIRST_TEXT_TOKEN, 64, (9,), generator=torch.Generator().manual_seed(7))
    positions, seq_ids = torch.arange(9), torch.zeros(9, dtype=torch.long)
    patches = torch.randn(4, 48, generator=torch.Generator().manual_seed(8))
    vision = VisionInputs(patches, ((2, 2),), torch.full((9,), -1))
    hidden = ours(tokens, positions, seq_ids, vision)
    torch.testing.assert_close(hidden, ours(tokens, positions, seq_ids), rtol=0, atol=0)
    ours.output(hidden).square().sum().backward()
    for name, p in ours.named_parameters():
        assert p.grad is not None, name
        if name.startswith(("vision_tower.", "projector.")):
            assert not p.grad.any(), name

    h = torch.randn(5, 3)
    assert torch.equal(merge_vision_features(h, torch.randn(2, 3), torch.full((5,), -1)), h)
    features = torch.randn(2, 3)
    merged = merge_vision_features(h, features, torch.tensor([-1, 1, -1, 0, -1]))
    assert torch.equal(merged[[0, 2, 4]], h[[0, 2, 4]]) and torch.equal(merged[[1, 3]], features[[1, 0]])


def test_forward_rejects_bad_vision_inputs():
    _, ours = hf_and_ours()
    tokens, positions, seq_ids = torch.full((6,), FIRST_TEXT_TOKEN), torch.arange(6), torch.zeros(6, dtype=torch.long)
    patches = torch.randn(4, 48)  # one 2x2 image: one feature
    with pytest.raises(ValueError, match="outside"):
        ours(tokens, positions, seq_ids, VisionInputs(patches, ((2, 2),), torch.tensor([-1, 1, -1, -1, -1, -1])))
    with pytest.raises(ValueError, match="only 1"):
        ours(tokens, positions, seq_ids, VisionInputs(patches, ((2, 2),), torch.tensor([0, 0, -1, -1, -1, -1])))
    with pytest.raises(ValueError, match="tokens' shape"):
        ours(tokens, positions, seq_ids, VisionInputs(patches, ((2, 2),), torch.full((5,), -1)))
    with pytest.raises(ValueError, match="spatial_merge_size"):
        ours(tokens, positions, seq_ids, VisionInputs(torch.randn(3, 48), ((1, 3),), torch.full((6,), -1)))
    with pytest.raises(ValueError, match="no images"):
        ours(tokens, positions, seq_ids, VisionInputs(torch.randn(0, 48), (), torch.full((6,), -1)))


def test_init_weights_covers_vision_and_is_deterministic():
    args = small_args(projector_bias=True)
    eager = VLMModel(args)
    eager.init_weights(seed=3)
    with torch.device("meta"):
        meta = VLMModel(args)
    meta.to_empty(device="cpu")
    meta.init_weights(seed=3)
    for (name, a), (_, b) in zip(eager.state_dict().items(), meta.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(eager.vision_tower.ln_pre.weight, torch.ones(32))
    assert torch.equal(eager.projector.norm.weight, torch.ones(32))
    assert not eager.projector.linear_1.bias.any()
    patch = eager.vision_tower.patch_embedding.weight
    assert 0.01 < patch.std().item() < 0.03 and patch.abs().max() <= 0.06
    wo = eager.vision_tower.layers["1"].attention.wo.weight
    assert wo.abs().max() <= 3 * 0.02 / (2 * args.vision.n_layers) ** 0.5
    # Seeds follow the parameter name, as in Qwen3Model.
    generator = torch.Generator().manual_seed(param_seed(3, "vision_tower.layers.0.attention.wq.weight"))
    fresh = torch.empty(32, 32)
    eager.init_param_("vision_tower.layers.0.attention.wq.weight", fresh, generator)
    assert torch.equal(fresh, eager.vision_tower.layers["0"].attention.wq.weight)


def test_args_validation():
    with pytest.raises(ValueError, match="image_token_id"):
        dataclasses.replace(small_args(), image_token_id=64)
    with pytest.raises(ValueError, match="spatial_merge_size"):
        dataclasses.replace(small_args(), spatial_merge_size=0)
    with pytest.raises(ValueError, match="norm_eps"):
        dataclasses.replace(small_args(), vision=dataclasses.replace(small_args().vision, norm_eps=1e-6)).to_hf_config(
            "float32"
        )
