"""Pipeline parallel does not change the gradient: every schedule and composition of
pipeline_cases.PIPELINE_LAYOUTS (pp2 with 1F1B, GPipe and ZBV; pp2 x dp2 with 1F1B and
Interleaved1F1B; HSDP pp2 x rep2; pp2 x tp2; pp2 x cp2; pp4 with InterleavedZeroBubble; pp2 x dp2 x tp2) against one
process running the whole mini-batch through the whole model: gradients, every logged metric
(rl/* included), the clipped AdamW step and the forward log-probs; with LoRA, the adapters'
step and the PEFT and merged exports the stages write together; MoE router losses; a
vision-language model."""

import functools
import tempfile

import pytest
import torch
from safetensors.torch import load_file

import layout_cases as lc
import lora_cases
import moe_cases
import pipeline_cases as pc
import vlm_cases
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine
from torchtitan_rl.metrics import MetricsLogger
from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
from torchtitan_rl.peft_checkpoint import save_merged_hf, save_peft_adapter
from torchtitan_rl.recipes.base import build_model

RTOL = 1e-5
# Logged values that are not the loss's: the host's memory, and throughput (checked apart).
NOT_COMPARED = ("memory/peak_rss(GiB)", "throughput(tps)")
EXPORT_FILES = {"adapter": "adapter_model.safetensors", "merged": "model.safetensors"}


def _one_rank() -> ParallelDims:
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, world_size=1)
    dims.build_meshes("cpu")
    return dims


def _built(args, lora=None):
    """The model of ``args`` on one process, initialized as in every layout."""
    return build_model(
        args, parallel_dims=_one_rank(), device=torch.device("cpu"), seed=lc.SEED, param_dtype=torch.float32, lora=lora
    )


def _one_process(lora: bool = False):
    model = _built(pc.model_args(), lora_cases.SETTINGS if lora else None)
    if lora:
        lora_cases.set_adapters(model)
    return model


def _one_process_case(model, options, samples, step: bool, loss_fn: str = "cross_entropy") -> dict:
    """``pipeline_cases.record`` of one process running ``samples`` whole through ``model``."""
    dims, device = _one_rank(), torch.device("cpu")
    optimizer = build_optimizer(model, lc.LR, 0.9, 0.95, lc.ADAM_EPS, 0.1)
    scheduler = build_lr_scheduler(optimizer, 10, 0, "linear", 0.0)
    engine = Engine(
        model, optimizer=optimizer, lr_scheduler=scheduler, parallel_dims=dims, device=device, options=options
    )
    metrics = MetricsLogger(dims, device, 0, tb_folder=None, num_params=1, flops_per_token_context=1)
    with lc.one_thread():
        fb = engine.forward_backward(samples, loss_fn, lc.RL_LOSS_FNS.get(loss_fn))
        return pc.record(engine, fb, metrics, step)


@functools.cache
def reference(loss_fn: str, mode: str, data: str, step: bool, lora: bool = False) -> dict:
    """What one process logs and holds after the case, from the initial weights (with
    ``lora``, also what it exports)."""
    model = _one_process(lora)
    options = pc.options(mode, lc.MAX_NORM if step else 0.0)
    entry = _one_process_case(model, options, lc.global_batch(data), step, loss_fn)
    if lora:
        with tempfile.TemporaryDirectory() as folder:
            save_peft_adapter(model, f"{folder}/adapter", lora_cases.SETTINGS, torch.float32)
            save_merged_hf(model, f"{folder}/merged", torch.float32)
            entry["exports"] = {name: load_file(f"{folder}/{name}/{file}") for name, file in EXPORT_FILES.items()}
    return entry


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    err, scale = (actual - expected).norm(), expected.norm()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    assert err <= RTOL * scale + 1e-9, f"{what}: relative error {float(err / scale.clamp(min=1e-30)):.3e}"


def _layouts(world: int) -> list[str]:
    return [pc.layout_name(*layout) for layout in pc.PIPELINE_LAYOUTS[world]]


def _cases(world: int):
    cases = pc.FULL_CASES if world == 2 else pc.WIDE_CASES
    return [(*case, False) for case in cases] + [(*pc.STEP_CASE, True)]


def _runs(world: int) -> list[tuple[str, tuple]]:
    """(layout, case) of every run of this world size; a LoRA layout's name ends in _lora."""
    runs = [(layout, case) for layout in _layouts(world) for case in _cases(world)]
    if pc.LORA_LAYOUT[0] == world:
        runs.append((pc.layout_name(*pc.LORA_LAYOUT[1]) + "_lora", (*pc.STEP_CASE, True)))
    return runs


@pytest.mark.parametrize("world", sorted(pc.PIPELINE_LAYOUTS))
def test_pipeline_gradients_metrics_and_step_equal_one_process(layout_results, world):
    results = layout_results[world]
    for layout, (loss_fn, mode, data, step) in _runs(world):
        key = pc.case_key(layout, loss_fn, mode) + ("/step" if step else "")
        got, expected = results[key], reference(loss_fn, mode, data, step, layout.endswith("_lora"))
        assert got["grads"].keys() == expected["grads"].keys(), key
        for name, grad in expected["grads"].items():
            assert_rel_close(got["grads"][name], grad, f"{key} grad {name}")
        logged, want = got["logged"], expected["logged"]
        assert logged.keys() == want.keys(), key
        for tag, value in want.items():
            if tag not in NOT_COMPARED:
                # A near-zero RL loss needs an absolute floor besides the relative bound.
                assert logged[tag] == pytest.approx(value, rel=RTOL, abs=1e-6), f"{key} {tag}"
        # Per rank: the window's loss tokens over one second, shared by every rank.
        assert logged["throughput(tps)"] == pytest.approx(want["tokens/loss_tokens"] / world), key
        if step:
            assert want["grad_norm"] > lc.MAX_NORM, "the step case must clip"
            for name, param in expected["params"].items():
                torch.testing.assert_close(got["params"][name], param, rtol=1e-5, atol=1e-6, msg=f"{key} {name}")


@pytest.mark.parametrize("world", sorted(pc.PIPELINE_LAYOUTS))
def test_pipeline_forward_logprobs_equal_one_process(layout_results, world):
    options = pc.options("token_mean")
    engine = Engine(
        _one_process(),
        optimizer=None,
        lr_scheduler=None,
        parallel_dims=_one_rank(),
        device=torch.device("cpu"),
        options=options,
    )
    with lc.one_thread():
        expected = engine.forward(lc.global_batch("uneven"), with_entropy=True)
    for (_, dp_replicate, dp_shard, *_), layout in zip(pc.PIPELINE_LAYOUTS[world], _layouts(world)):
        got = layout_results[world][f"pipeline/{layout}/forward"]
        num = lc.GLOBAL_BATCH_SIZE // (dp_replicate * dp_shard)
        assert len(got["logprobs"]) == len(got["entropies"]) == num, layout
        start = got["rank"] * num  # rank 0's share of the batch
        for i in range(num):
            assert_rel_close(got["logprobs"][i], expected.logprobs[start + i], f"{layout} log-probs {i}")
            assert_rel_close(got["entropies"][i], expected.entropies[start + i], f"{layout} entropies {i}")


def test_adapters_trained_under_pipeline_export_like_one_process(layout_results):
    """The PEFT adapter and the merged model that pp2 x dp2's stages export together (each stage
    its own files) after a LoRA step equal one process's."""
    world, layout = pc.LORA_LAYOUT
    got = layout_results[world][f"pipeline/{pc.layout_name(*layout)}_lora/exports"]
    expected = reference(*pc.STEP_CASE, True, True)["exports"]
    assert got["num_merged_files"] == 2  # one per pipeline stage
    for name in EXPORT_FILES:
        assert got[name].keys() == expected[name].keys(), name
        for key, tensor in expected[name].items():
            torch.testing.assert_close(got[name][key], tensor, rtol=1e-5, atol=1e-6, msg=f"{name} {key}")


@functools.cache
def moe_reference(name: str) -> dict:
    """One process's gradients and logged values of a router-loss case of pipeline_cases."""
    model = _built(pc.moe_model_args())
    moe_cases.set_router_weights(model)
    return _one_process_case(model, pc.moe_options(name), pc.moe_batch(name), False)


def _moe_cases(layout: tuple) -> tuple[str, ...]:
    return (*pc.MOE_CASES, moe_cases.REPLAY) if layout == pc.MOE_REPLAY_LAYOUT else pc.MOE_CASES


@pytest.mark.parametrize("world", sorted(pc.MOE_LAYOUTS))
def test_router_losses_of_stages_equal_one_process(layout_results, world):
    """Each stage forms its share of the router losses from every layer's counts (a counting
    pass through the pipeline first); a stage of dense layers routes nothing. With routing
    replay (one layout), each stage routes to its layer's recorded experts."""
    for layout_tuple in pc.MOE_LAYOUTS[world]:
        layout = pc.layout_name(*layout_tuple)
        for name in _moe_cases(layout_tuple):
            key = f"pipeline/moe/{layout}/{name}"
            got, expected = layout_results[world][key], moe_reference(name)
            assert got["grads"].keys() == expected["grads"].keys(), key
            for fqn, grad in expected["grads"].items():
                assert_rel_close(got["grads"][fqn], grad, f"{key} grad {fqn}")
            extra = got["logged"].keys() - expected["logged"].keys()  # expert parallel's per-rank loads
            assert expected["logged"].keys() <= got["logged"].keys(), key
            assert {tag.startswith("moe/rank_imbalance/") for tag in extra} <= {True}, key
            assert bool(extra) == ("_ep" in layout), key
            assert any(tag.startswith("moe/load_imbalance") for tag in expected["logged"])
            # Replay logs the agreement of the recorded experts with each stage's own choice.
            agreement = {tag for tag in expected["logged"] if tag.startswith("moe/routing_agreement")}
            assert len(agreement) == (3 if name == moe_cases.REPLAY else 0), key
            for tag, value in expected["logged"].items():
                if tag not in NOT_COMPARED:
                    assert got["logged"][tag] == pytest.approx(value, rel=RTOL, abs=1e-6), f"{key} {tag}"


def test_the_pipeline_replay_case_changes_the_routing():
    """The one-process reference of the replay case differs from the same losses without replay
    (so a stage that ignored the record would fail above), and agreement is strictly in (0, 1)."""
    replayed, own = moe_reference(moe_cases.REPLAY), moe_reference("global_pooled")
    agreement = replayed["logged"]["moe/routing_agreement"]
    assert 0 < agreement < 1
    routers = [fqn for fqn in own["grads"] if "router" in fqn]
    diff = sum((replayed["grads"][f] - own["grads"][f]).norm() ** 2 for f in routers) ** 0.5
    assert diff > 100 * RTOL * sum(own["grads"][f].norm() ** 2 for f in routers) ** 0.5


@functools.cache
def vlm_reference(mode: str, step: bool) -> dict:
    """One process's gradients, logged values and stepped weights of a VLM case."""
    options = pc.vlm_options(mode, lc.MAX_NORM if step else 0.0)
    return _one_process_case(_built(pc.vlm_model_args()), options, vlm_cases.global_batch(), step)


@pytest.mark.parametrize("world", sorted(pc.VLM_LAYOUTS))
def test_vision_language_model_under_pipeline_equals_one_process(layout_results, world):
    """The first stage encodes the images (the vision tower's gradient arrives from the later
    stages through the merged features)."""
    for layout in (pc.layout_name(*layout) for layout in pc.VLM_LAYOUTS[world]):
        for mode, step in pc.VLM_CASES:
            key = f"pipeline/vlm/{layout}/{mode}" + ("/step" if step else "")
            got, expected = layout_results[world][key], vlm_reference(mode, step)
            assert got["grads"].keys() == expected["grads"].keys(), key
            assert any(fqn.startswith("vision_tower.") for fqn in expected["grads"])
            for fqn, grad in expected["grads"].items():
                assert_rel_close(got["grads"][fqn], grad, f"{key} grad {fqn}")
            for tag, value in expected["logged"].items():
                if tag not in NOT_COMPARED:
                    assert got["logged"][tag] == pytest.approx(value, rel=RTOL, abs=1e-6), f"{key} {tag}"
            if step:
                for fqn, param in expected["params"].items():
                    torch.testing.assert_close(got["params"][fqn], param, rtol=1e-5, atol=1e-6, msg=f"{key} {fqn}")


@pytest.mark.parametrize("target", ["interleaved", "dp4"])
def test_a_checkpoint_loads_into_another_split_and_no_pipeline(layout_results, target):
    """Weights and AdamW moments keep their whole-model names on every stage: a checkpoint of
    pp2 split 6 + 2 restores them bitwise into 4 stages of 2 and into dp4."""
    results = layout_results[pc.CHECKPOINT_WORLD]
    trained, loaded = results["pipeline/checkpoint/trained"], results[f"pipeline/checkpoint/{target}"]
    assert len(trained["params"]) == len(dict(_one_process().named_parameters()))  # every stage's
    assert len(trained["optimizer"]) == 2 * len(trained["params"])  # both AdamW moments
    for part in ("params", "optimizer"):
        assert loaded[part].keys() == trained[part].keys(), part
        for key, value in trained[part].items():
            assert torch.equal(loaded[part][key], value), (target, part, key)


def test_every_pipeline_layout_and_case_was_run(layout_results):
    for world in pc.PIPELINE_LAYOUTS:
        keys = {key for key in layout_results[world] if key.startswith("pipeline/") and "/checkpoint/" not in key}
        expected = {f"pipeline/{layout}/forward" for layout in _layouts(world)}
        expected |= {pc.case_key(layout, c[0], c[1]) + ("/step" if c[3] else "") for layout, c in _runs(world)}
        if pc.LORA_LAYOUT[0] == world:
            lora = pc.layout_name(*pc.LORA_LAYOUT[1]) + "_lora"
            expected |= {f"pipeline/{lora}/forward", f"pipeline/{lora}/exports"}
        for layout in pc.VLM_LAYOUTS.get(world, ()):
            name = pc.layout_name(*layout)
            expected |= {f"pipeline/vlm/{name}/{mode}" + ("/step" if step else "") for mode, step in pc.VLM_CASES}
        for layout in pc.MOE_LAYOUTS.get(world, ()):
            expected |= {f"pipeline/moe/{pc.layout_name(*layout)}/{name}" for name in _moe_cases(layout)}
        assert keys == expected, world
