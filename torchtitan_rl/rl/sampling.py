"""Sampling one token per row: the parameters, each row's random stream, and the draw.

Row (prompt index p, sample index s) of a step draws its uniforms from its own CPU
``torch.Generator`` seeded with ``rollout_seed(seed, step, p, s)`` and picks its token by inverse
CDF, so what a row samples depends only on its logits and its own stream, never on the rows
beside it.
"""

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")


def rollout_seed(seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """Seed of one rollout's generator: the first 8 bytes (little-endian) of the SHA-256 of
    ``"{seed}:{step}:{prompt_index}:{sample_index}"``, cut to 63 bits.

    A cryptographic hash rather than arithmetic on the indices, so that neighbouring rollouts
    get unrelated streams; unlike Python's ``hash()`` it is the same in every process.
    """
    digest = hashlib.sha256(f"{seed}:{step}:{prompt_index}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [R], logprobs [R])`` from ``logits [R, V]`` and one uniform in [0, 1) per row.

    The log-prob is of the full (untruncated) tempered distribution, the one the trainer
    evaluates; top-k / top-p only restrict which tokens can be drawn.
    """
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
        logprobs = logits.log_softmax(dim=-1)
    else:
        scaled = logits / params.temperature
        tokens = _inverse_cdf(_truncated_probs(scaled, params.top_k, params.top_p), uniforms)
        logprobs = scaled.log_softmax(dim=-1)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def _truncated_probs(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """softmax(scaled) restricted to the top-k tokens, then to the nucleus of mass top_p
    (unnormalized: the inverse CDF scales by the total)."""
    if 0 < top_k < scaled.shape[-1]:
        # Tokens tied with the k-th logit are kept too: which of them topk returns is arbitrary.
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix of the sorted tokens whose mass reaches top_p.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    return probs


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token whose CDF interval (vocabulary order, float64) holds ``uniform * total``."""
    cdf = probs.double().cumsum(dim=-1)
    targets = uniforms.double()[:, None] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    # Rounding can put a target at the total; never step past the last drawable token.
    last_drawable = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
    return torch.minimum(tokens, last_drawable)
