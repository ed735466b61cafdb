"""Low-rank adapters (LoRA) beside frozen base weights: plain single-device PyTorch.

An adapted linear layer computes ``x W^T (+ b) + scale * B A dropout(x)`` with ``A [rank, in]``
and ``B [out, rank]``, ``scale = alpha / rank`` (PEFT's convention). The base weight keeps its
name (``layers.0.attention.wq.weight``), the adapters sit beside it as ``...wq.lora_a.weight``
and ``...wq.lora_b.weight``, so a checkpoint of the base loads into an adapted model unchanged
and the model files know nothing of LoRA. Which layers can be adapted is the model family's
business (``ModelSpec.lora_targets``); tensor parallel shards adapters after their base layer
(``models.lora_parallel``).
"""

import contextlib
import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ADAPTER_SUFFIXES = (".lora_a.weight", ".lora_b.weight")
LORA_INITS = ("kaiming", "gaussian")


@dataclass(frozen=True)
class LoRASettings:
    """What the adapters are: ``rank``, ``alpha`` (scale = alpha / rank), ``dropout`` on the
    adapter's input, the family's ``target_modules`` names, the init of A (``kaiming``: uniform
    with PEFT's default bound 1/sqrt(in); ``gaussian``: normal with std 1/rank; B is zero either
    way, so an adapted model starts as its base), whether the input embedding trains too, and
    the storage dtype of the adapted layers' frozen base weights."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
    init: str = "kaiming"
    train_embeddings: bool = False
    base_dtype: torch.dtype = torch.float32

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus a low-rank update ``scale * lora_b(lora_a(dropout(x)))``.

    A subclass, so code that asks for a linear layer (and its ``weight`` / ``bias``) still gets
    the base one. The base weight may be stored in another dtype than the activations (a frozen
    bfloat16 base, ``lora.base_dtype``): it is cast on the fly.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, settings: LoRASettings, device=None):
        super().__init__(in_features, out_features, bias=bias, device=device)
        self.lora_a = nn.Linear(in_features, settings.rank, bias=False, device=device)
        self.lora_b = nn.Linear(settings.rank, out_features, bias=False, device=device)
        self.scale = settings.scale
        self.dropout = settings.dropout
        # False runs the base layer alone (the reference policy of RL, see ``adapters_disabled``).
        self.adapters_enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
            bias = None if bias is None else bias.to(x.dtype)
        out = F.linear(x, weight, bias)
        if not self.adapters_enabled:
            return out
        if self.dropout > 0:
            x = F.dropout(x, self.dropout, self.training)
        return out + self.lora_b(self.lora_a(x)) * self.scale


def effective_weight(linear: nn.Linear) -> torch.Tensor:
    """The weight ``linear`` applies, for code that multiplies by it directly instead of calling
    it (the chunked output head of the loss): with adapters on, ``W + scale * B A``, through
    which the gradient reaches A and B. Adapter dropout cannot be folded into a weight, which
    is why the output head takes no dropout (config validation)."""
    if isinstance(linear, LoRALinear) and linear.adapters_enabled:
        weight = linear.weight
        delta = (linear.lora_b.weight @ linear.lora_a.weight) * linear.scale
        return (weight if weight.dtype == delta.dtype else weight.to(delta.dtype)) + delta
    return linear.weight


def is_adapter_key(fqn: str) -> bool:
    """Whether ``fqn`` names an adapter parameter (not a base weight)."""
    return fqn.endswith(ADAPTER_SUFFIXES)


def adapted_module_name(fqn: str) -> str:
    """``layers.0.attention.wq`` for ``layers.0.attention.wq.lora_a.weight``."""
    assert is_adapter_key(fqn), fqn
    return fqn.rsplit(".", 2)[0]


def add_adapters(model: nn.Module, settings: LoRASettings, lora_targets: dict[str, str]) -> list[str]:
    """Replace the linear layers that ``settings.target_modules`` names by ``LoRALinear`` (same
    base parameters), freeze everything but the adapters (and the input embedding with
    ``train_embeddings``, and a score head), and return the adapted modules' names in order.

    ``lora_targets``: the family's target names -> a regular expression matching the full names
    of the modules each one adapts. Call on the meta device, before any parallelism or wrapper.
    """
    patterns = []
    for name in settings.target_modules:
        if name not in lora_targets:
            raise ValueError(
                f"lora.target_modules: {name!r} is not a layer this model can adapt; valid: {', '.join(lora_targets)}"
            )
        patterns.append(re.compile(lora_targets[name]))
    args = model.args
    if "output" in settings.target_modules and args.tie_embeddings:
        raise ValueError(
            "lora.target_modules: 'output' cannot be adapted when the model ties the output head to the input "
            "embedding (tie_word_embeddings): merging the adapter would change the embedding too"
        )
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and any(p.fullmatch(name) for p in patterns)
    ]
    model.requires_grad_(False)
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        adapted = LoRALinear(
            linear.in_features, linear.out_features, linear.bias is not None, settings, device=linear.weight.device
        )
        adapted.weight, adapted.bias = (
            None if p is None else nn.Parameter(p.to(settings.base_dtype), requires_grad=False)
            for p in (linear.weight, linear.bias)
        )
        adapted.lora_a.requires_grad_(True)
        adapted.lora_b.requires_grad_(True)
        setattr(parent, child, adapted)
    if settings.train_embeddings:
        model.tok_embeddings.weight.requires_grad_(True)
    if getattr(args, "score_head", False):
        # A score head (a critic's) is new: there is no base for adapters to adapt, so it trains.
        model.score.requires_grad_(True)
    return [name for name, _ in targets]


@torch.no_grad()
def init_adapter_(fqn: str, tensor: torch.Tensor, generator: torch.Generator, init: str) -> None:
    """Initialize adapter ``fqn`` (full shape) from ``generator``: A by ``init``, B zeros."""
    if fqn.endswith(".lora_b.weight"):
        tensor.zero_()
    elif init == "kaiming":
        # kaiming_uniform_ with a = sqrt(5), nn.Linear's and PEFT's default: bound 1/sqrt(in).
        bound = 1.0 / math.sqrt(tensor.shape[1])
        tensor.uniform_(-bound, bound, generator=generator)
    elif init == "gaussian":
        tensor.normal_(0.0, 1.0 / tensor.shape[0], generator=generator)
    else:
        raise ValueError(f"lora.init: {init!r} is not one of {', '.join(LORA_INITS)}")


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, LoRALinear)}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Run ``model`` as its base: every adapter is skipped inside the block."""
    modules = list(lora_modules(model).values())
    for module in modules:
        module.adapters_enabled = False
    try:
        yield
    finally:
        for module in modules:
            module.adapters_enabled = True


def merged_weight(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """``base + scale * B A`` (full tensors), computed in float32 and returned in base's dtype."""
    delta = (lora_b.float() @ lora_a.float()) * scale
    return (base.float() + delta).to(base.dtype)
