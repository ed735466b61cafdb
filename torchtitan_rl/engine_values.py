"""The engine of a critic (PPO's learned value function): a model with a scalar head read at
every token (``Qwen3ModelArgs.score_head``, the reward model's head), its values and the
gradient of its value loss, exact under any layout.

A token's value is read at its input position, so it is aligned with the token's label like a
log-prob: the value of the state from which the policy sampled that label. Under sequence
parallelism each tensor-parallel rank holds a contiguous chunk of the micro-batch's tokens, and
under context parallelism each rank a share of every sequence; the value loss is per token, so
each rank weighs the tokens it holds with the reduction mode's weights from global counts
(``losses.reduction``) and backpropagates ``Σ_t w_t ℓ_t`` over them, and FSDP and the
replicated head's tensor-parallel reduction add the ranks' gradients up: the sum is the
one-process full-batch loss's gradient whatever the layout.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.fsdp import FSDPModule

from torchtitan_rl.data.packing import MicroBatch
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.fsdp import reshard
from torchtitan_rl.engine_scores import ScoreEngine
from torchtitan_rl.losses.reduction import GROUPED_MODES, global_counts, token_weights
from torchtitan_rl.losses.value import value_losses
from torchtitan_rl.models.attention import AttentionContext

VALUE_INPUTS = ("returns", "old_values")


@dataclass
class ValueMetrics:
    """Sums over the tokens this rank holds of one ``value_forward_backward`` (device tensors);
    summed over every training rank (``reduce``) they are the mini-batch's."""

    loss: torch.Tensor  # Σ w_t ℓ_t, times the value coefficient: the critic's loss
    num_clipped: torch.Tensor  # loss tokens where value clipping holds the value
    num_loss_tokens: torch.Tensor

    def reduce(self, group: dist.ProcessGroup | None) -> dict[str, float]:
        """``critic/vf_loss`` and ``critic/vf_clipfrac`` (verl's meanings) over every rank of
        ``group`` (the training ranks; None: the default group, or this process alone)."""
        sums = torch.stack([self.loss, self.num_clipped, self.num_loss_tokens]).double().cpu()
        if dist.is_initialized():
            dist.all_reduce(sums, group=group)
        loss, num_clipped, num_loss_tokens = sums.tolist()
        return {"critic/vf_loss": loss, "critic/vf_clipfrac": num_clipped / max(num_loss_tokens, 1.0)}


class CriticEngine(ScoreEngine):
    """``ScoreEngine`` whose model is read at every token: ``values`` and
    ``value_forward_backward`` take the place of ``scores`` and ``score_backward``."""

    @torch.no_grad()
    def values(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Each sample's per-token values (float32 ``[len(sample)]`` on the CPU, aligned with its
        labels), in the samples' order. Collective over the training ranks."""
        batch = self._agree(self._prepare(samples, ()))
        tp_mesh = self.parallel_dims.mesh("tp")
        per_token = []
        for mb, attention in zip(batch.shares, batch.attention):
            own = self._token_values(mb.to(self.device), attention)
            if tp_mesh is not None:
                # Sequence parallel: the ranks' equal chunks, in rank order, are the share's tokens.
                own = funcol.wait_tensor(funcol.all_gather_tensor(own, 0, tp_mesh))
            per_token.append(own[:, None])
        # The root keeps its parameters gathered after a forward; with no backward, release them.
        reshard(self.model)
        # Copies, not views of the packed buffer: a sample's values may be pickled alone.
        return [values[:, 0].clone() for values in self._per_sample(batch, per_token)]

    def value_forward_backward(self, samples: list[Sample], clip: float, value_coef: float = 1.0) -> ValueMetrics:
        """Accumulate the gradient of ``value_coef · Σ_t w_t ℓ_t``, the value loss ℓ
        (``losses.value``, clipped around ``old_values`` when ``clip`` > 0) of every sample's loss
        tokens against its ``returns``, with the engine's reduction mode's weights. Collective."""
        inputs = VALUE_INPUTS + (("group_id",) if self.options.reduction in GROUPED_MODES else ())
        batch = self._agree(self._prepare(samples, inputs))
        counts = global_counts(batch.local_counts, self.parallel_dims.mesh("batch"), self.device)
        shard = self.model.shard_tokens
        sums = torch.zeros(3, device=self.device, dtype=torch.float64)
        for i, (mb, attention) in enumerate(zip(batch.shares, batch.attention)):
            if isinstance(self.model, FSDPModule):
                # Accumulate unsharded gradients locally; reduce-scatter their sum once.
                self.model.set_requires_gradient_sync(i == len(batch.shares) - 1)
            mb = mb.to(self.device)
            values = self._token_values(mb, attention)
            weights = shard(token_weights(mb, self.options.reduction, counts, self.options.horizon))
            losses, clipped = value_losses(values, shard(mb.returns), shard(mb.old_values), clip)
            loss = value_coef * (weights * losses).sum()
            loss.backward()
            mask = shard(mb.loss_mask)
            sums += torch.stack([loss.detach().double(), (clipped & mask).sum().double(), mask.sum().double()])
        return ValueMetrics(*sums)

    def _token_values(self, mb: MicroBatch, attention: AttentionContext | None) -> torch.Tensor:
        """The values (float32) of the tokens of the device-resident share ``mb`` this rank's
        residual stream holds."""
        with self._autocast():
            hidden, _ = self._forward(mb, attention)
            return self.model.score(hidden)[:, 0].float()
