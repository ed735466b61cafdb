"""A run's config, parsed and fully checked before anything is built.

``ConfigManager`` checks each key's type and range and the rules among keys
(``config/validation.py``) without importing any other part of the package. The rules that need
a part's facts are stated by that part and run here: the task's keys (``rl.tasks``), the loss's
options (``losses.loss_fns``), the model's flavors and architecture (``models.config_checks``).
Every error is a ``ValueError`` naming the key.
"""

import importlib.util

from torchtitan_rl.config import ConfigManager, JobConfig
from torchtitan_rl.losses.loss_fns import ADVANTAGE_LOSS_FNS, loss_fn_from_config
from torchtitan_rl.losses.preference import PREFERENCE_LOSSES, preference_loss_from_config
from torchtitan_rl.models.config_checks import check_model_config
from torchtitan_rl.rl.tasks import check_task_settings


def parse_job_config(argv: list[str]) -> JobConfig:
    """The config of a command line (``--help`` prints the keys and exits), every rule checked."""
    job_config = ConfigManager().parse_args(argv)
    check_job_config(job_config)
    return job_config


# What job.recipe = "service" imports beyond the base install (pyproject's "service" extra).
SERVICE_MODULES = ("fastapi", "uvicorn", "tinker")


def check_job_config(cfg: JobConfig) -> None:
    """The rules on a parsed ``cfg`` that need the facts of the parts it configures."""
    if cfg.job.recipe == "service":
        missing = [name for name in SERVICE_MODULES if importlib.util.find_spec(name) is None]
        if missing:
            raise ValueError(
                f"job.recipe = 'service' needs {', '.join(missing)}, which this environment lacks: "
                "pip install -e '.[service]' (fastapi, uvicorn and tinker==0.38.0)"
            )
    if cfg.job.recipe == "grpo":
        if cfg.loss.loss_fn not in ADVANTAGE_LOSS_FNS:
            raise ValueError(
                f"loss.loss_fn: job.recipe = 'grpo' trains on advantages; choose one of "
                f"{', '.join(ADVANTAGE_LOSS_FNS)}, not {cfg.loss.loss_fn!r}"
            )
        check_task_settings(cfg.rl)
    if cfg.job.recipe == "dpo":
        preference_loss_from_config(cfg.loss)
    elif cfg.loss.loss_fn in PREFERENCE_LOSSES:
        raise ValueError(
            f"loss.loss_fn: {cfg.loss.loss_fn!r} is a preference loss; it trains with job.recipe = 'dpo', "
            f"not {cfg.job.recipe!r}"
        )
    else:
        loss_fn_from_config(cfg.loss)
    check_model_config(cfg)
