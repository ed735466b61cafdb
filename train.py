"""Entry point: torchrun --nproc_per_node=N train.py --job.config_file train_configs/X.toml [--a.b v ...]"""

import logging
import sys
import traceback

from torchtitan_rl.config import JobConfig
from torchtitan_rl.distributed.utils import PeerFailedError, shutdown_distributed
from torchtitan_rl.recipes import get_recipe
from torchtitan_rl.recipes.base import describe_os_error
from torchtitan_rl.recipes.config_checks import parse_job_config
from torchtitan_rl.recipes.estimate import estimate_report
from torchtitan_rl.rl.plugins import UserCodeError


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    # A bare --estimate is short for --estimate.enable true.
    argv = ["--estimate.enable", "true"] + [a for a in argv if a != "--estimate"] if "--estimate" in argv else argv
    try:
        job_config = parse_job_config(argv)
        if job_config.estimate.enable:
            # No process group, no weights: the model is only built on the meta device.
            print(estimate_report(job_config))
            return 0
    except ValueError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    status = 1
    try:
        status = run(job_config)
    finally:
        # Only now is the recipe unreferenced, so its meshes and groups can really go, while
        # the interpreter is whole (see shutdown_distributed).
        shutdown_distributed(clean=status == 0)
        # Whatever comes after (interpreter shutdown) must not lose the last lines.
        sys.stdout.flush()
        sys.stderr.flush()
    return status


def run(job_config: JobConfig) -> int:
    """Build, set up, train and close the recipe; 0, 2 for a user mistake found on the way, 1
    when the user's own code raised (its traceback printed) or another rank failed."""
    recipe = None
    try:
        recipe = get_recipe(job_config.job.recipe)(job_config)
        recipe.setup()
        recipe.train()
    except ValueError as err:
        # User mistakes found while building (layouts, data, tokenizer): no traceback noise.
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        # A path of the config that cannot be used (a cache directory that is a file, a
        # missing permission): the message names the keys it came from.
        print(f"error: {describe_os_error(err, job_config)}", file=sys.stderr)
        return 2
    except UserCodeError as err:
        # The user's environment, task or reward raised (a ValueError too): its traceback is
        # the user's frames, the message what was called on which problem.
        traceback.print_exception(err.__cause__, file=sys.stderr)
        print(f"error: {err}", file=sys.stderr)
        return 1
    except PeerFailedError as err:
        # That rank printed its own traceback; here, which rank and why.
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        if recipe is not None:
            recipe.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
