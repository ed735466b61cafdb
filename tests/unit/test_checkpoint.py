"""CheckpointManager in one process: what is saved and restored, completeness, pruning, bad input."""

import dataclasses
import json
import os
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan_rl.checkpoint import DESCRIPTION_FILE, CheckpointManager, TrainState, step_folders
from torchtitan_rl.config.job_config import Checkpoint
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.hf_checkpoint import load_hf_weights, save_hf_checkpoint
from torchtitan_rl.models.lora import LoRASettings
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs
from torchtitan_rl.models.qwen3.model import Qwen3Model
from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
from torchtitan_rl.recipes.base import build_model

ARGS = Qwen3ModelArgs(vocab_size=32, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, hidden_dim=24)


class Loader:
    """Stands in for the data loader: its position must round-trip."""

    def __init__(self, position: int = 0):
        self.position = position

    def state_dict(self):
        return {"position": self.position, "epoch": 2}

    def load_state_dict(self, state):
        self.position = state["position"]


def build(
    dump: str, seed: int = 0, args: Qwen3ModelArgs = ARGS, lora: LoRASettings | None = None, merged=False, **config
):
    if lora is None:
        model = Qwen3Model(args)
        model.init_weights(seed)
    else:
        dims = ParallelDims(1, 1, 1, 1, world_size=1)
        dims.build_meshes("cpu")
        model = build_model(
            args, parallel_dims=dims, device=torch.device("cpu"), seed=seed, param_dtype=torch.float32, lora=lora
        )
    optimizer = build_optimizer(model, 1e-2, 0.9, 0.95, 1e-8, 0.1)
    scheduler = build_lr_scheduler(optimizer, 10, 2, "linear", 0.0)
    state = TrainState()
    loader = Loader()
    manager = CheckpointManager(
        Checkpoint(enable=True, **config),
        dump_folder=dump,
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        dataloader=loader,
        train_state=state,
        model_args=args,
        lora=lora,
        export_merged=merged,
        seed=seed,
    )
    return manager, model, optimizer, scheduler, loader, state


def train_steps(model, optimizer, scheduler, num: int) -> None:
    tokens = torch.arange(12) % ARGS.vocab_size
    for _ in range(num):
        hidden = model(tokens, torch.arange(12), torch.zeros(12, dtype=torch.long))
        model.output(hidden).logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


def test_save_and_resume_restore_every_piece(tmp_path):
    manager, model, optimizer, scheduler, loader, state = build(str(tmp_path), interval=2)
    train_steps(model, optimizer, scheduler, 2)
    loader.position, state.step, state.tokens_seen = 17, 2, torch.tensor(345)
    torch.manual_seed(99)
    manager.maybe_save(2, last=False)
    expected_rng = torch.get_rng_state()
    expected_next_lr = scheduler.get_last_lr()
    saved_params = {k: v.clone() for k, v in model.state_dict().items()}
    saved_moments = {k: v["exp_avg"].clone() for k, v in optimizer.state_dict()["state"].items()}

    # A fresh run (other init, other RNG) resumes exactly where the first one stood.
    torch.manual_seed(0)
    fresh, model2, optimizer2, scheduler2, loader2, state2 = build(str(tmp_path), seed=5, interval=2)
    assert fresh.load() is True
    assert (state2.step, state2.tokens_seen, loader2.position) == (2, 345, 17)
    assert torch.equal(torch.get_rng_state(), expected_rng)
    assert scheduler2.get_last_lr() == expected_next_lr
    for k, v in model2.state_dict().items():
        assert torch.equal(v, saved_params[k]), k
    for k, v in optimizer2.state_dict()["state"].items():
        assert torch.equal(v["exp_avg"], saved_moments[k])
    # ... and continues identically.
    train_steps(model, optimizer, scheduler, 1)
    train_steps(model2, optimizer2, scheduler2, 1)
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), k


def test_saves_at_interval_and_last_step_only(tmp_path):
    manager, *_ = build(str(tmp_path), interval=3)
    for step in range(1, 8):
        manager.maybe_save(step, last=step == 7)
    assert sorted(step_folders(str(tmp_path / "checkpoint"))) == [3, 6, 7]


def test_nothing_without_enable(tmp_path):
    manager, *_ = build(str(tmp_path))
    manager.config = Checkpoint(enable=False)
    manager.maybe_save(500, last=True)
    assert not (tmp_path / "checkpoint").exists()
    assert manager.load() is False


def test_partial_folders_are_never_loaded_and_are_replaced(tmp_path):
    manager, model, *_ = build(str(tmp_path), interval=1)
    manager.maybe_save(1, last=False)
    # A save of step 2 that died half-way: shards but no completion mark.
    partial = tmp_path / "checkpoint" / "step-2.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    assert sorted(step_folders(str(tmp_path / "checkpoint"))) == [1]
    fresh, _, _, _, _, state = build(str(tmp_path), interval=1)
    assert fresh.load() and state.step == 0  # step 1's state (the saved TrainState was 0)
    fresh.maybe_save(2, last=False)
    assert not partial.exists() and sorted(step_folders(str(tmp_path / "checkpoint"))) == [1, 2]


@pytest.mark.parametrize("keep", [1, 2])
def test_keep_latest_k_prunes_only_after_a_newer_checkpoint_is_complete(tmp_path, keep):
    manager, *_ = build(str(tmp_path), interval=1, keep_latest_k=keep)
    folder = str(tmp_path / "checkpoint")
    for step in range(1, 5):
        manager.maybe_save(step, last=False)
        assert sorted(step_folders(folder)) == list(range(max(1, step - keep + 1), step + 1))
    # A failing save never costs the complete one.
    original = manager.states["model"].state_dict
    manager.states["model"].state_dict = lambda: (_ for _ in ()).throw(RuntimeError("disk full"))
    with pytest.raises(Exception, match="disk full"):
        manager.maybe_save(5, last=False)
    manager.states["model"].state_dict = original
    assert 4 in step_folders(folder)


def test_load_step_picks_that_checkpoint_or_names_what_exists(tmp_path):
    manager, model, optimizer, scheduler, loader, state = build(str(tmp_path), interval=1)
    for step in (1, 2):
        state.step = step
        manager.maybe_save(step, last=False)
    fresh, *_, state2 = build(str(tmp_path), load_step=1)
    assert fresh.load() and state2.step == 1
    missing, *_ = build(str(tmp_path), load_step=7)
    with pytest.raises(ValueError, match=r"load_step=7.*step-7.*found: \[1, 2\]"):
        missing.load()


def test_model_only_last_save_in_export_dtype_is_not_resumed_from(tmp_path):
    manager, model, *_ = build(str(tmp_path), interval=5, last_save_model_only=True, export_dtype="bfloat16")
    manager.maybe_save(5, last=False)
    manager.maybe_save(6, last=True)
    folder = tmp_path / "checkpoint"
    assert json.loads((folder / "step-6" / DESCRIPTION_FILE).read_text())["model_only"] is True
    fresh, _, _, _, _, state = build(str(tmp_path))
    state.step = -1
    assert fresh.load() and state.step == 0  # resumed from step 5, the full checkpoint
    # The model-only save can start another run, in bfloat16 precision.
    start, model2, *_ = build(str(tmp_path / "other"), seed=3, initial_load_path=str(folder / "step-6"))
    assert start.load() is False
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a.to(torch.bfloat16).float(), b), k


def test_checkpoint_of_another_flavor_names_the_difference(tmp_path):
    manager, *_ = build(str(tmp_path), interval=1)
    manager.maybe_save(1, last=False)
    other = dataclasses.replace(ARGS, n_layers=2, hidden_dim=32)
    fresh, *_ = build(str(tmp_path), args=other)
    with pytest.raises(ValueError, match=r"another model.*n_layers=1 \(this run: 2\).*hidden_dim=24 \(this run: 32\)"):
        fresh.load()


def test_missing_shard_and_corrupted_metadata_name_the_file(tmp_path):
    manager, *_ = build(str(tmp_path), interval=1)
    manager.maybe_save(1, last=False)
    manager.maybe_save(2, last=False)
    folder = tmp_path / "checkpoint"
    os.remove(folder / "step-2" / "__0_0.distcp")
    fresh, *_ = build(str(tmp_path))
    with pytest.raises(ValueError, match=r"step-2 is incomplete: missing shard file\(s\) __0_0.distcp"):
        fresh.load()
    (folder / "step-2" / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match=r"step-2/.metadata is corrupted"):
        fresh.load()
    (folder / "step-2" / DESCRIPTION_FILE).write_text("{")
    with pytest.raises(ValueError, match=rf"{DESCRIPTION_FILE} is corrupted"):
        fresh.load()


def test_initial_load_path_errors(tmp_path):
    manager, *_ = build(str(tmp_path), initial_load_path=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="initial_load_path=.*nowhere.* does not exist"):
        manager.load()
    (tmp_path / "plain").mkdir()
    manager, *_ = build(str(tmp_path), initial_load_path=str(tmp_path / "plain"))
    with pytest.raises(ValueError, match=f"not a checkpoint of this project: {DESCRIPTION_FILE} is missing"):
        manager.load()


def test_async_wait_returns_after_the_checkpoint_is_marked_complete(tmp_path, monkeypatch):
    manager, model, optimizer, scheduler, *_ = build(str(tmp_path), interval=1, async_mode="async")
    train_steps(model, optimizer, scheduler, 1)
    commit = CheckpointManager._commit

    def slow_commit(self, partial, final, description):
        # The write's future resolves before its callbacks run: a wait() on the write alone
        # would return during this sleep, before the rename.
        time.sleep(0.5)
        commit(self, partial, final, description)

    monkeypatch.setattr(CheckpointManager, "_commit", slow_commit)
    manager.maybe_save(1, last=False)
    manager.wait()
    assert sorted(step_folders(str(tmp_path / "checkpoint"))) == [1]


def test_async_commit_error_reaches_wait(tmp_path, monkeypatch):
    manager, model, optimizer, scheduler, *_ = build(str(tmp_path), interval=1, async_mode="async")

    def failing_commit(self, partial, final, description):
        raise OSError("disk full")

    monkeypatch.setattr(CheckpointManager, "_commit", failing_commit)
    manager.maybe_save(1, last=False)
    with pytest.raises(OSError, match="disk full"):
        manager.wait()


# ---------------------------------------------------------------- LoRA

LORA = LoRASettings(rank=2, alpha=4.0, target_modules=("wq", "wv", "w2"), train_embeddings=True)
TRAINABLE = {
    "tok_embeddings.weight",
    *(
        f"layers.0.{m}.{ab}.weight"
        for m in ("attention.wq", "attention.wv", "feed_forward.w2")
        for ab in ("lora_a", "lora_b")
    ),
}


@torch.no_grad()
def scramble_adapters(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.requires_grad:
            p.copy_(torch.randn(p.shape, generator=gen))


def test_lora_checkpoint_holds_what_trains_and_resumes_exactly(tmp_path):
    manager, model, optimizer, scheduler, loader, state = build(str(tmp_path), lora=LORA, interval=2)
    train_steps(model, optimizer, scheduler, 2)
    manager.maybe_save(2, last=False)
    path = tmp_path / "checkpoint" / "step-2"
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    assert {k.removeprefix("model.") for k in saved if k.startswith("model.")} == TRAINABLE
    assert {k.split(".", 2)[2].rsplit(".", 1)[0] for k in saved if k.startswith("optimizer.state.")} == TRAINABLE
    description = json.loads((path / DESCRIPTION_FILE).read_text())
    assert description["adapters_only"] is True and description["lora"]["rank"] == 2
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    # The same run restarted (same seed: the base is initialized again), adapters elsewhere.
    fresh, model2, optimizer2, scheduler2, *_ = build(str(tmp_path), lora=LORA, interval=2)
    scramble_adapters(model2, 1)
    assert fresh.load() is True
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected[k]), k
    train_steps(model, optimizer, scheduler, 1)
    train_steps(model2, optimizer2, scheduler2, 1)
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), k

    # Another seed is another random base: the adapters do not belong to it.
    other, *_ = build(str(tmp_path), seed=5, lora=LORA, interval=2)
    with pytest.raises(ValueError, match=r"trained on the base 'the seeded init \(debug.seed = 0\)'.*debug.seed = 5"):
        other.load()


def test_lora_resume_loads_the_base_from_initial_load_path(tmp_path):
    base = Qwen3Model(ARGS)
    base.init_weights(3)
    save_hf_checkpoint(base, str(tmp_path / "base"), torch.float32)
    config = {"initial_load_path": str(tmp_path / "base"), "initial_load_in_hf": True, "interval": 2}
    manager, model, optimizer, scheduler, *_ = build(str(tmp_path), lora=LORA, **config)
    assert manager.load() is False
    for name, value in base.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    train_steps(model, optimizer, scheduler, 2)
    manager.maybe_save(2, last=False)

    fresh, model2, *_ = build(str(tmp_path), seed=9, lora=LORA, **config)  # another init: all of it is loaded
    assert fresh.load() is True
    for k, v in model2.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


def test_lora_last_save_in_hf_is_a_peft_adapter_with_the_merged_model(tmp_path):
    config = {"last_save_model_only": True, "last_save_in_hf": True, "interval": 10}
    manager, model, optimizer, scheduler, *_ = build(str(tmp_path), lora=LORA, merged=True, **config)
    scramble_adapters(model, 2)
    manager.maybe_save(3, last=True)
    path = tmp_path / "checkpoint" / "step-3"
    assert json.loads((path / DESCRIPTION_FILE).read_text())["format"] == "peft"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(path))
    tokens = torch.arange(12) % ARGS.vocab_size
    with torch.no_grad():
        expected = model.output(model(tokens, torch.arange(12), torch.zeros(12, dtype=torch.long)))
        merged = Qwen3Model(ARGS)
        load_hf_weights(merged, str(path / "merged"))
        got = merged.output(merged(tokens, torch.arange(12), torch.zeros(12, dtype=torch.long)))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    # Another run starts from those adapters (its base: the same seeded init).
    start, model2, *_ = build(str(tmp_path / "next"), lora=LORA, initial_load_adapter_path=str(path))
    assert start.load() is False
    for k, v in model2.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    wrong, *_ = build(str(tmp_path / "next"), lora=LORA, initial_load_path=str(path))
    with pytest.raises(ValueError, match="is a PEFT adapter export.*initial_load_adapter_path"):
        wrong.load()
    with pytest.raises(ValueError, match="initial_load_adapter_path=.*needs lora.enable"):
        build(str(tmp_path / "next"), initial_load_adapter_path=str(path))


def test_lora_checkpoint_of_other_adapters_or_without_them_is_refused(tmp_path):
    manager, *_ = build(str(tmp_path / "lora"), lora=LORA, interval=1)
    manager.maybe_save(1, last=False)
    other, *_ = build(str(tmp_path / "lora"), lora=dataclasses.replace(LORA, rank=3, train_embeddings=False))
    with pytest.raises(
        ValueError,
        match=r"other LoRA adapters: lora.rank=2 \(this run: 3\), lora.train_embeddings=True .*checkpoint.json",
    ):
        other.load()
    plain, *_ = build(str(tmp_path / "lora"))
    with pytest.raises(ValueError, match="holds a model with LoRA adapters .*lora.enable = false"):
        plain.load()
    manager, *_ = build(str(tmp_path / "plain"), interval=1)
    manager.maybe_save(1, last=False)
    adapted, *_ = build(str(tmp_path / "plain"), lora=LORA)
    with pytest.raises(ValueError, match="without LoRA adapters .*lora.enable = true"):
        adapted.load()


def test_lora_model_only_save_starts_another_lora_run_with_base_and_adapters(tmp_path):
    manager, model, *_ = build(str(tmp_path), lora=LORA, last_save_model_only=True, interval=10)
    scramble_adapters(model, 4)
    manager.maybe_save(5, last=True)
    path = str(tmp_path / "checkpoint" / "step-5")
    start, model2, *_ = build(str(tmp_path / "next"), seed=8, lora=LORA, initial_load_path=path)
    assert start.load() is False
    for k, v in model2.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    plain, *_ = build(str(tmp_path / "next"), initial_load_path=path)
    with pytest.raises(ValueError, match="holds a model with LoRA adapters"):
        plain.load()
