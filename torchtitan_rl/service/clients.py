"""Training clients of the service: several LoRA clients on one base model, each with its own
adapters, gradients and AdamW state, swapped into the one model the ranks hold.

The model carries adapters of rank ``lora.rank`` (the largest a client may ask for) on every
layer of ``lora.target_modules``. A client of rank r uses the first r rows of each A and the first
r columns of each B; the rest, and the adapters of layers the client does not train (its
``train_attn`` / ``train_mlp`` / ``train_unembed``), stay exactly zero: with A and B both zero past
r, their gradients are zero, and so are AdamW's moments and updates (weight decay of a zero is
zero). So a client computes what a model with rank-r adapters on its layers alone computes, on
any parallel layout, and its scale ``lora_alpha / r`` is set on every adapted layer while it is
active.

Swapping copies a client's adapter values into the model's parameters (local shards, no
collective), and hands the model its gradients and the optimizer its state by reference.
"""

import math
import re
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan_rl.models.lora import adapted_module_name, is_adapter_key, lora_modules
from torchtitan_rl.models.qwen3.model import param_seed
from torchtitan_rl.service.operations import UserError

# Which of the family's LoRA targets each of Tinker's switches covers.
ATTENTION_TARGETS = ("wq", "wk", "wv", "wo")
MLP_TARGETS = ("w1", "w2", "w3")
UNEMBED_TARGETS = ("output",)


@dataclass(frozen=True)
class LoRAClientConfig:
    """A client's ``lora_config``."""

    rank: int
    seed: int
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


@dataclass
class ClientState:
    config: LoRAClientConfig
    base_model: str
    values: dict[str, torch.Tensor]  # adapter name -> its values (DTensor or tensor, like the parameter)
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    optimizer_state: dict[str, dict] = field(default_factory=dict)  # adapter name -> AdamW state


def _targets_of(config: LoRAClientConfig) -> tuple[str, ...]:
    return (
        (ATTENTION_TARGETS if config.train_attn else ())
        + (MLP_TARGETS if config.train_mlp else ())
        + (UNEMBED_TARGETS if config.train_unembed else ())
    )


def _set_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a whole tensor into a (possibly sharded) parameter: each rank keeps its shard."""
    if isinstance(param, DTensor):
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(full)


class ClientPool:
    """The service's training clients on ``model`` (adapters of ``max_rank`` on the layers of
    ``target_modules``, the family's ``lora_targets`` patterns) and its ``optimizer``."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_rank: int,
        lora_alpha: float,
        target_modules: tuple[str, ...],
        lora_targets: dict[str, str],
    ):
        self.model = model
        self.optimizer = optimizer
        self.max_rank = max_rank
        self.lora_alpha = lora_alpha
        self.target_modules = target_modules
        self.params = {name: p for name, p in model.named_parameters() if is_adapter_key(name)}
        self._patterns = {name: re.compile(lora_targets[name]) for name in target_modules}
        self.clients: dict[str, ClientState] = {}
        self.active: str | None = None

    def check_config(self, config: LoRAClientConfig) -> None:
        if not 1 <= config.rank <= self.max_rank:
            raise UserError(f"lora_config.rank: {config.rank} is outside 1..{self.max_rank} (the service's lora.rank)")
        wanted = _targets_of(config)
        if not wanted:
            raise UserError("lora_config: train_attn, train_mlp and train_unembed are all false: nothing trains")
        missing = [t for t in wanted if t not in self.target_modules]
        if missing:
            switch = {"output": "train_unembed", **dict.fromkeys(MLP_TARGETS, "train_mlp")}.get(
                missing[0], "train_attn"
            )
            raise UserError(
                f"lora_config.{switch}: the service adapts only {', '.join(self.target_modules)} "
                f"(lora.target_modules), not {', '.join(missing)}; set {switch} = false"
            )

    def _trains(self, config: LoRAClientConfig, adapter: str) -> bool:
        module = adapted_module_name(adapter)
        return any(self._patterns[t].fullmatch(module) for t in _targets_of(config))

    @torch.no_grad()
    def fresh_values(self, config: LoRAClientConfig) -> dict[str, torch.Tensor]:
        """A new client's adapters: A as PEFT's default init (uniform, bound 1/sqrt(in)) in its
        first ``rank`` rows, drawn whole from a generator seeded by the client's seed and the
        name (so on any layout), zero elsewhere; B zero."""
        values = {}
        for name, param in self.params.items():
            full = torch.zeros(param.shape, dtype=param.dtype)
            if name.endswith(".lora_a.weight") and self._trains(config, name):
                generator = torch.Generator().manual_seed(param_seed(config.seed, name))
                bound = 1.0 / math.sqrt(param.shape[1])
                full[: config.rank].uniform_(-bound, bound, generator=generator)
            value = param.detach().clone()
            _set_full(value, full.to((param.to_local() if isinstance(param, DTensor) else param).device))
            values[name] = value
        return values

    def add(self, model_id: str, config: LoRAClientConfig, base_model: str, values=None) -> ClientState:
        self.check_config(config)
        state = ClientState(config, base_model, values if values is not None else self.fresh_values(config))
        self.clients[model_id] = state
        return state

    def get(self, model_id: str) -> ClientState:
        if model_id not in self.clients:
            raise UserError(f"model_id: no training client {model_id!r} on this service")
        return self.clients[model_id]

    @torch.no_grad()
    def activate(self, model_id: str) -> ClientState:
        """Make ``model_id`` the model's adapters, gradients and optimizer state."""
        state = self.get(model_id)
        if self.active == model_id:
            return state
        if self.active is not None:
            self._stash(self.clients[self.active])
        for name, param in self.params.items():
            param.copy_(state.values[name])
            param.grad = state.grads.pop(name, None)
            if name in state.optimizer_state:
                self.optimizer.state[param] = state.optimizer_state.pop(name)
        scale = self.lora_alpha / state.config.rank
        for module in lora_modules(self.model).values():
            module.scale = scale
        self.active = model_id
        return state

    def _stash(self, state: ClientState) -> None:
        for name, param in self.params.items():
            state.values[name].copy_(param)
            state.grads[name] = param.grad
            param.grad = None
            if param in self.optimizer.state:
                state.optimizer_state[name] = self.optimizer.state.pop(param)

    def adapter_values(self, model_id: str) -> dict[str, torch.Tensor]:
        """The client's current adapters (the parameters themselves while it is active)."""
        state = self.get(model_id)
        return dict(self.params) if self.active == model_id else state.values

    def set_hyperparameters(self, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
        for group in self.optimizer.param_groups:
            group.update(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
