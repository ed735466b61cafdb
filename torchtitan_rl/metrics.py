"""Step metrics: exact global reductions, a stdout line and TensorBoard scalars (docs/design.md, 'Metrics')."""

import logging
import resource

import torch
from torch.utils.tensorboard import SummaryWriter

from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.distributed.utils import all_reduce
from torchtitan_rl.losses.loss_fns import ForwardBackwardMetrics
from torchtitan_rl.losses.reduction import NUM_LOSS_TOKENS, NUM_TOKENS
from torchtitan_rl.losses.router import RouterMetrics

logger = logging.getLogger(__name__)

# The rl/* values the stdout line shows (all of them go to TensorBoard).
_STDOUT_RL = (
    "reward_mean",
    "pass@1",
    "response_length_mean",
    "pg_loss",
    "kl",
    "entropy",
    "clipfrac",
    "logprob_diff_max",
)

# Other recipes' values the stdout line shows (preference learning, PPO's critic).
_STDOUT_OTHER = ("rewards/accuracies", "rewards/margins", "critic/vf_loss", "critic/vf_explained_var")

# Dense bf16 peak FLOP/s; MFU is only reported for devices listed here.
_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


def _peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in _PEAK_FLOPS.items() if key in name), None)


def tokens_per_rank(counts: torch.Tensor, ep: int) -> torch.Tensor:
    """Top-k assignments per expert ``[..., E]`` summed over the experts each ep rank owns
    (``[..., ep]``, rank p owning the p-th run of E / ep experts): the tokens each rank of an
    expert-parallel group computes, summed over the groups."""
    return counts.unflatten(-1, (ep, -1)).sum(-1)


class MetricsLogger:
    """Turns device-resident step results into logged numbers, on log steps only.

    ``log`` is the only place that synchronizes with the host; the reductions below follow
    docs/design.md, 'Metrics': loss pieces are summed over the ``loss`` mesh, counts were already summed
    over ``batch`` by the engine, TP replicas are never summed.
    """

    def __init__(
        self,
        parallel_dims: ParallelDims,
        device: torch.device,
        rank: int,
        *,
        tb_folder: str | None,
        num_params: int,
        flops_per_token_context: int,
    ):
        self.parallel_dims = parallel_dims
        self.device = device
        self.rank = rank
        self.num_params = num_params
        # Attention FLOPs of a token grow with its context: 6 * layers * heads * head_dim
        # per (query, key) pair counts forward + backward of the two attention matmuls.
        self.flops_per_token_context = flops_per_token_context
        self.peak_flops = _peak_flops(device)
        self.writer = SummaryWriter(tb_folder) if (tb_folder and rank == 0) else None

    def log(
        self,
        step: int,
        *,
        fb: ForwardBackwardMetrics,
        optim: dict,
        window_tokens: torch.Tensor,
        window_squared_lens: torch.Tensor,
        window_seconds: float,
        data_stats: dict[str, int],
    ) -> dict[str, float]:
        """Reduce one update's results and write the step's line and scalars."""
        values = self.reduce_update(fb, optim)
        if fb.router is not None:
            router_values, counts = self.reduce_router(fb.router)
            values.update(router_values)
            self.write_expert_histograms(step, fb.router.layer_ids, counts)
        return self.emit(
            step,
            values,
            window_tokens=window_tokens,
            window_squared_lens=window_squared_lens,
            window_seconds=window_seconds,
            data_stats=data_stats,
        )

    def reduce_router(self, router: RouterMetrics) -> tuple[dict[str, float], torch.Tensor]:
        """A MoE step's router values (collective over every rank: each holds other tokens, TP
        ranks included) and the step's top-k counts ``[L, E]`` of the whole mini-batch.

        ``moe/aux_loss`` and ``moe/z_loss`` (unweighted) when their coefficient is on;
        ``moe/load_imbalance/layer_{i}``: the busiest expert's count over the mean count; with
        routing replay ``moe/routing_agreement`` (and ``/layer_{i}``): the share of the recorded
        top-k choices that the trainer's own routing also made."""
        # One collective for the losses, the counts and the agreement counts.
        agreement = router.agreement if router.agreement is not None else router.counts.new_zeros(0, 2)
        packed = torch.cat(
            [
                torch.stack([router.aux_loss, router.z_loss]),
                router.counts.flatten().float(),
                agreement.flatten().float(),
            ]
        )
        packed = all_reduce(packed, "sum", self.parallel_dims.mesh("world"))
        losses, counts = packed[:2], packed[2 : 2 + router.counts.numel()].view_as(router.counts)
        values = {}
        if router.agreement is not None:
            matched, compared = packed[2 + router.counts.numel() :].view(-1, 2).double().unbind(-1)
            # Nothing compared (no recorded token in the step): no value rather than a made-up one.
            if float(compared.sum()) > 0:
                values["moe/routing_agreement"] = float(matched.sum() / compared.sum())
                for layer, m, c in zip(router.layer_ids, matched.tolist(), compared.tolist()):
                    values[f"moe/routing_agreement/layer_{layer}"] = m / c
        if router.config.aux_loss_coef > 0:
            values["moe/aux_loss"] = float(losses[0])
        if router.config.z_loss_coef > 0:
            values["moe/z_loss"] = float(losses[1])
        imbalance = counts.max(-1).values / counts.mean(-1).clamp(min=1e-9)
        for layer, value in zip(router.layer_ids, imbalance.tolist()):
            values[f"moe/load_imbalance/layer_{layer}"] = value
        if self.parallel_dims.ep > 1:
            per_rank = tokens_per_rank(counts, self.parallel_dims.ep)
            imbalance = per_rank.max(-1).values / per_rank.mean(-1).clamp(min=1e-9)
            for layer, value in zip(router.layer_ids, imbalance.tolist()):
                values[f"moe/rank_imbalance/layer_{layer}"] = value
        return values, counts

    def write_expert_histograms(self, step: int, layer_ids: tuple[int, ...], counts: torch.Tensor) -> None:
        """TensorBoard histograms of the tokens each expert received and, under expert
        parallel, of the tokens each ep rank's experts received, per MoE layer (rank 0)."""
        if self.writer is None:
            return
        for layer, layer_counts in zip(layer_ids, counts.double().cpu()):
            self._write_count_histogram(f"moe/tokens_per_expert/layer_{layer}", layer_counts, step)
            if self.parallel_dims.ep > 1:
                per_rank = tokens_per_rank(layer_counts, self.parallel_dims.ep)
                self._write_count_histogram(f"moe/tokens_per_rank/layer_{layer}", per_rank, step)

    def _write_count_histogram(self, tag: str, counts: torch.Tensor, step: int) -> None:
        # One bucket per index (expert or rank) holding its count.
        index = torch.arange(counts.numel(), dtype=torch.float64)
        self.writer.add_histogram_raw(
            tag,
            min=0.0,
            max=float(counts.numel() - 1),
            num=float(counts.sum()),
            sum=float((index * counts).sum()),
            sum_squares=float((index**2 * counts).sum()),
            bucket_limits=(index + 0.5).tolist(),
            bucket_counts=counts.tolist(),
            global_step=step,
        )

    def reduce_update(self, fb: ForwardBackwardMetrics, optim: dict, with_terms: bool = True) -> dict[str, float]:
        """The global values of one ``forward_backward`` + ``optim_step`` (collective; syncs the
        host); ``with_terms=False`` leaves out the loss's ``rl/*`` terms (reduced by the caller)."""
        loss_mesh = self.parallel_dims.mesh("loss")
        reduced = {
            "loss_metrics/global_avg_loss": all_reduce(fb.loss, "sum", loss_mesh),
            "loss_metrics/global_max_loss": all_reduce(fb.max_seq_loss, "max", loss_mesh),
            "grad_norm": optim["grad_norm"],
            "tokens/loss_tokens": fb.counts[NUM_LOSS_TOKENS],
            "tokens/total": fb.counts[NUM_TOKENS],
        }
        if with_terms:
            reduced.update(fb.terms.reduce(loss_mesh))
        values = {tag: float(v) for tag, v in reduced.items()}
        if values["loss_metrics/global_max_loss"] == -float("inf"):
            values["loss_metrics/global_max_loss"] = 0.0  # no sequence has a loss token
        values["lr"] = float(optim["lr"])
        return values

    def emit(
        self,
        step: int,
        values: dict[str, float],
        *,
        window_tokens: torch.Tensor | float,
        window_squared_lens: torch.Tensor | float,
        window_seconds: float,
        data_stats: dict[str, int],
    ) -> dict[str, float]:
        """Add throughput, memory and data counters to ``values``; print the line, write TensorBoard."""
        values = dict(values)
        world_size = self.parallel_dims.world_size
        num_tokens = float(window_tokens)
        values["throughput(tps)"] = num_tokens / window_seconds / world_size
        if self.peak_flops is not None:
            flops = 6 * self.num_params * num_tokens + self.flops_per_token_context * float(window_squared_lens)
            values["mfu(%)"] = 100 * flops / window_seconds / world_size / self.peak_flops
        if self.device.type == "cuda":
            memory_tag = "memory/max_active(GiB)"
            values[memory_tag] = torch.cuda.memory_stats(self.device)["active_bytes.all.peak"] / 2**30
        else:
            memory_tag = "memory/peak_rss(GiB)"
            values[memory_tag] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
        for key, count in data_stats.items():
            values[f"data/{key}"] = float(count)

        if self.rank == 0:
            rl = "".join(f"  {name}: {values['rl/' + name]:.4g}" for name in _STDOUT_RL if "rl/" + name in values)
            rl += "".join(f"  {tag[4:]}: {values[tag]:.4g}" for tag in ("moe/aux_loss", "moe/z_loss") if tag in values)
            rl += "".join(f"  {tag.split('/')[1]}: {values[tag]:.4g}" for tag in _STDOUT_OTHER if tag in values)
            logger.info(
                "step: %d  loss: %.5f  max_loss: %.4f  grad_norm: %.4f  lr: %.3e  tps: %.0f  memory: %.2fGiB%s%s",
                step,
                values["loss_metrics/global_avg_loss"],
                values["loss_metrics/global_max_loss"],
                values["grad_norm"],
                values["lr"],
                values["throughput(tps)"],
                values[memory_tag],
                f"  mfu: {values['mfu(%)']:.2f}%" if "mfu(%)" in values else "",
                rl,
            )
        self.write_scalars(step, values)
        return values

    def write_scalars(self, step: int, values: dict[str, float]) -> None:
        """TensorBoard only (rank 0)."""
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
