"""Key mapping between this Qwen3 implementation and Hugging Face ``Qwen3ForCausalLM`` /
``Qwen3MoeForCausalLM`` (a reward model: ``*ForSequenceClassification``, whose head is ``score``).

Pure tensor-dict mapping; ``torchtitan_rl/hf_checkpoint.py`` reads and writes the files.

MoE layers: our router ``layers.{i}.moe.router.weight [E, dim]`` is HF's
``model.layers.{i}.mlp.gate.weight``. Our experts are stacked, ``layers.{i}.moe.experts.w1 / w3
[E, hidden, dim]`` and ``w2 [E, dim, hidden]``; HF has two layouts of them:

- on disk (the published checkpoints, and what transformers 5's ``save_pretrained`` writes):
  one tensor per expert, ``model.layers.{i}.mlp.experts.{e}.gate_proj / up_proj / down_proj.weight``
  (= our ``w1[e]``, ``w3[e]``, ``w2[e]``); ``expert_hf_keys`` lists them for a stacked key;
- in memory in transformers 5 (``model.state_dict()``; ``from_pretrained`` converts on load):
  ``model.layers.{i}.mlp.experts.gate_up_proj [E, 2 * hidden, dim]`` (= cat(w1, w3, dim=1))
  and ``model.layers.{i}.mlp.experts.down_proj [E, dim, hidden]`` (= w2).

``to_hf`` writes the on-disk layout; ``from_hf`` reads either.
"""

import re

import torch

from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs

_TOP_LEVEL_TO_HF = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "score.weight": "score.weight",  # a reward model's head (HF *ForSequenceClassification)
    "score.bias": "score.bias",  # a critic's (HF *ForTokenClassification)
}
_LAYER_TO_HF = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "moe.router.weight": "mlp.gate.weight",
}
# Our stacked expert weight -> HF's per-expert projection.
_EXPERT_TO_HF = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_FROM_HF = {hf: ours for ours, hf in _EXPERT_TO_HF.items()}
_TOP_LEVEL_FROM_HF = {hf: ours for ours, hf in _TOP_LEVEL_TO_HF.items()}
_LAYER_FROM_HF = {hf: ours for ours, hf in _LAYER_TO_HF.items()}

_OUR_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
_OUR_EXPERT_KEY = re.compile(r"layers\.(\d+)\.moe\.experts\.(w1|w2|w3)")
_HF_EXPERT_KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_HF_FUSED_EXPERT_KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
# The MLP weights of one layer kind, to refuse a checkpoint whose layer kinds differ from the args.
_DENSE_MLP = ("feed_forward.",)
_MOE_MLP = ("moe.",)


def is_expert_key(key: str) -> bool:
    """Whether ``key`` (ours) is a stacked expert weight ``layers.{i}.moe.experts.w1|w2|w3``."""
    return _OUR_EXPERT_KEY.fullmatch(key) is not None


def expert_hf_keys(key: str, num_experts: int) -> list[str]:
    """The HF per-expert keys of our stacked expert weight ``key``, in expert order: slice
    ``e`` of ``layers.{i}.moe.experts.w1`` is ``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``
    (w3: ``up_proj``, w2: ``down_proj``)."""
    match = _OUR_EXPERT_KEY.fullmatch(key)
    if match is None:
        raise ValueError(f"{key!r} is not a stacked expert weight (layers.N.moe.experts.w1|w2|w3)")
    layer, weight = match.groups()
    return [f"model.layers.{layer}.mlp.experts.{e}.{_EXPERT_TO_HF[weight]}.weight" for e in range(num_experts)]


def parse_expert_hf_key(hf_key: str) -> tuple[str, int] | None:
    """``(our stacked key, expert index)`` of an HF per-expert key, or None for any other key."""
    match = _HF_EXPERT_KEY.fullmatch(hf_key)
    if match is None:
        return None
    layer, expert, projection = match.groups()
    return f"layers.{layer}.moe.experts.{_EXPERT_FROM_HF[projection]}", int(expert)


def to_hf(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename our keys to HF's on-disk ones. Tensors are passed through untouched (no copies);
    a stacked expert weight becomes its per-expert slices (views, see ``expert_hf_keys``).
    Slicing a sharded (DTensor) expert stack this way would gather it: loaders and exporters
    of sharded models split ``is_expert_key`` weights themselves."""
    hf_state_dict = {}
    for key, tensor in state_dict.items():
        if is_expert_key(key):
            hf_state_dict.update(zip(expert_hf_keys(key, tensor.shape[0]), tensor.unbind(0)))
            continue
        if key in _TOP_LEVEL_TO_HF:
            hf_state_dict[_TOP_LEVEL_TO_HF[key]] = tensor
            continue
        match = _OUR_LAYER_KEY.fullmatch(key)
        if match is None or match.group(2) not in _LAYER_TO_HF:
            raise ValueError(f"no HF name for Qwen3 state dict key {key!r}")
        hf_state_dict[f"model.layers.{match.group(1)}.{_LAYER_TO_HF[match.group(2)]}"] = tensor
    return hf_state_dict


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: Qwen3ModelArgs) -> dict[str, torch.Tensor]:
    """Rename HF keys to ours, ready for ``Qwen3Model(args).load_state_dict``.

    With tied embeddings ``output.weight`` is the embedding tensor (HF checkpoints of tied
    models usually omit ``lm_head.weight``; if present it is ignored). Experts come per expert
    (on-disk layout, stacked here: a copy) or fused (transformers 5 in-memory layout; views).
    """
    state_dict = {}
    per_expert: dict[str, dict[int, torch.Tensor]] = {}  # our stacked key -> expert -> tensor
    for key, tensor in hf_state_dict.items():
        if key in _TOP_LEVEL_FROM_HF:
            state_dict[_TOP_LEVEL_FROM_HF[key]] = tensor
            continue
        expert = parse_expert_hf_key(key)
        fused = _HF_FUSED_EXPERT_KEY.fullmatch(key)
        match = _HF_LAYER_KEY.fullmatch(key)
        if match is None or (expert is None and fused is None and match.group(2) not in _LAYER_FROM_HF):
            raise ValueError(f"unexpected key {key!r} in HF Qwen3 state dict")
        layer = int(match.group(1))
        if layer >= args.n_layers:
            raise ValueError(
                f"HF key {key!r} is for layer {layer}, but {args.field_names.value('n_layers', args.n_layers)}"
            )
        if expert is not None:
            ours, index = expert
            if index >= args.num_experts:
                experts = args.field_names.value("num_experts", args.num_experts)
                raise ValueError(f"HF key {key!r} is for expert {index}, but {experts}")
            per_expert.setdefault(ours, {})[index] = tensor
            _check_layer_kind(key, layer, ours, args)
        elif fused is not None:
            for ours, part in _unfuse_experts(key, layer, fused.group(2), tensor).items():
                _check_layer_kind(key, layer, ours, args)
                state_dict[ours] = part
        else:
            ours = f"layers.{layer}.{_LAYER_FROM_HF[match.group(2)]}"
            _check_layer_kind(key, layer, ours, args)
            state_dict[ours] = tensor

    for ours, experts in per_expert.items():
        if ours in state_dict:
            raise ValueError(f"HF state dict has both per-expert and fused weights for {ours!r}")
        missing = sorted(set(range(args.num_experts)) - experts.keys())
        if missing:
            example = expert_hf_keys(ours, missing[0] + 1)[-1]
            raise ValueError(f"HF state dict lacks experts {missing} of {ours!r} (e.g. {example!r})")
        state_dict[ours] = torch.stack([experts[e] for e in range(args.num_experts)])

    if args.tie_embeddings:
        if "tok_embeddings.weight" in state_dict:
            state_dict["output.weight"] = state_dict["tok_embeddings.weight"]
    elif not args.score_head and "output.weight" not in state_dict and "tok_embeddings.weight" in state_dict:
        raise ValueError(
            f"HF state dict has no lm_head.weight but {args.field_names.value('tie_embeddings', False)}; "
            "is this a tied checkpoint?"
        )
    return state_dict


def _unfuse_experts(key: str, layer: int, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    prefix = f"layers.{layer}.moe.experts."
    if name == "down_proj":
        return {prefix + "w2": tensor}
    if tensor.dim() != 3 or tensor.shape[1] % 2 != 0:
        raise ValueError(f"HF {key!r} must be [experts, 2 * hidden, dim], got {tuple(tensor.shape)}")
    # transformers' gate_up_proj holds the gate rows first, then the up rows.
    gate, up = tensor.chunk(2, dim=1)
    return {prefix + "w1": gate, prefix + "w3": up}


def _check_layer_kind(hf_key: str, layer: int, ours: str, args: Qwen3ModelArgs) -> None:
    """A dense MLP weight for an MoE layer of ``args`` (or the reverse) is another model."""
    part = ours.split(".", 2)[2]
    moe = args.is_moe_layer(layer)
    if (part.startswith(_MOE_MLP) and not moe) or (part.startswith(_DENSE_MLP) and moe):
        kind = "an MoE" if moe else "a dense"
        name = args.field_names
        rule = f"{name('num_experts')}, {name('decoder_sparse_step')} and {name('mlp_only_layers')}"
        raise ValueError(
            f"HF key {hf_key!r} does not fit layer {layer}, which is {kind} layer by the model's "
            f"{rule}{f' of {name.source}' if name.source else ''}"
        )
