import dataclasses
import inspect
import re
import typing
from dataclasses import dataclass, field

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from torchtitan_rl.config import ConfigManager, JobConfig, config_to_dict, job_config, write_resolved_config
from torchtitan_rl.distributed.fsdp import RESHARD_POLICIES
from torchtitan_rl.recipes.config_checks import parse_job_config


def parse(*argv):
    """What train.py parses: the config's own rules and those of the parts it configures."""
    return parse_job_config(list(argv))


def write(tmp_path, text, name="recipe.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def assert_error(argv, *fragments, manager=None):
    with pytest.raises(ValueError) as info:
        manager.parse_args(list(argv)) if manager else parse(*argv)
    for fragment in fragments:
        assert fragment in str(info.value)


# --- precedence -------------------------------------------------------------------------


def test_defaults():
    cfg = parse()
    assert cfg == JobConfig()
    assert cfg.training.steps == 200
    assert cfg.optimizer.lr == 8e-4
    assert cfg.parallelism.data_parallel_shard_degree == -1
    assert cfg.loss.horizon is None
    assert cfg.metrics.enable_tensorboard is True


def test_toml_overrides_defaults_and_cli_overrides_toml(tmp_path):
    path = write(
        tmp_path,
        '[training]\nsteps = 50\nseq_len = 64\n[optimizer]\nlr = 1e-3\n[model]\nflavor = "0.6B"\n',
    )
    cfg = parse("--job.config_file", path, "--training.steps", "7", "--optimizer.beta1=0.5")
    assert cfg.job.config_file == path
    assert cfg.training.steps == 7  # CLI beats TOML
    assert cfg.training.seq_len == 64  # TOML beats default
    assert cfg.optimizer.lr == 1e-3
    assert cfg.optimizer.beta1 == 0.5
    assert cfg.model.flavor == "0.6B"
    assert cfg.training.global_batch_size == 8  # untouched default


def test_cli_order_does_not_matter_for_config_file(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 50\n")
    cfg = parse("--training.steps", "7", "--job.config_file", path)
    assert cfg.training.steps == 7


def test_last_cli_override_wins():
    assert parse("--training.steps", "3", "--training.steps=4").training.steps == 4


def test_string_value_may_contain_equals_and_dashes():
    cfg = parse("--job.description=a=b --c", "--training.dataset_path", "-x.jsonl")
    assert cfg.job.description == "a=b --c"
    assert cfg.training.dataset_path == "-x.jsonl"


def test_negative_int_is_a_value_not_a_flag():
    cfg = parse("--parallelism.data_parallel_shard_degree", "-1", "--debug.seed", "-5")
    assert cfg.parallelism.data_parallel_shard_degree == -1
    assert cfg.debug.seed == -5


# --- value parsing ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("true", True),
        ("True", True),
        ("1", True),
        ("yes", True),
        ("YES", True),
        ("false", False),
        ("FALSE", False),
        ("0", False),
        ("no", False),
    ],
)
def test_cli_booleans(text, expected):
    assert parse("--debug.deterministic", text).debug.deterministic is expected
    assert parse(f"--metrics.enable_tensorboard={text}").metrics.enable_tensorboard is expected


def test_bare_boolean_flag_means_true():
    cfg = parse("--debug.deterministic", "--checkpoint.enable")
    assert cfg.debug.deterministic is True
    assert cfg.checkpoint.enable is True


def test_bad_boolean():
    assert_error(["--debug.deterministic", "maybe"], "debug.deterministic", "maybe")


def test_int_accepted_for_float():
    cfg = parse("--optimizer.lr", "1")
    assert cfg.optimizer.lr == 1.0 and type(cfg.optimizer.lr) is float


def test_toml_int_accepted_for_float(tmp_path):
    cfg = parse("--job.config_file", write(tmp_path, "[training]\nmax_norm = 2\n"))
    assert cfg.training.max_norm == 2.0 and type(cfg.training.max_norm) is float


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--training.steps", "ten"], "training.steps"),
        (["--training.steps", "1.5"], "training.steps"),
        (["--optimizer.lr", "fast"], "optimizer.lr"),
        (["--optimizer.lr", "nan"], "optimizer.lr"),
        (["--training.max_norm", "inf"], "training.max_norm"),
        (["--loss.horizon", "big"], "loss.horizon"),
    ],
)
def test_cli_wrong_type(argv, key):
    assert_error(argv, key, argv[1])


@pytest.mark.parametrize(
    "toml, key",
    [
        ('[training]\nsteps = "10"\n', "training.steps"),
        ("[training]\nsteps = 1.0\n", "training.steps"),
        ("[metrics]\nenable_tensorboard = 1\n", "metrics.enable_tensorboard"),
        ("[training]\nsteps = true\n", "training.steps"),
        ("[optimizer]\nlr = true\n", "optimizer.lr"),
        ("[job]\ndump_folder = 3\n", "job.dump_folder"),
        ("[optimizer]\nlr = nan\n", "optimizer.lr"),
    ],
)
def test_toml_wrong_type(tmp_path, toml, key):
    path = write(tmp_path, toml)
    assert_error(["--job.config_file", path], key, path)


def test_literal_not_allowed_lists_choices(tmp_path):
    assert_error(
        ["--model.attn_backend", "flash"],
        "model.attn_backend",
        "'flash'",
        "'auto'",
        "'sdpa_dense'",
        "'sdpa_loop'",
        "'flex'",
    )
    assert_error(
        ["--job.config_file", write(tmp_path, '[loss]\nreduction = "mean"\n')],
        "loss.reduction",
        "'token_mean'",
        "'token_mean_legacy'",
    )


def test_literal_values_accepted():
    cfg = parse("--loss.reduction", "seq_mean_token_sum_norm", "--lr_scheduler.decay_type=cosine")
    assert cfg.loss.reduction == "seq_mean_token_sum_norm"
    assert cfg.lr_scheduler.decay_type == "cosine"


def test_fsdp_reshard_after_forward_policies(tmp_path):
    key = "parallelism.fsdp_reshard_after_forward"
    assert parse().parallelism.fsdp_reshard_after_forward == "default"
    for policy in ("always", "never", "default"):
        assert parse(f"--{key}", policy).parallelism.fsdp_reshard_after_forward == policy
    toml = write(tmp_path, '[parallelism]\nfsdp_reshard_after_forward = "never"\n')
    assert parse("--job.config_file", toml).parallelism.fsdp_reshard_after_forward == "never"
    # The config's values are the policies FSDP knows (distributed/fsdp.py asserts on others).
    field_type = {f.name: f.type for f in dataclasses.fields(job_config.Parallelism)}["fsdp_reshard_after_forward"]
    assert set(typing.get_args(field_type)) == set(RESHARD_POLICIES)
    assert_error([f"--{key}", "sometimes"], key, "'sometimes'", "'default'", "'always'", "'never'")
    bad = write(tmp_path, "[parallelism]\nfsdp_reshard_after_forward = false\n", name="bad.toml")
    assert_error(["--job.config_file", bad], key)


def test_optional_none_resets(tmp_path):
    path = write(tmp_path, '[loss]\nreduction = "seq_mean_token_sum_norm"\nhorizon = 64\n')
    assert parse("--job.config_file", path).loss.horizon == 64
    assert parse("--job.config_file", path, "--loss.horizon", "none").loss.horizon is None
    assert parse("--loss.horizon", "None").loss.horizon is None
    assert parse("--job.config_file", path, "--loss.horizon", "128").loss.horizon == 128


# A config class of its own, to test list parsing generically.
@dataclass
class Lists:
    """List-typed keys."""

    ints: list[int] = field(default_factory=list)
    """Some ints."""

    strs: list[str] = field(default_factory=lambda: ["x"])
    """Some strings."""

    floats: list[float] = field(default_factory=list)
    """Some floats."""

    maybe: list[int] | None = None
    """Maybe some ints."""


@dataclass
class ListConfig:
    lists: Lists = field(default_factory=Lists)


@pytest.mark.parametrize(
    "key, text, expected",
    [
        ("ints", "1,2,3", [1, 2, 3]),
        ("ints", "[1, 2]", [1, 2]),
        ("ints", "[1, 2,]", [1, 2]),
        ("ints", " 4 ", [4]),
        ("ints", "", []),
        ("ints", "[]", []),
        ("strs", "a,b", ["a", "b"]),
        ("strs", '["a", "b c"]', ["a", "b c"]),
        ("strs", "['a']", ["a"]),
        ("floats", "0.5,1", [0.5, 1.0]),
        ("maybe", "none", None),
        ("maybe", "7,8", [7, 8]),
    ],
)
def test_cli_lists(key, text, expected):
    cfg = ConfigManager(ListConfig).parse_args([f"--lists.{key}", text])
    assert getattr(cfg.lists, key) == expected
    assert cfg == ListConfig(dataclasses.replace(Lists(), **{key: expected}))


def test_bad_list_element():
    assert_error(["--lists.ints", "1,x"], "lists.ints", "'x'", manager=ConfigManager(ListConfig))
    assert_error(["--lists.floats", "[1, a]"], "lists.floats", manager=ConfigManager(ListConfig))


def test_list_config_cls_has_no_job_section():
    assert_error(["--job.config_file", "x.toml"], "'job'", manager=ConfigManager(ListConfig))


def test_unsupported_field_type_is_a_programming_error():
    @dataclass
    class Bad:
        table: dict = field(default_factory=dict)

    @dataclass
    class BadConfig:
        bad: Bad = field(default_factory=Bad)

    with pytest.raises(TypeError, match="bad.table"):
        ConfigManager(BadConfig)


# --- ranges and cross-field checks -------------------------------------------------------


@pytest.mark.parametrize(
    "key, bad",
    [
        ("optimizer.lr", "0"),
        ("optimizer.lr", "-1e-3"),
        ("optimizer.beta1", "1"),
        ("optimizer.beta1", "-0.1"),
        ("optimizer.beta2", "1.0"),
        ("optimizer.eps", "0"),
        ("optimizer.weight_decay", "-0.01"),
        ("lr_scheduler.warmup_steps", "-1"),
        ("lr_scheduler.min_lr_factor", "1.5"),
        ("lr_scheduler.min_lr_factor", "-0.5"),
        ("training.steps", "0"),
        ("training.seq_len", "1"),
        ("training.global_batch_size", "0"),
        ("training.max_tokens_per_microbatch", "-1"),
        ("training.max_norm", "-1"),
        ("training.num_synthetic_samples", "0"),
        ("parallelism.data_parallel_replicate_degree", "0"),
        ("parallelism.data_parallel_shard_degree", "0"),
        ("parallelism.data_parallel_shard_degree", "-2"),
        ("parallelism.tensor_parallel_degree", "0"),
        ("parallelism.context_parallel_degree", "0"),
        ("loss.horizon", "0"),
        ("loss.logits_chunk_size", "0"),
        ("metrics.log_freq", "0"),
        ("comm.collective_timeout_seconds", "0"),
        ("comm.silent_peer_timeout_seconds", "0"),
    ],
)
def test_out_of_range(key, bad):
    assert_error([f"--{key}", bad], key, "must be")


def test_range_checked_for_toml_values(tmp_path):
    path = write(tmp_path, "[optimizer]\nlr = -1.0\n")
    assert_error(["--job.config_file", path], "optimizer.lr", "> 0")


@pytest.mark.parametrize(
    "key, edge, expected",
    [
        ("optimizer.beta1", "0", 0.0),
        ("optimizer.weight_decay", "0", 0.0),
        ("lr_scheduler.min_lr_factor", "1", 1.0),
        ("lr_scheduler.warmup_steps", "0", 0),
        ("training.seq_len", "2", 2),
        ("training.max_norm", "0", 0.0),
        ("parallelism.data_parallel_shard_degree", "-1", -1),
        ("parallelism.data_parallel_shard_degree", "3", 3),
        ("metrics.log_freq", "1", 1),
    ],
)
def test_range_edges_accepted(key, edge, expected):
    section, name = key.split(".")
    assert getattr(getattr(parse(f"--{key}", edge), section), name) == expected


def test_unknown_reduction_lists_valid_modes():
    assert_error(["--loss.reduction", "mean"], "loss.reduction", "token_mean", "sequence_mean", "token_mean_legacy")


def test_activation_checkpoint_settings():
    cfg = parse("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_every", "3")
    assert (cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_every) == ("selective", 3)
    assert_error(["--activation_checkpoint.mode", "op"], "activation_checkpoint.mode", "'selective'")
    assert_error(["--activation_checkpoint.selective_every", "0"], "activation_checkpoint.selective_every")


# --- structural errors -------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--trainig.steps", "3"], ["'trainig'", "did you mean 'training.steps'?"]),
        (["--training.stpes", "3"], ["'training.stpes'", "did you mean 'training.steps'?"]),
        (["--training.lr", "3"], ["'training.lr'", "did you mean 'optimizer.lr'?"]),
        (["--steps", "3"], ["'steps'", "did you mean 'training.steps'?"]),
        (["--optimzer.beta_1=0.1"], ["'optimzer'", "did you mean 'optimizer.beta1'?"]),
    ],
)
def test_unknown_key_on_cli_suggests(argv, fragments):
    assert_error(argv, *fragments)


@pytest.mark.parametrize(
    "old, new",
    [
        ("comm.init_timeout_seconds", "comm.collective_timeout_seconds"),
        ("comm.rollout_timeout_seconds", "comm.silent_peer_timeout_seconds"),
    ],
)
def test_a_renamed_key_names_its_successor_on_the_cli_and_in_toml(tmp_path, old, new):
    assert_error([f"--{old}", "60"], f"'{old}' is now '{new}'")
    section, _, name = old.partition(".")
    path = write(tmp_path, f"[{section}]\n{name} = 60\n")
    assert_error(["--job.config_file", path], f"'{old}' is now '{new}'", path)
    assert getattr(parse(f"--{new}", "60").comm, new.partition(".")[2]) == 60


def test_unknown_key_with_no_close_match_has_no_suggestion():
    with pytest.raises(ValueError) as info:
        parse("--zzzz.qqqqqq", "1")
    assert "'zzzz.qqqqqq'" in str(info.value) and "did you mean" not in str(info.value)


@pytest.mark.parametrize(
    "toml, fragments",
    [
        ("[training]\nstesp = 3\n", ["'training.stesp'", "did you mean 'training.steps'?"]),
        ("[trainig]\nsteps = 3\n", ["'trainig'", "did you mean 'training'?"]),
        ("[trainig]\n", ["'trainig'", "did you mean 'training'?"]),
        ("steps = 3\n", ["'steps'", "did you mean 'training.steps'?"]),
        ("training = 3\n", ["training", "table"]),
        ("[training.sub]\nx = 1\n", ["'training.sub'"]),
    ],
)
def test_unknown_key_in_toml_suggests(tmp_path, toml, fragments):
    path = write(tmp_path, toml)
    assert_error(["--job.config_file", path], *fragments, path)


def test_missing_toml_file(tmp_path):
    path = str(tmp_path / "nope.toml")
    assert_error(["--job.config_file", path], "job.config_file", path)


def test_toml_syntax_error_names_file(tmp_path):
    path = write(tmp_path, "[training\nsteps = \n")
    assert_error(["--job.config_file", path], "job.config_file", path, "TOML")


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--training.steps"], "training.steps"),
        (["--training.steps", "--optimizer.lr", "1"], "training.steps"),
        (["--job.config_file"], "job.config_file"),
        (["--loss.horizon"], "loss.horizon"),
    ],
)
def test_override_missing_value(argv, key):
    assert_error(argv, key, "missing its value")


@pytest.mark.parametrize(
    "argv, junk",
    [
        (["train.toml"], "'train.toml'"),
        (["--training.steps", "3", "extra"], "'extra'"),
        (["-x"], "'-x'"),
        (["--"], "'--'"),
    ],
)
def test_positional_junk(argv, junk):
    assert_error(argv, junk, "--section.key")


# --- help --------------------------------------------------------------------------------


def _docstrings_by_regex() -> dict[str, str]:
    """section.key -> docstring, read from job_config.py's text without using ast."""
    src = inspect.getsource(job_config)
    docs = {}
    for f in dataclasses.fields(JobConfig):
        body = re.search(rf"^class {f.type.__name__}\b.*?(?=^class |\Z)", src, re.M | re.S)
        fields = re.findall(r'^    (\w+): .*?\n    """(.*?)"""', body.group(0), re.M | re.S)
        for name, doc in fields:
            docs[f"{f.name}.{name}"] = doc
    return docs


def test_every_field_has_a_docstring():
    docs = _docstrings_by_regex()
    expected = {f"{s.name}.{k.name}" for s in dataclasses.fields(JobConfig) for k in dataclasses.fields(s.type)}
    assert set(docs) == expected
    assert all(doc.strip() for doc in docs.values())


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_field_with_its_docstring(capsys, flag):
    with pytest.raises(SystemExit) as info:
        parse("--training.steps", "3", flag)
    assert info.value.code == 0
    out = capsys.readouterr().out
    docs = _docstrings_by_regex()
    # Split the help into one block per "  --section.key" line.
    blocks = dict(re.findall(r"^  --(\S+)  (.*?)(?=^  --|^\[|\Z)", out, re.M | re.S))
    assert list(blocks) == list(docs)
    for key, doc in docs.items():
        header, _, text = blocks[key].partition("\n")
        assert " ".join(text.split()) == " ".join(doc.split()), key
    for section in (f.name for f in dataclasses.fields(JobConfig)):
        assert re.search(rf"^\[{section}\] \S", out, re.M)
    # Type, default and range are shown in TOML spelling.
    assert blocks["training.steps"].startswith("int = 200  (must be > 0)\n")
    assert blocks["loss.horizon"].startswith("Optional[int] = none  (must be > 0)\n")
    assert blocks["metrics.enable_tensorboard"].startswith("bool = true\n")
    assert blocks["lr_scheduler.decay_type"].startswith('"linear" | "cosine" = "linear"\n')


# --- resolved config ---------------------------------------------------------------------


def test_config_to_dict():
    d = config_to_dict(parse("--training.steps", "9"))
    assert d["training"]["steps"] == 9
    assert d["loss"]["horizon"] is None
    assert list(d) == [f.name for f in dataclasses.fields(JobConfig)]
    assert set(d["optimizer"]) == {"name", "lr", "beta1", "beta2", "eps", "weight_decay", "implementation"}


def test_resolved_config_round_trip(tmp_path):
    recipe = write(tmp_path, '[training]\nsteps = 11\n[model]\nflavor = "1.7B"\n')
    cfg = parse(
        "--job.config_file",
        recipe,
        "--job.description",
        'quote " backslash \\ newline \n tab \t del \x7f ünï',
        "--loss.horizon",
        "300",
        "--loss.reduction",
        "seq_mean_token_sum_norm",
        "--loss.loss_fn",
        "ppo",
        "--loss.dual_clip_c",
        "3",
        "--loss.clip_low",
        "0.2",
        "--loss.clip_high",
        "0.28",
        "--metrics.enable_tensorboard",
        "false",
        "--optimizer.eps",
        "1e-12",
        "--optimizer.lr",
        "3",
        "--parallelism.data_parallel_shard_degree",
        "2",
    )
    out = str(tmp_path / "dump" / "config.toml")
    write_resolved_config(cfg, out)

    with open(out, "rb") as f:
        on_disk = tomllib.load(f)
    assert on_disk == config_to_dict(cfg)  # horizon, dual_clip_c and the clip bounds are set: nothing is left out

    reloaded = parse("--job.config_file", out)
    # config_file names the file actually loaded; everything else comes back unchanged.
    assert reloaded == dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, config_file=out))
    assert type(reloaded.optimizer.lr) is float


def test_resolved_config_of_defaults_omits_none(tmp_path):
    out = str(tmp_path / "config.toml")
    write_resolved_config(JobConfig(), out)
    with open(out, "rb") as f:
        on_disk = tomllib.load(f)
    assert "horizon" not in on_disk["loss"]
    expected = JobConfig()
    expected.job.config_file = out
    assert parse("--job.config_file", out) == expected


def test_resolved_lists_round_trip(tmp_path):
    manager = ConfigManager(ListConfig)
    argv = ["--lists.ints", "1,2", "--lists.strs", 'a,"b"', "--lists.floats", "2"]
    cfg = manager.parse_args(argv)
    out = str(tmp_path / "lists.toml")
    write_resolved_config(cfg, out)
    with open(out, "rb") as f:
        assert tomllib.load(f) == {"lists": {"ints": [1, 2], "strs": ["a", "b"], "floats": [2.0]}}
