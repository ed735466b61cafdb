"""The rules on a ``JobConfig`` that depend on the model: ``model.flavor`` names a flavor of
``model.name``, and keys that only a vision or a mixture-of-experts architecture reads are set
only for one. A named flavor is checked right after parsing (``check_model_config``); the
architecture of ``model.flavor = "hf"`` once its config.json is read (``check_model_settings``,
whose errors then name that file). Every error is a ``ValueError`` naming the key.
"""

from torchtitan_rl.config.validation import HF_FLAVOR, non_default_keys
from torchtitan_rl.distributed.pipeline import num_stages_of
from torchtitan_rl.models.registry import get_model_spec, spec_for_args

# Keys that only a model with a vision tower reads.
_VISION_KEYS = (
    ("model", ("freeze_vision", "image_token", "image_break_token", "image_end_token")),
    ("training", ("max_patches_per_microbatch", "max_image_tokens")),
)


def check_model_config(cfg) -> None:
    """``model.flavor`` and the architecture's keys; nothing yet for ``model.flavor = "hf"``."""
    spec = get_model_spec(cfg.model.name)
    if cfg.model.flavor == HF_FLAVOR:
        return
    if cfg.model.flavor not in spec.flavors:
        raise ValueError(
            f"model.flavor: unknown flavor {cfg.model.flavor!r} for model.name "
            f"{cfg.model.name!r}; choose one of {', '.join(map(repr, [*spec.flavors, HF_FLAVOR]))}"
        )
    check_model_settings(cfg, spec.flavors[cfg.model.flavor])


def check_model_settings(cfg, model_args) -> None:
    """The checks that depend on the model's architecture (vision keys, MoE keys). Errors about
    args read from a config.json (``model_args.source``) name that file and its fields."""
    source = model_args.source
    if spec_for_args(model_args).takes_images:
        _check_vision_model(cfg, model_args.spatial_merge_size, source)
    else:
        _check_no_vision_keys(cfg)
    _check_moe(cfg, model_args, source)
    _check_pipeline_model(cfg, model_args, source)


def _check_pipeline_model(cfg, model_args, source: str) -> None:
    """The models pipeline parallel splits: dense text models with an output head of their own,
    whose layers fill the stages the schedule runs."""
    p = cfg.parallelism
    if p.pipeline_parallel_degree == 1:
        return
    model = source or f"model.flavor={cfg.model.flavor!r}"
    pp = f"parallelism.pipeline_parallel_degree = {p.pipeline_parallel_degree}"
    if model_args.tie_embeddings:
        raise ValueError(
            f"{pp}: {model} ties the output head to the token embeddings, which the first and the last pipeline "
            "stage would both need; use a model without tied embeddings"
        )
    num_stages_of(model_args.n_layers, p.pipeline_parallel_degree, p.pipeline_schedule, p.pipeline_layers_per_stage)


def _check_moe(cfg, model_args, source: str) -> None:
    is_moe = model_args.is_moe
    score_model = None  # the key that asks for a model with a score head
    if cfg.job.recipe == "reward_model":
        score_model = "job.recipe = 'reward_model'"
    elif cfg.job.recipe == "grpo" and cfg.rl.advantage == "gae":
        score_model = "rl.advantage = 'gae' (its critic)"
    if is_moe and score_model:
        # A score head's engine has no router losses (engine_scores.ScoreEngine).
        model = source or f"model.flavor={cfg.model.flavor!r}"
        raise ValueError(
            f"{score_model}: a score model with mixture-of-experts layers is not supported ({model}); "
            "use a dense flavor"
        )
    ep = cfg.parallelism.expert_parallel_degree
    if ep > 1 and not is_moe:
        model = f"{source} describes a dense model" if source else f"model.flavor={cfg.model.flavor!r} is dense"
        raise ValueError(f"parallelism.expert_parallel_degree={ep}: {model}; expert parallel needs a MoE model")
    if ep > 1 and model_args.num_experts % ep != 0:
        where = f" of {source}" if source else f" of model.flavor={cfg.model.flavor!r}"
        raise ValueError(
            f"parallelism.expert_parallel_degree={ep} does not divide num_experts={model_args.num_experts}{where}"
        )
    replay = cfg.moe.router_replay
    if replay != "off" and cfg.job.recipe != "grpo":
        raise ValueError(
            f"moe.router_replay = {replay!r}: routing replay carries the experts of the GRPO recipe's sampler to its "
            f"trainer; job.recipe = {cfg.job.recipe!r} samples nothing"
        )
    if cfg.moe.router_replay_prompt and replay == "off":
        raise ValueError("moe.router_replay_prompt: records the prompt's routing for moe.router_replay, which is 'off'")
    unused = non_default_keys(cfg.moe)
    if unused and not is_moe:
        model = (
            f"{source} describes a dense model (num_experts is 0 or absent)"
            if source
            else f"model.flavor={cfg.model.flavor!r} has no experts (a dense model)"
        )
        raise ValueError(f"moe.{unused[0]}: {model}; choose a MoE flavor such as 'debugmodel_moe' or remove the key")


def _check_no_vision_keys(cfg) -> None:
    for section, keys in _VISION_KEYS:
        values, defaults = getattr(cfg, section), type(getattr(cfg, section))()
        unused = [key for key in keys if getattr(values, key) != getattr(defaults, key)]
        if unused:
            raise ValueError(f"{section}.{unused[0]}: only used by a vision-language model (model.name = 'vlm')")


def _check_vision_model(cfg, merge_size: int, source: str) -> None:
    tokens = [cfg.model.image_token, cfg.model.image_break_token, cfg.model.image_end_token]
    if len(set(tokens)) != 3 or not all(tokens):
        raise ValueError(
            f"model.image_token / image_break_token / image_end_token: must be three different non-empty strings, "
            f"got {tokens}"
        )
    t = cfg.training
    largest_image = t.max_image_tokens * merge_size * merge_size
    if 0 < t.max_patches_per_microbatch < largest_image:
        origin = f", spatial_merge_size of {source}" if source else ""
        raise ValueError(
            f"training.max_patches_per_microbatch: must be 0 or >= {largest_image} so any image fits "
            f"(training.max_image_tokens={t.max_image_tokens} feature tokens of {merge_size}x{merge_size} "
            f"patches{origin}), got {t.max_patches_per_microbatch}"
        )
