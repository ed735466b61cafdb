"""Entry point: torchrun --nproc_per_node=N train.py --job.config_file train_configs/X.toml [--a.b v ...]"""

import logging
import sys

from torchtitan_rl.config import ConfigManager, JobConfig
from torchtitan_rl.distributed.utils import shutdown_distributed
from torchtitan_rl.rl.trainer import GRPOTrainer
from torchtitan_rl.trainer import SFTTrainer

RECIPES = {"sft": SFTTrainer, "grpo": GRPOTrainer}


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    try:
        job_config = ConfigManager().parse_args(argv)
    except ValueError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    status = 1
    try:
        status = run(job_config)
    finally:
        # Only now is the trainer unreferenced, so its meshes and groups can really go, while
        # the interpreter is whole (see shutdown_distributed).
        shutdown_distributed(clean=status == 0)
        # Whatever comes after (interpreter shutdown) must not lose the last lines.
        sys.stdout.flush()
        sys.stderr.flush()
    return status


def run(job_config: JobConfig) -> int:
    """Build, train and close the recipe; 0, or 2 for a user mistake found on the way."""
    trainer = None
    try:
        trainer = RECIPES[job_config.job.recipe](job_config)
        trainer.train()
    except ValueError as err:
        # User mistakes found while building (layouts, data, tokenizer): no traceback noise.
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if trainer is not None:
            trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
