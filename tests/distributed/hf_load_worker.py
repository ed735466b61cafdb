"""Run under torchrun with 4 ranks: load HF checkpoints into sharded models and export them again.

Usage: torchrun --nproc_per_node=4 hf_load_worker.py CHECKPOINTS_DIR OUT_DIR
For each case, the model of layout (dp_replicate, dp_shard, cp, tp) is built and randomly
initialized as the trainer does it, then loaded from CHECKPOINTS_DIR/{checkpoint}, each time with
the root's parameters gathered as a forward without backward leaves them; rank 0 saves
the full parameters of every case to OUT_DIR/loaded.pt, and each case's export goes to OUT_DIR/{case}.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from layout_cases import full
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.distributed.utils import init_distributed
from torchtitan_rl.hf_checkpoint import load_hf_weights, read_hf_model_args, save_hf_checkpoint
from torchtitan_rl.models.qwen3.state_dict_adapter import to_hf
from torchtitan_rl.recipes.base import build_model

WORLD_SIZE = 4
EXPORT_SHARD_BYTES = 20_000  # several shard files, so every rank takes part in several gathers
# case -> (checkpoint, layout). "divisible" divides by tp = 4; "odd" gives uneven FSDP shards
# of the TP shards (_StridedShard with a remainder) and is tied.
CASES = {
    "divisible_dp4": ("divisible", (1, 4, 1, 1)),
    "divisible_dp2_tp2": ("divisible", (1, 2, 1, 2)),
    "divisible_tp4": ("divisible", (1, 1, 1, 4)),
    "divisible_hsdp2x2": ("divisible", (2, 2, 1, 1)),
    "divisible_cp2_tp2": ("divisible", (1, 1, 2, 2)),
    "odd_dp4": ("odd", (1, 4, 1, 1)),
    "odd_dp2_tp2": ("odd", (1, 2, 1, 2)),
    "moe_dp4": ("moe", (1, 4, 1, 1)),
    "moe_dp2_tp2": ("moe", (1, 2, 1, 2)),
    "moe_hsdp2x2": ("moe", (2, 2, 1, 1)),
    "moe_cp2_tp2": ("moe", (1, 1, 2, 2)),
}


def gather_root(model) -> None:
    """The state a forward without backward leaves: the root's parameters gathered (unsharded)."""
    if isinstance(model, FSDPModule):
        model.unshard()


def main(checkpoints: str, out: str) -> None:
    rank, world_size, device = init_distributed(120)
    assert world_size == WORLD_SIZE, world_size
    loaded = {}
    for case, (checkpoint, layout) in CASES.items():
        path = os.path.join(checkpoints, checkpoint)
        dims = ParallelDims(*layout, world_size=world_size)
        dims.build_meshes("cpu")
        model = build_model(
            read_hf_model_args(path), parallel_dims=dims, device=device, seed=0, param_dtype=torch.float32
        )
        gather_root(model)
        load_hf_weights(model, path)
        loaded[case] = to_hf({fqn: full(p) for fqn, p in model.named_parameters()})
        gather_root(model)
        save_hf_checkpoint(model, os.path.join(out, case), torch.float32, max_shard_bytes=EXPORT_SHARD_BYTES)
    if rank == 0:
        torch.save(loaded, os.path.join(out, "loaded.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
