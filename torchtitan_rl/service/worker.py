"""What every rank does with an accepted operation (``service.operations``).

``check`` runs on rank 0 before an operation is sent to the ranks: every user mistake is found
there, without a collective, so a bad request is answered with a UserError and no rank is left
waiting. ``execute`` then runs on every training rank in the same order; the ranks hold the same
client and session tables, so they take the same branches. Sampling runs where ``sampler`` puts
it: on the training ranks (``ColocatedSampling``) or on rollout ranks
(``service.rollout_sampling``), which follow the same operations.
"""

import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_rl.distributed.clip import clip_grad_norm_
from torchtitan_rl.distributed.utils import full_tensor
from torchtitan_rl.engine import Engine
from torchtitan_rl.models.lora import LoRASettings
from torchtitan_rl.peft_checkpoint import save_peft_adapter
from torchtitan_rl.rl.rollouts import exchange_among_peers, split_among_peers
from torchtitan_rl.service.checkpoints import PEFT_FOLDER, CheckpointStore, check_name, tinker_path
from torchtitan_rl.service.clients import ClientPool, LoRAClientConfig
from torchtitan_rl.service.operations import ForwardBackwardResult, Operation, TinkerDatum, UserError
from torchtitan_rl.service.sampling import SamplingBackend, SamplingSessions, Snapshot, check_sample_args
from torchtitan_rl.service.tinker_losses import EngineCall, forward_backward_metrics, forward_metrics, to_engine

ADAMW_STATE = ("step", "exp_avg", "exp_avg_sq")


class ServiceWorker:
    def __init__(
        self,
        engine: Engine,
        pool: ClientPool,
        sampler: SamplingBackend,
        sessions: SamplingSessions,
        store: CheckpointStore,
        *,
        group: dist.ProcessGroup | None,
        base_models: list[str],
        vocab_size: int,
        max_len: int,
        lora: LoRASettings,
    ):
        self.engine = engine
        self.pool = pool
        self.sampler = sampler
        self.sessions = sessions
        self.store = store
        self.base_models = base_models
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.lora = lora
        self.group = group  # the training ranks (None: the whole launch), for their barriers
        self._converted: dict[str, EngineCall] = {}  # rank 0: request id -> its checked conversion

    # ---- rank 0, before sending ------------------------------------------------------------

    def check(self, op: Operation) -> Operation:
        """The operation as the ranks run it (datums turned into samples, a seed drawn), or a
        UserError naming the field."""
        args = dict(op.args)
        kind = op.kind
        if kind == "create_model":
            self._check_base(args["base_model"])
            if op.model_id in self.pool.clients:
                raise UserError(f"model_id: {op.model_id!r} exists already")
            self.pool.check_config(self._client_config(op.model_id, args))
        elif kind == "load_weights":
            folder, *_ = self.store.existing(args["path"])
            if op.model_id not in self.pool.clients:
                config, base, _ = self.store.read_client(folder)
                if args.get("base_model") not in (None, base):
                    raise UserError(f"base_model: {args['base_model']!r}, but {args['path']!r} is of {base!r}")
        elif kind in ("create_sampling_session", "sample"):
            if kind == "create_sampling_session":
                if args.get("model_path") is not None:
                    self.sessions.named_snapshot(args["model_path"])
                else:
                    self._check_base(args.get("base_model"))
            else:
                self.sessions.get(args["sampling_session_id"])
                check_sample_args(args, self.vocab_size, self.max_len)
                if args["seed"] is None:
                    args["seed"] = int(torch.randint(0, 2**62, ()).item())
        else:
            self.pool.get(op.model_id)
            if kind == "forward_backward":
                # Checked here; every rank converts the datums again (it takes a fraction of what
                # sending the samples, tensors pickled one by one, would), rank 0 keeps its own.
                self._converted[op.request_id] = self._to_engine(args)
                args["data"] = [_compact(datum) for datum in args["data"]]
            elif kind in ("save_weights", "save_weights_for_sampler") and args.get("name") is not None:
                check_name(args["name"])
        return Operation(op.request_id, kind, op.model_id, op.seq_id, args)

    def _to_engine(self, args: dict) -> EngineCall:
        return to_engine(
            args["data"], args["loss_fn"], args["loss_fn_config"], vocab_size=self.vocab_size, max_len=self.max_len
        )

    def _check_base(self, base_model: str | None) -> None:
        if base_model not in self.base_models:
            raise UserError(f"base_model: {base_model!r} is not served here; this service serves {self.base_models}")

    @staticmethod
    def _client_config(model_id: str, args: dict) -> LoRAClientConfig:
        seed = args.get("seed")
        if seed is None:
            # Reproducible per client id when the client names no seed.
            seed = int.from_bytes(model_id.encode()[-8:].rjust(8, b"\0"), "little") & (2**62 - 1)
        return LoRAClientConfig(
            rank=args["lora_rank"],
            seed=seed,
            train_attn=args["train_attn"],
            train_mlp=args["train_mlp"],
            train_unembed=args["train_unembed"],
        )

    # ---- every rank -------------------------------------------------------------------------

    def execute(self, op: Operation) -> Any:
        return getattr(self, f"_{op.kind}")(op, op.args)

    def _create_model(self, op: Operation, args: dict) -> dict:
        self.pool.add(op.model_id, self._client_config(op.model_id, args), args["base_model"])
        return {"model_id": op.model_id}

    def _forward_backward(self, op: Operation, args: dict) -> ForwardBackwardResult | None:
        """Each data-parallel rank takes its contiguous share of the datums; rank 0 gathers the
        per-datum log-probs in the request's order."""
        self.pool.activate(op.model_id)
        call = self._converted.pop(op.request_id, None)
        if call is None:
            call = self._to_engine(dict(args, data=[_expand(datum) for datum in args["data"]]))
        dims = self.engine.parallel_dims
        mine = split_among_peers(call.samples, dims.batch_rank(), dims.batch_degree)
        if args["forward_only"]:
            logprobs = self.engine.forward(mine).logprobs
        else:
            fb = self.engine.forward_backward(mine, call.loss_fn, call.loss_fn_config, with_logprobs=True)
            logprobs = fb.logprobs
            metrics = forward_backward_metrics(fb, dims.mesh("loss"))
        logprobs = exchange_among_peers([x.float() for x in logprobs], dims.mesh("batch"))
        if args["forward_only"]:
            metrics = forward_metrics(call, logprobs)
        return ForwardBackwardResult(logprobs, metrics)

    def _optim_step(self, op: Operation, args: dict) -> dict:
        self.pool.activate(op.model_id)
        params = list(self.pool.params.values())
        grad_norm = clip_grad_norm_(params, args["grad_clip_norm"])
        self.pool.set_hyperparameters(
            args["learning_rate"], args["beta1"], args["beta2"], args["eps"], args["weight_decay"]
        )
        self.pool.optimizer.step()
        self.pool.optimizer.zero_grad(set_to_none=True)
        return {"metrics": {"grad_norm:mean": float(grad_norm)}}

    def _save_weights(self, op: Operation, args: dict) -> dict:
        state = self.pool.activate(op.model_id)
        folder = self.store.folder(op.model_id, "weights", args["name"])
        os.makedirs(folder, exist_ok=True)
        optimizer_state = {
            name: {key: value for key, value in self.pool.optimizer.state[param].items() if key in ADAMW_STATE}
            for name, param in self.pool.params.items()
            if param in self.pool.optimizer.state
        }
        self.store.save(folder, state.config, state.base_model, dict(self.pool.params), optimizer_state)
        self._export_peft(state.config, folder)
        return {"path": tinker_path(op.model_id, "weights", args["name"])}

    def _export_peft(self, config: LoRAClientConfig, folder: str) -> None:
        """The active client's adapters as a PEFT directory in ``folder`` (rank lora.rank: the
        rows past the client's rank are zero, and the scale is the client's); a save under the
        same name replaces it."""
        path = os.path.join(folder, PEFT_FOLDER)
        if (not dist.is_initialized() or dist.get_rank() == 0) and os.path.exists(path):
            shutil.rmtree(path)
        if dist.is_initialized():
            # Every rank, whatever it saw: the export checks on each that the path is free.
            dist.barrier(group=self.group)
        alpha = self.pool.lora_alpha * self.lora.rank / config.rank
        settings = LoRASettings(rank=self.lora.rank, alpha=alpha, target_modules=self.lora.target_modules)
        save_peft_adapter(self.engine.model, path, settings, torch.float32, group=self.group)

    def _load_weights(self, op: Operation, args: dict) -> dict:
        folder, *_ = self.store.existing(args["path"])
        config, base, has_optimizer = self.store.read_client(folder)
        if op.model_id not in self.pool.clients:
            self.pool.add(op.model_id, config, base)
        state = self.pool.activate(op.model_id)
        if state.config != config:
            raise UserError(f"path: {args['path']!r} holds adapters of {config}, the client has {state.config}")
        params = self.pool.params
        templates = None
        if args["optimizer"] and has_optimizer:
            templates = {
                name: {
                    "step": torch.zeros((), dtype=torch.float32, device=self.engine.device),
                    "exp_avg": torch.zeros_like(param.detach()),
                    "exp_avg_sq": torch.zeros_like(param.detach()),
                }
                for name, param in params.items()
            }
        with torch.no_grad():
            targets = {name: param.detach() for name, param in params.items()}
            self.store.load(folder, targets, templates)
        for param in params.values():
            self.pool.optimizer.state.pop(param, None)
            param.grad = None
        if templates is not None:
            for name, param in params.items():
                self.pool.optimizer.state[param] = templates[name]
        return {"path": args["path"]}

    def _snapshot_of_active(self, model_id: str, model_path: str | None) -> Snapshot:
        state = self.pool.activate(model_id)
        adapters = {name: full_tensor(param).cpu().clone() for name, param in self.pool.params.items()}
        return Snapshot(state.base_model, adapters, self.pool.lora_alpha / state.config.rank, model_path)

    def _save_weights_for_sampler(self, op: Operation, args: dict) -> dict:
        path = None if args.get("name") is None else tinker_path(op.model_id, "sampler_weights", args["name"])
        snapshot = self._snapshot_of_active(op.model_id, path)
        self.sampler.publish(snapshot)
        self.sessions.keep(snapshot, args.get("sampling_session_id"))
        if path is None:
            return {"sampling_session_id": args["sampling_session_id"]}
        state = self.pool.get(op.model_id)
        folder = self.store.folder(op.model_id, "sampler_weights", args["name"])
        os.makedirs(folder, exist_ok=True)
        self._export_peft(state.config, folder)
        return {"path": path}

    def _create_sampling_session(self, op: Operation, args: dict) -> dict:
        self.sessions.open(args["sampling_session_id"], args.get("base_model"), args.get("model_path"))
        return {"sampling_session_id": args["sampling_session_id"]}

    def _sample(self, op: Operation, args: dict):
        return self.sampler.sample(self.sessions.get(args["sampling_session_id"]), args)

    def model_info(self, model_id: str) -> dict:
        state = self.pool.get(model_id)
        return {
            "model_id": model_id,
            "base_model": state.base_model,
            "lora_rank": state.config.rank,
            "is_lora": True,
        }

    def sampler_info(self, session_id: str) -> dict:
        snapshot = self.sessions.get(session_id)
        return {"sampler_id": session_id, "base_model": snapshot.base_model, "model_path": snapshot.model_path}


def _compact(datum: TinkerDatum) -> TinkerDatum:
    """A checked datum as it travels to the other ranks: numpy arrays pickle as one buffer each."""
    return TinkerDatum(list(datum.tokens), {key: value.numpy() for key, value in datum.inputs.items()})


def _expand(datum: TinkerDatum) -> TinkerDatum:
    return TinkerDatum(datum.tokens, {key: torch.from_numpy(value) for key, value in datum.inputs.items()})
