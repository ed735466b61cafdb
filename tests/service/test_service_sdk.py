"""The service driven by the official tinker SDK, against an independent reference: the same
Hugging Face model with the service's own PEFT export of the client's adapters (transformers +
peft), each loss its documented formula (``reference.tinker_loss``), and ``torch.optim.AdamW``.

One launch per layout (1 rank, dp 2, tp 2, and 1 training rank + 1 rollout rank that samples);
every test runs on each.
"""

import hashlib
import math
import sys
from pathlib import Path

import pytest
import tinker
import torch
from peft import PeftModel
from tinker import types
from transformers import Qwen3ForCausalLM

from torchtitan_rl.service.checkpoints import PEFT_FOLDER, CheckpointStore

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # the launch helper lives there
from reference import tinker_loss  # noqa: E402
from service_launch import BASE_MODEL, make_hf_model, sdk_env, start_service  # noqa: E402

LAYOUTS = {
    "1rank": (1, ()),
    "dp2": (2, ()),
    "tp2": (2, ("--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2")),
    "rollout": (2, ("--parallelism.rollout_ranks", "1")),
}
RANK = 4
RTOL, ATOL = 1e-5, 1e-6
ADAM = dict(learning_rate=2e-3, beta1=0.9, beta2=0.95, eps=1e-4, weight_decay=0.01, grad_clip_norm=0.5)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf") / "tiny-qwen3")


@pytest.fixture(scope="module", params=list(LAYOUTS))
def service(request, tmp_path_factory, hf_dir, monkeypatch_module):
    nproc, options = LAYOUTS[request.param]
    for key, value in sdk_env().items():
        monkeypatch_module.setenv(key, value)
    svc = start_service(tmp_path_factory.mktemp(f"service-{request.param}"), nproc, *options, hf_dir=hf_dir)
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def client(service):
    return tinker.ServiceClient(base_url=service.url)


def peft_dir(service, path: str) -> Path:
    """The PEFT export inside a saved state (``tinker://<model id>/weights/<name>``)."""
    folder, *_ = CheckpointStore(str(service.dump / "service")).existing(path)
    return Path(folder) / PEFT_FOLDER


def reference(hf_dir: Path, adapter: Path) -> PeftModel:
    base = Qwen3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter, is_trainable=True)


def datums(seed: int, lengths=(9, 5, 14)) -> list[dict]:
    """Random datums of several lengths with every loss input (float weights of both signs)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        tokens = torch.randint(3, 250, (n + 1,), generator=g)
        mask = (torch.rand(n, generator=g) < 0.7).float()
        mask[0] = 1.0
        out.append(
            {
                "tokens": tokens[:-1],
                "target_tokens": tokens[1:],
                "weights": torch.randn(n, generator=g),
                "logprobs": -torch.rand(n, generator=g) * 6 - 3,
                "advantages": torch.randn(n, generator=g),
                "sequence_ratio_mask": mask,
            }
        )
    return out


INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask"),
}
CONFIGS = {
    "cross_entropy": None,
    "importance_sampling": None,
    "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "cispo": {"clip_low_threshold": 0.7, "clip_high_threshold": 1.05},
    "dro": {"beta": 0.3},
    "gspo": {"clip_low_threshold": 0.95, "clip_high_threshold": 1.02},
}


def to_sdk(rows: list[dict], loss_fn: str) -> list[types.Datum]:
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(row["tokens"].tolist()),
            loss_fn_inputs={name: types.TensorData.from_torch(row[name]) for name in INPUTS[loss_fn]},
        )
        for row in rows
    ]


def token_logprobs(model, row) -> torch.Tensor:
    logits = model(input_ids=row["tokens"][None]).logits[0].float()
    return torch.log_softmax(logits, -1).gather(1, row["target_tokens"][:, None])[:, 0]


def assert_close(actual, expected, what: str) -> None:
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    bound = ATOL + RTOL * expected.abs().max().item() if expected.numel() else ATOL
    assert actual.shape == expected.shape and err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def adapter_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


def reference_optimizer(model: PeftModel) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params, lr=ADAM["learning_rate"], betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"],
        weight_decay=ADAM["weight_decay"],
    )  # fmt: skip


def reference_step(model: PeftModel, optimizer, rows: list[dict], loss_fn: str, config) -> None:
    """One forward_backward + optim_step of the reference, with ``ADAM``."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer.zero_grad()
    loss = sum(tinker_loss(loss_fn, token_logprobs(model, row), row, config or {}) for row in rows)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, ADAM["grad_clip_norm"])
    optimizer.step()


def test_every_loss_forward_backward_and_adamw_match_the_reference(service, client, hf_dir):
    """Per loss: a fresh client; forward (logprobs, loss:sum) at its initial adapters, then two
    forward_backward calls whose gradients add up, an optim_step, and the saved adapters and the
    next forward's values against transformers + peft + torch AdamW on the same weights."""
    for loss_fn, config in CONFIGS.items():
        tc = client.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=7).result()
        init = tc.save_state("init").result().path
        model = reference(hf_dir, peft_dir(service, init))
        optimizer = reference_optimizer(model)
        # B starts at zero: one warm-up step makes the adapters matter before the comparisons.
        warm = datums(1)
        tc.forward_backward(to_sdk(warm, "cross_entropy"), "cross_entropy").result()
        tc.optim_step(types.AdamParams(**ADAM)).result()
        reference_step(model, optimizer, warm, "cross_entropy", None)
        rows = datums(2)
        out = tc.forward(to_sdk(rows, loss_fn), loss_fn, loss_fn_config=config).result()
        with torch.no_grad():
            expected = [token_logprobs(model, row) for row in rows]
        for i in range(len(rows)):
            assert_close(out.loss_fn_outputs[i]["logprobs"].to_torch(), expected[i], f"{loss_fn} logprobs[{i}]")
        total = sum(float(tinker_loss(loss_fn, lp, row, config or {})) for lp, row in zip(expected, rows))
        assert_close(out.metrics["loss:sum"], total, f"{loss_fn} forward loss:sum")
        # Two calls, one step: the gradients accumulate.
        first = tc.forward_backward(to_sdk(rows[:2], loss_fn), loss_fn, loss_fn_config=config).result()
        second = tc.forward_backward(to_sdk(rows[2:], loss_fn), loss_fn, loss_fn_config=config).result()
        assert_close(first.metrics["loss:sum"] + second.metrics["loss:sum"], total, f"{loss_fn} fwd_bwd loss:sum")
        tc.optim_step(types.AdamParams(**ADAM)).result()
        reference_step(model, optimizer, rows, loss_fn, config)
        stepped = adapter_tensors(peft_dir(service, tc.save_state("stepped").result().path))
        for key, value in model.state_dict().items():
            if "lora_" in key:
                ours = stepped[key.replace(".default", "")]
                assert_close(ours, value, f"{loss_fn}: {key} after optim_step")


def sample_seed(seed: int, index: int) -> int:
    """Sample ``index``'s stream of a request: the first 8 bytes (little-endian) of the SHA-256 of
    "seed:0:index:0", 63 bits (the generator's documented per-row seed)."""
    digest = hashlib.sha256(f"{seed}:0:{index}:0".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@torch.no_grad()
def reference_samples(model, prompt: list[int], num_samples: int, max_tokens: int, seed: int) -> list[list[int]]:
    """Temperature-1 samples drawn by inverse CDF (vocabulary order, float64), one uniform per
    token from sample j's own stream: what any layout must return for ``seed``."""
    out = []
    for index in range(num_samples):
        stream = torch.Generator().manual_seed(sample_seed(seed, index))
        tokens = list(prompt)
        for _ in range(max_tokens):
            logits = model(input_ids=torch.tensor(tokens)[None]).logits[0, -1].float()
            cdf = torch.softmax(logits, -1).double().cumsum(-1)
            target = torch.rand(1, generator=stream, dtype=torch.float64) * cdf[-1]
            tokens.append(min(int(torch.searchsorted(cdf, target, right=True)), len(cdf) - 1))
        out.append(tokens[len(prompt) :])
    return out


def test_sampling_logprobs_equal_a_forward_of_the_sampled_tokens(service, client, hf_dir):
    tc = client.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=3).result()
    rows = datums(5)
    tc.forward_backward(to_sdk(rows, "cross_entropy"), "cross_entropy").result()
    tc.optim_step(types.AdamParams(**ADAM)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    saved = tc.save_state("for-reference").result().path
    model = reference(hf_dir, peft_dir(service, saved))
    prompt = [5, 17, 42, 99, 7]
    params = types.SamplingParams(max_tokens=12, seed=11, temperature=1.0, stop=[])
    result = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=3, sampling_params=params).result()
    assert len(result.sequences) == 3
    # The tokens of seed 11 on every layout, colocated or on rollout ranks.
    assert [list(s.tokens) for s in result.sequences] == reference_samples(model, prompt, 3, 12, seed=11)
    with torch.no_grad():
        for seq in result.sequences:
            assert len(seq.tokens) == 12 and seq.stop_reason == "length"
            tokens = torch.tensor(prompt + list(seq.tokens))
            logits = model(input_ids=tokens[None, :-1]).logits[0].float()
            expected = torch.log_softmax(logits, -1).gather(1, tokens[1:, None])[len(prompt) - 1 :, 0]
            assert_close(seq.logprobs, expected, "sampled logprobs")
    # The same seed gives the same samples; prompt log-probs are those of the same forward.
    again = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=3, sampling_params=params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in result.sequences]
    prompt_logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(prompt)[None]).logits[0].float()
        expected = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert prompt_logprobs[0] is None
    assert_close(prompt_logprobs[1:], expected, "prompt logprobs")


def test_stop_token_is_included_once(service, client):
    sampler = client.create_sampling_client(base_model=BASE_MODEL).result()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    free = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=10, seed=1, stop=[])).result().sequences[0]
    stop_token = free.tokens[3]
    cut = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=10, seed=1, stop=[stop_token])).result()
    seq = cut.sequences[0]
    first = free.tokens.index(stop_token)
    assert seq.tokens == free.tokens[: first + 1] and seq.stop_reason == "stop"
    assert_close(seq.logprobs, free.logprobs[: first + 1], "logprobs up to the stop token")


def test_stop_string_cuts_at_the_token_that_completes_it(service, client):
    """A stop given as text ends the sequence with the token whose text completes it (decoded
    with the model's tokenizer, the built-in byte tokenizer here): the first printable byte."""
    sampler = client.create_sampling_client(base_model=BASE_MODEL).result()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    for seed in range(20):
        free = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=16, seed=seed, stop=[])).result().sequences[0]
        printable = [k for k, t in enumerate(free.tokens) if 32 <= t < 127 and k > 0]
        if printable:
            break
    assert printable, "premise: some sample has a printable byte after its first token"
    k = printable[0]
    cut = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=16, seed=seed, stop=chr(free.tokens[k])))
    seq = cut.result().sequences[0]
    assert seq.tokens == free.tokens[: k + 1] and seq.stop_reason == "stop"


def test_unknown_ids_are_user_errors_naming_them(service, client):
    import httpx

    from service_launch import API_KEY

    with httpx.Client(base_url=service.url, headers={"X-API-Key": API_KEY}) as http:
        reply = http.post("/api/v1/get_info", json={"model_id": "nobody:train:7", "type": "get_info"})
        assert 400 <= reply.status_code < 500 and "nobody:train:7" in reply.text, reply.text
        reply = http.get("/api/v1/samplers/nobody:sample:3")
        assert 400 <= reply.status_code < 500 and "nobody:sample:3" in reply.text, reply.text
    sampler = client.create_sampling_client(base_model=BASE_MODEL).result()  # and it goes on serving
    assert (
        len(
            sampler.sample(types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2)).result().sequences
        )
        == 1
    )


def test_two_clients_do_not_interfere(service, client):
    """Client A's results are the same whether or not client B trains between its operations."""

    def run(interleave: bool) -> list[float]:
        a = client.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=21).result()
        b = client.create_lora_training_client(base_model=BASE_MODEL, rank=2, seed=22).result() if interleave else None
        values = []
        for step in range(2):
            rows = datums(30 + step)
            a.forward_backward(to_sdk(rows, "cross_entropy"), "cross_entropy").result()
            if b is not None:
                other = datums(40 + step)
                b.forward_backward(to_sdk(other, "importance_sampling"), "importance_sampling").result()
                b.optim_step(types.AdamParams(learning_rate=0.05)).result()
            a.optim_step(types.AdamParams(**ADAM)).result()
            out = a.forward(to_sdk(datums(50), "cross_entropy"), "cross_entropy").result()
            values.append(out.metrics["loss:sum"])
        return values

    alone, shared = run(False), run(True)
    assert alone == shared


def test_save_and_load_state_continue_exactly(service, client):
    rows = [datums(60 + i) for i in range(3)]

    def step(tc, i):
        tc.forward_backward(to_sdk(rows[i], "cross_entropy"), "cross_entropy").result()
        tc.optim_step(types.AdamParams(**ADAM)).result()
        return tc.forward(to_sdk(datums(70), "cross_entropy"), "cross_entropy").result().metrics["loss:sum"]

    tc = client.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=5).result()
    step(tc, 0)
    path = tc.save_state("mid").result().path
    continued = [step(tc, 1), step(tc, 2)]
    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    assert [step(resumed, 1), step(resumed, 2)] == continued
    # load_state_with_optimizer on an existing client continues the same way.
    tc.load_state_with_optimizer(path).result()
    assert [step(tc, 1), step(tc, 2)] == continued
    # Without the optimizer state AdamW starts over: a different continuation.
    fresh = client.create_training_client_from_state(path).result()
    assert step(fresh, 1) != continued[0]


def test_bad_input_is_a_user_error_and_the_service_goes_on(service, client):
    tc = client.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=9).result()
    row = datums(80, lengths=(6,))[0]
    bad_cases = {
        "weights": dict(row, weights=row["weights"][:-1]),  # lengths disagree
        "target_tokens": dict(row, target_tokens=torch.full_like(row["target_tokens"], 10**6)),  # past the vocab
    }
    for field, bad in bad_cases.items():
        with pytest.raises(tinker.RequestFailedError, match=field):
            tc.forward_backward(to_sdk([bad], "cross_entropy"), "cross_entropy").result()
    long_row = datums(81, lengths=(600,))[0]  # over training.seq_len = 512
    with pytest.raises(tinker.RequestFailedError, match="seq_len"):
        tc.forward(to_sdk([long_row], "cross_entropy"), "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="loss_fn"):
        tc.forward(to_sdk([row], "cross_entropy"), "no_such_loss").result()
    with pytest.raises(tinker.RequestFailedError, match="clip_low_thresh"):
        tc.forward(to_sdk([row], "ppo"), "ppo", loss_fn_config={"clip_low_thresh": 0.5}).result()
    with pytest.raises(Exception, match="base_model"):
        client.create_lora_training_client(base_model="Qwen/NotServed", rank=RANK).result()
    with pytest.raises(Exception, match="path"):
        client.create_training_client_from_state("tinker://nobody:train:0/weights/../../etc").result()
    with pytest.raises(tinker.RequestFailedError, match="path"):
        tc.save_state("../escape").result()
    # Nothing was lost: the client trains on.
    out = tc.forward_backward(to_sdk([row], "cross_entropy"), "cross_entropy").result()
    assert math.isfinite(out.metrics["loss:sum"])
    tc.optim_step(types.AdamParams(**ADAM)).result()


def test_custom_loss_trains_like_the_cross_entropy_it_equals(service, client):
    """forward_backward_custom (a forward, the loss's gradient in the client, a cross_entropy
    backward with those weights) steps exactly as cross_entropy with the same weights."""
    rows = datums(90)

    def custom(data, logprobs):
        loss = sum(-(lp * row["weights"]).sum() for lp, row in zip(logprobs, rows))
        return loss, {}

    stepped = {}
    for how in ("custom", "cross_entropy"):
        tc = client.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=31).result()
        if how == "custom":
            tc.forward_backward_custom(to_sdk(rows, "cross_entropy"), custom).result()
        else:
            tc.forward_backward(to_sdk(rows, "cross_entropy"), "cross_entropy").result()
        tc.optim_step(types.AdamParams(**ADAM)).result()
        stepped[how] = adapter_tensors(peft_dir(service, tc.save_state(f"custom-{how}").result().path))
    for key, value in stepped["cross_entropy"].items():
        assert_close(stepped["custom"][key], value, key)
