"""Entry point: torchrun --nproc_per_node=N train.py --job.config_file train_configs/X.toml [--a.b v ...]"""

import logging
import sys

from torchtitan_rl.config import ConfigManager
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
