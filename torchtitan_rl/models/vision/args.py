"""Hyper-parameters of the Pixtral vision encoder."""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torchtitan_rl.models.attention import ATTN_BACKEND_CHOICES
from torchtitan_rl.models.qwen3.args import FieldNames

# Key of each field in the vision_config of an HF Mistral3 config.json (Pixtral).
PIXTRAL_HF_KEYS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "hidden_dim": "intermediate_size",
    "patch_size": "patch_size",
    "num_channels": "num_channels",
    "rope_theta": "rope_theta",
    "max_patches_per_side": "image_size / patch_size",
}


@dataclass
class VisionArgs:
    dim: int
    n_layers: int
    n_heads: int
    hidden_dim: int  # SwiGLU inner size
    patch_size: int  # pixels per patch side
    num_channels: int = 3
    # Pixtral hard-codes 1e-5 for every vision norm (ln_pre and the blocks' norms).
    norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    # Largest image side in patches (HF ``image_size // patch_size``). The 2-D RoPE would work
    # beyond it, but the model was never trained there: longer sides are a data-pipeline bug.
    max_patches_per_side: int = 16
    attn_backend: str = "sdpa_dense"
    # Where the args were read from (e.g. "<dir>/config.json vision_config"), for errors; empty
    # for a named flavor (see qwen3.args.Qwen3ModelArgs.source).
    source: str = field(default="", compare=False, repr=False)

    # Not properties of the weights (see qwen3.args.architecture_differences).
    RUNTIME_FIELDS: ClassVar[tuple[str, ...]] = ("attn_backend", "source")
    HF_KEYS: ClassVar[Mapping[str, str]] = PIXTRAL_HF_KEYS

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def field_names(self) -> FieldNames:
        return FieldNames(self.source, self.HF_KEYS)

    def __post_init__(self) -> None:
        # Named "vision <field>" unless read from a file, whose vision_config the source names.
        name = self.field_names
        prefix = "" if self.source else "vision "
        for key in ("dim", "n_layers", "n_heads", "hidden_dim", "patch_size", "num_channels", "max_patches_per_side"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise name.error(f"{prefix}{name(key)} must be a positive int, got {value!r}")
        if self.dim % self.n_heads != 0:
            raise name.error(f"{prefix}{name('dim')}={self.dim} must be a multiple of {name('n_heads')}={self.n_heads}")
        if self.head_dim % 4 != 0:
            # Axial RoPE gives rows and columns head_dim / 4 frequencies each.
            raise name.error(
                f"{prefix}head_dim = {name('dim')} / {name('n_heads')} = {self.head_dim} must be a multiple of 4"
            )
        for key in ("norm_eps", "rope_theta"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise name.error(f"{prefix}{name(key)} must be a positive number, got {value!r}")
        if self.attn_backend not in ATTN_BACKEND_CHOICES:
            raise ValueError(
                f"unknown vision attn_backend {self.attn_backend!r}; valid: {', '.join(ATTN_BACKEND_CHOICES)}"
            )

    def linear_flops_per_patch(self) -> int:
        """Forward FLOPs (2 per multiply-add) of one patch through the weight matrices: the patch
        embedding and every block's attention projections (four dim x dim) and SwiGLU."""
        block = 2 * (4 * self.dim * self.dim + 3 * self.dim * self.hidden_dim)
        return 2 * self.patch_dim * self.dim + self.n_layers * block

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch vector, ``num_channels * patch_size**2``."""
        return self.num_channels * self.patch_size**2

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "VisionArgs":
        return cls(**d)
