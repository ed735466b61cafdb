"""Qwen3 dense model hyper-parameters and the published flavors."""

from dataclasses import dataclass

from torchtitan_rl.models.attention import ATTN_BACKEND_CHOICES


@dataclass
class Qwen3ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int  # SwiGLU inner size
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_embeddings: bool = False
    max_seq_len: int = 40960
    attn_backend: str = "sdpa_dense"

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.attn_backend not in ATTN_BACKEND_CHOICES:
            raise ValueError(
                f"unknown attn_backend {self.attn_backend!r}; valid: "
                f"{', '.join(ATTN_BACKEND_CHOICES)}"
            )


def _published(dim, n_layers, n_heads, hidden_dim, tie_embeddings) -> Qwen3ModelArgs:
    # Shared by every released Qwen3 dense model (config.json on the hub).
    return Qwen3ModelArgs(
        vocab_size=151936,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        head_dim=128,
        hidden_dim=hidden_dim,
        norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_embeddings=tie_embeddings,
        max_seq_len=40960,
    )


qwen3_flavors: dict[str, Qwen3ModelArgs] = {
    # Tiny, for CPU tests and smoke runs.
    "debugmodel": Qwen3ModelArgs(
        vocab_size=512,
        dim=128,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        hidden_dim=384,
        rope_theta=1_000_000.0,
        tie_embeddings=False,
        max_seq_len=2048,
    ),
    "0.6B": _published(dim=1024, n_layers=28, n_heads=16, hidden_dim=3072, tie_embeddings=True),
    "1.7B": _published(dim=2048, n_layers=28, n_heads=16, hidden_dim=6144, tie_embeddings=True),
    "4B": _published(dim=2560, n_layers=36, n_heads=32, hidden_dim=9728, tie_embeddings=True),
    "8B": _published(dim=4096, n_layers=36, n_heads=32, hidden_dim=12288, tie_embeddings=False),
}
