"""Hyper-parameters of the vision-language model (Mistral3 layout: a Pixtral encoder, a patch
merger + MLP projector, and our Qwen3 decoder), its flavors, and conversion from/to an HF
``Mistral3Config`` ``config.json`` whose ``text_config`` is a Qwen3 one."""

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torchtitan_rl.models.qwen3.args import QWEN3_HF_KEYS, Qwen3ModelArgs, hf_config_field, qwen3_flavors
from torchtitan_rl.models.vision.args import VisionArgs

logger = logging.getLogger(__name__)


def _debug_vision() -> VisionArgs:
    # Tiny, CPU-trainable in minutes. Patches of 14 px merged 2x2, so one image token covers
    # 28x28 pixels; images up to 16 x 14 = 224 px a side (at most 64 image tokens).
    return VisionArgs(dim=64, n_layers=2, n_heads=4, hidden_dim=128, patch_size=14, max_patches_per_side=16)


@dataclass
class VLMModelArgs(Qwen3ModelArgs):
    """The Qwen3 fields describe the language model (so TP checks and FLOP counts apply as is)."""

    vision: VisionArgs = field(default_factory=_debug_vision)
    spatial_merge_size: int = 2  # the merger turns merge x merge patches into one image token
    # The placeholder token that image features replace. Set from the tokenizer; only written
    # to config.json (the model itself is told where features go by ``vision_index``).
    image_token_id: int = 10
    projector_bias: bool = False  # biases of the projector's two linears (shipped Mistral3: none)

    RUNTIME_FIELDS: ClassVar[tuple[str, ...]] = (*Qwen3ModelArgs.RUNTIME_FIELDS, "image_token_id")
    # The language model's keys sit in the text_config of a Mistral3 config.json.
    HF_KEYS: ClassVar[Mapping[str, str]] = {
        **{name: f"text_config.{key}" for name, key in QWEN3_HF_KEYS.items()},
        "image_token_id": "image_token_index",
        "spatial_merge_size": "spatial_merge_size",
        "projector_bias": "multimodal_projector_bias",
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        name = self.field_names
        if not isinstance(self.vision, VisionArgs):
            raise ValueError(f"vision must be VisionArgs, got {type(self.vision).__name__}")
        merge = self.spatial_merge_size
        if isinstance(merge, bool) or not isinstance(merge, int) or merge < 1:
            raise name.error(f"{name('spatial_merge_size')} must be a positive int, got {merge!r}")
        token = self.image_token_id
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
            raise name.error(
                f"{name('image_token_id')} must be a token id in [0, {name('vocab_size')}={self.vocab_size}), "
                f"got {token!r}"
            )
        if not isinstance(self.projector_bias, bool):
            raise name.error(f"{name('projector_bias')} must be a bool, got {self.projector_bias!r}")

    def linear_flops_per_patch(self) -> float:
        """Forward FLOPs of one vision patch: through the vision encoder, then its share of the
        projector's merged token (merger, linear_1, linear_2); the merged token then costs a
        text token (``linear_flops_per_token``)."""
        vision, text, units = self.vision.dim, self.dim, self.spatial_merge_size**2
        projector = 2 * vision * vision + 2 * (vision * text + text * text) / units
        return self.vision.linear_flops_per_patch() + projector

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "VLMModelArgs":
        """Inverse of ``dataclasses.asdict``, which flattens the nested vision args to a dict."""
        d = dict(d)
        if isinstance(d.get("vision"), dict):
            d["vision"] = VisionArgs.from_dict(d["vision"])
        return cls(**d)

    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any], attn_backend: str = "sdpa_dense", source: str = "config.json"
    ) -> "VLMModelArgs":
        """The args of an HF ``Mistral3Config`` dict with a Pixtral vision and a Qwen3 text config.

        Fields this model cannot compute (another feature layer, activation or text model, a
        vision MLP that is not SwiGLU) are a ValueError naming ``source`` and the field. Missing
        optional fields default as in transformers 5's ``Mistral3Config`` / ``PixtralVisionConfig``.
        """
        if config.get("model_type") != "mistral3":
            raise ValueError(f"{source}: model_type is {config.get('model_type')!r}; expected 'mistral3'")
        text_config = hf_config_field(config, "text_config", dict, source)
        vision_config = hf_config_field(config, "vision_config", dict, source)
        text = Qwen3ModelArgs.from_hf_config(text_config, attn_backend, source=f"{source} text_config")
        if text.is_moe:
            raise ValueError(f"{source}: text_config is a Qwen3-MoE model; the VLM supports dense Qwen3 only")
        if hf_config_field(config, "projector_hidden_act", str, source, "gelu") != "gelu":
            raise ValueError(
                f"{source}: projector_hidden_act={config['projector_hidden_act']!r} is not supported (only 'gelu')"
            )
        if hf_config_field(config, "vision_feature_layer", int, source, -1) != -1:
            raise ValueError(
                f"{source}: vision_feature_layer={config['vision_feature_layer']!r} is not supported "
                "(only -1, the last vision layer)"
            )
        # transformers 5 ties the head by the top-level flag (default true), 4.x by the text
        # config's (default false): only a config on which both agree means one model.
        tied = hf_config_field(config, "tie_word_embeddings", bool, source, True)
        if tied != text.tie_embeddings:
            raise ValueError(
                f"{source}: tie_word_embeddings={tied} (top level, default true) disagrees with "
                f"text_config.tie_word_embeddings={text.tie_embeddings} (default false)"
            )
        return cls(
            **{f.name: getattr(text, f.name) for f in dataclasses.fields(Qwen3ModelArgs) if f.name != "source"},
            source=source,
            vision=_vision_from_hf(vision_config, attn_backend, f"{source} vision_config"),
            spatial_merge_size=hf_config_field(config, "spatial_merge_size", int, source, 2),
            image_token_id=hf_config_field(config, "image_token_index", int, source, config.get("image_token_id", 10)),
            projector_bias=hf_config_field(config, "multimodal_projector_bias", bool, source, False),
        )

    def to_hf_config(self, torch_dtype: str) -> dict[str, Any]:
        """``config.json`` of the equivalent HF ``Mistral3ForConditionalGeneration``.

        Every field is written: transformers' defaults differ from the shipped checkpoints
        (Pixtral's ``hidden_act`` defaults to gelu, the top-level ``tie_word_embeddings`` to true).
        """
        vision = self.vision
        if vision.norm_eps != 1e-5:
            raise ValueError(f"vision norm_eps={vision.norm_eps} has no HF equivalent (Pixtral hard-codes 1e-5)")
        text = super().to_hf_config(torch_dtype)
        del text["architectures"], text["torch_dtype"]  # top-level properties
        return {
            "architectures": ["Mistral3ForConditionalGeneration"],
            "model_type": "mistral3",
            "image_token_index": self.image_token_id,
            "projector_hidden_act": "gelu",
            "vision_feature_layer": -1,
            "multimodal_projector_bias": self.projector_bias,
            "spatial_merge_size": self.spatial_merge_size,
            "tie_word_embeddings": self.tie_embeddings,
            "text_config": text,
            "vision_config": {
                "model_type": "pixtral",
                "hidden_size": vision.dim,
                "num_hidden_layers": vision.n_layers,
                "num_attention_heads": vision.n_heads,
                "head_dim": vision.head_dim,
                "intermediate_size": vision.hidden_dim,
                "hidden_act": "silu",
                "num_channels": vision.num_channels,
                "patch_size": vision.patch_size,
                "image_size": vision.max_patches_per_side * vision.patch_size,
                "attention_dropout": 0.0,
                # Both spellings: transformers 4.x reads rope_theta, 5.x rope_parameters.
                "rope_theta": vision.rope_theta,
                "rope_parameters": {"rope_type": "axial", "rope_theta": vision.rope_theta},
            },
            "torch_dtype": torch_dtype,
        }


def with_image_token_id(args: VLMModelArgs, token_id: int, token: str) -> VLMModelArgs:
    """``args`` whose image placeholder is the tokenizer's id ``token_id`` of ``token`` (the string
    of model.image_token), which is what the data holds.

    When the args were read from a config.json (``args.source``) whose ``image_token_index`` is
    another id, that checkpoint was trained with another placeholder: warn, naming the file, the
    field, both ids and the token, rather than replace it silently.
    """
    if args.source and args.image_token_id != token_id:
        logger.warning(
            "%s: image_token_index=%d differs from the tokenizer's id %d of model.image_token %r; using %d",
            args.source,
            args.image_token_id,
            token_id,
            token,
            token_id,
        )
    return dataclasses.replace(args, image_token_id=token_id)


def _vision_from_hf(config: dict[str, Any], attn_backend: str, source: str) -> VisionArgs:
    if config.get("model_type") != "pixtral":
        raise ValueError(f"{source}: model_type is {config.get('model_type')!r}; only 'pixtral' is supported")
    # Transformers' Pixtral default is gelu, but shipped checkpoints (and our SwiGLU) are silu.
    hidden_act = hf_config_field(config, "hidden_act", str, source, "gelu")
    if hidden_act != "silu":
        raise ValueError(
            f"{source}: hidden_act={hidden_act!r} is not supported (only 'silu'; transformers defaults to 'gelu')"
        )
    if hf_config_field(config, "attention_dropout", float, source, 0.0) != 0.0:
        raise ValueError(f"{source}: attention_dropout={config['attention_dropout']!r} is not supported (only 0)")
    dim = hf_config_field(config, "hidden_size", int, source)
    n_heads = hf_config_field(config, "num_attention_heads", int, source)
    if "head_dim" in config and config["head_dim"] != dim // max(n_heads, 1):
        # transformers overwrites it with hidden_size // num_attention_heads.
        raise ValueError(f"{source}: head_dim={config['head_dim']!r} is not hidden_size / num_attention_heads")
    patch_size = hf_config_field(config, "patch_size", int, source)
    rope = config.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{source}: field 'rope_parameters' must be an object, got {rope!r}")
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"{source}: rope_parameters has rope_type={rope['rope_type']!r}; only 'axial' is supported")
    theta = rope.get("rope_theta", config.get("rope_theta", 10_000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ValueError(f"{source}: rope_theta must be a number, got {theta!r}")
    return VisionArgs(
        dim=dim,
        n_layers=hf_config_field(config, "num_hidden_layers", int, source),
        n_heads=n_heads,
        hidden_dim=hf_config_field(config, "intermediate_size", int, source),
        patch_size=patch_size,
        num_channels=hf_config_field(config, "num_channels", int, source, 3),
        rope_theta=float(theta),
        max_patches_per_side=hf_config_field(config, "image_size", int, source) // patch_size,
        attn_backend=attn_backend,
        source=source,
    )


def _on_qwen3(flavor: str, vision: VisionArgs) -> VLMModelArgs:
    return VLMModelArgs(**dataclasses.asdict(qwen3_flavors[flavor]), vision=vision)


vlm_flavors: dict[str, VLMModelArgs] = {
    # Tiny, for CPU tests and smoke runs: the Qwen3 debugmodel decoder (vocab 512).
    "debugmodel": _on_qwen3("debugmodel", _debug_vision()),
    # Mistral-Small-3.1's published Pixtral encoder (1540 px = 110 patches of 14 a side) on
    # Qwen3-0.6B's decoder (tied head; projector norm eps = Qwen3's rms_norm_eps 1e-6).
    "0.6B": _on_qwen3(
        "0.6B",
        VisionArgs(
            dim=1024,
            n_layers=24,
            n_heads=16,
            hidden_dim=4096,
            patch_size=14,
            rope_theta=10_000.0,
            max_patches_per_side=110,
        ),
    ),
}
