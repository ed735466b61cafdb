"""Qwen3 hyper-parameters (dense and Qwen3-MoE), the published flavors, and conversion from/to
HF ``config.json`` (``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``)."""

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar

from torchtitan_rl.models.attention import ATTN_BACKEND_CHOICES
from torchtitan_rl.models.moe import EXPERTS_IMPL_CHOICES

REQUIRED = object()  # marks config.json fields without a default


def hf_config_field(config: dict[str, Any], key: str, kind: type, source: str, default: Any = REQUIRED) -> Any:
    """``config[key]`` (or ``default``) checked to be a ``kind``; ValueError naming ``source`` and the key."""
    value = config.get(key, default)
    if value is REQUIRED:
        raise ValueError(f"{source}: missing required field {key!r}")
    accepted = (int, float) if kind is float else kind
    # bool is an int subclass; a number field holding true/false is a broken config.
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, accepted):
        raise ValueError(f"{source}: field {key!r} must be {kind.__name__}, got {value!r}")
    return kind(value)


@dataclass(frozen=True)
class FieldNames:
    """How errors about args name a field: by its ``config.json`` key, after the file, when the
    args were read from one (``source``), else by the field name, so a user reads the name
    they can look up."""

    source: str
    hf_keys: Mapping[str, str]

    def __call__(self, name: str) -> str:
        return self.hf_keys.get(name, name) if self.source else name

    def error(self, message: str) -> ValueError:
        return ValueError(f"{self.source}: {message}" if self.source else message)

    def value(self, name: str, value: Any) -> str:
        """``name=value``, or ``key=value of <file>`` for args read from a config.json."""
        return f"{self(name)}={value!r} of {self.source}" if self.source else f"{name}={value!r}"


# config.json key of each Qwen3 args field.
QWEN3_HF_KEYS = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "hidden_dim": "intermediate_size",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "tie_embeddings": "tie_word_embeddings",
    "max_seq_len": "max_position_embeddings",
    "num_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "moe_hidden_dim": "moe_intermediate_size",
    "norm_topk_prob": "norm_topk_prob",
    "decoder_sparse_step": "decoder_sparse_step",
    "mlp_only_layers": "mlp_only_layers",
    "router_aux_loss_coef": "router_aux_loss_coef",
    "output_router_logits": "output_router_logits",
}

# transformers' Qwen3MoeConfig defaults, which the published Qwen3-MoE checkpoints also say.
HF_ROUTER_AUX_LOSS_COEF = 0.001
HF_OUTPUT_ROUTER_LOGITS = False


@dataclass
class Qwen3ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int  # SwiGLU inner size
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_embeddings: bool = False
    max_seq_len: int = 40960
    attn_backend: str = "sdpa_dense"
    # Mixture of experts (Qwen3-MoE); a dense model when num_experts == 0, and then every other
    # MoE field must keep its default so that equal dense models have equal args.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_hidden_dim: int = 0  # SwiGLU inner size of one expert (HF moe_intermediate_size)
    norm_topk_prob: bool = True  # renormalize the top-k probabilities to sum to 1
    decoder_sparse_step: int = 1  # with num_experts > 0: layer i is MoE iff (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (those stay dense)
    experts_impl: str = "auto"  # auto | grouped_mm | loop (see models.moe.GroupedExperts)
    # HF's balance-loss settings of an MoE model, kept so that an export writes the values in
    # force (see ``with_router_aux_loss``); training reads moe.aux_loss_coef, not these.
    router_aux_loss_coef: float = HF_ROUTER_AUX_LOSS_COEF
    output_router_logits: bool = HF_OUTPUT_ROUTER_LOGITS
    # A reward model: the head is one score per token (HF's ``*ForSequenceClassification`` with
    # one label, read at each sequence's last token) instead of the LM head (``as_reward_model``).
    score_head: bool = False
    # A critic: the same head read at every token (HF's ``*ForTokenClassification`` with one
    # label, ``as_critic``). How the head is read, not what the weights are: a critic may start
    # from a reward model's checkpoint.
    score_per_token: bool = False
    # Where the args were read from (a config.json path), so that errors name the file and its
    # keys; empty for a named flavor. Two args read from different files can be the same model.
    source: str = field(default="", compare=False, repr=False)

    # Neither properties of the weights nor of the function the model computes (RoPE is
    # evaluated at each token's position, so the context length only bounds the data):
    # runtime choices, training settings and the origin. ``architecture_differences`` skips
    # them; subclasses extend the tuple.
    RUNTIME_FIELDS: ClassVar[tuple[str, ...]] = (
        "attn_backend",
        "score_per_token",
        "max_seq_len",
        "experts_impl",
        "router_aux_loss_coef",
        "output_router_logits",
        "source",
    )
    HF_KEYS: ClassVar[Mapping[str, str]] = QWEN3_HF_KEYS

    @property
    def field_names(self) -> FieldNames:
        return FieldNames(self.source, self.HF_KEYS)

    def __post_init__(self) -> None:
        name = self.field_names
        if self.n_heads % self.n_kv_heads != 0:
            raise name.error(
                f"{name('n_heads')}={self.n_heads} must be a multiple of {name('n_kv_heads')}={self.n_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise name.error(f"{name('head_dim')}={self.head_dim} must be even for rotary embeddings")
        if self.score_per_token and not self.score_head:
            raise ValueError("score_per_token reads a score head: set score_head too (see as_critic)")
        if self.score_head and self.tie_embeddings:
            raise name.error(f"a score head has no LM head to tie to the embedding: set {name('tie_embeddings')}=false")
        if self.attn_backend not in ATTN_BACKEND_CHOICES:
            raise ValueError(f"unknown attn_backend {self.attn_backend!r}; valid: {', '.join(ATTN_BACKEND_CHOICES)}")
        self._check_moe_fields(name)

    def _check_moe_fields(self, name: FieldNames) -> None:
        # JSON (checkpoints store asdict) turns the tuple into a list; sorted so that the same
        # set of layers is one value (HF only tests membership).
        layers = self.mlp_only_layers
        if not isinstance(layers, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
            raise name.error(f"{name('mlp_only_layers')} must be a sequence of layer indices, got {layers!r}")
        self.mlp_only_layers = tuple(sorted(set(layers)))
        if self.experts_impl not in EXPERTS_IMPL_CHOICES:
            raise ValueError(f"unknown experts_impl {self.experts_impl!r}; valid: {', '.join(EXPERTS_IMPL_CHOICES)}")
        for key in ("num_experts", "num_experts_per_tok", "moe_hidden_dim", "decoder_sparse_step"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise name.error(f"{name(key)} must be a non-negative int, got {value!r}")
        for key in ("norm_topk_prob", "output_router_logits"):
            if not isinstance(getattr(self, key), bool):
                raise name.error(f"{name(key)} must be a bool, got {getattr(self, key)!r}")
        coef = self.router_aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef < float("inf"):
            raise name.error(f"{name('router_aux_loss_coef')} must be a finite number >= 0, got {coef!r}")
        if self.num_experts == 0:
            defaults = {
                "num_experts_per_tok": 0,
                "moe_hidden_dim": 0,
                "norm_topk_prob": True,
                "decoder_sparse_step": 1,
                "mlp_only_layers": (),
                "router_aux_loss_coef": HF_ROUTER_AUX_LOSS_COEF,
                "output_router_logits": HF_OUTPUT_ROUTER_LOGITS,
            }
            changed = [
                f"{name(key)}={getattr(self, key)!r}"
                for key, default in defaults.items()
                if getattr(self, key) != default
            ]
            if changed:
                raise name.error(
                    f"a dense model ({name('num_experts')}=0) must keep the MoE defaults, got {', '.join(changed)}"
                )
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise name.error(
                f"{name('num_experts_per_tok')}={self.num_experts_per_tok} must be in "
                f"[1, {name('num_experts')}={self.num_experts}]"
            )
        if self.moe_hidden_dim < 1:
            raise name.error(f"{name('moe_hidden_dim')} must be positive for an MoE model, got {self.moe_hidden_dim}")
        if self.decoder_sparse_step < 1:
            raise name.error(f"{name('decoder_sparse_step')} must be positive, got {self.decoder_sparse_step}")
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
        if outside:
            raise name.error(
                f"{name('mlp_only_layers')} lists {outside}, which are not layers of a model with "
                f"{name('n_layers')}={self.n_layers}"
            )
        if not self.moe_layers:
            # Would be a dense model with unused MoE fields; say num_experts=0 instead.
            raise name.error(
                f"{name('num_experts')}={self.num_experts} but no layer is MoE ({name('decoder_sparse_step')}="
                f"{self.decoder_sparse_step}, {name('mlp_only_layers')}={list(self.mlp_only_layers)})"
            )

    def check_tensor_parallel(self, tp: int) -> None:
        """Every dimension that tensor parallel shards must split evenly over ``tp`` ranks."""
        name = self.field_names
        for key in ("n_heads", "n_kv_heads", "hidden_dim", "vocab_size"):
            size = getattr(self, key)
            if size % tp != 0:
                raise name.error(f"{name(key)}={size} is not divisible by parallelism.tensor_parallel_degree={tp}")

    def linear_flops_per_token(self) -> int:
        """Forward FLOPs (2 per multiply-add) of one token through the weight matrices: every
        layer's attention projections and SwiGLU (an MoE layer's router and its top-k experts'
        SwiGLUs), and the output head. The data-parallel cost model's unit (``data.balance``)."""
        attention = 2 * self.dim * self.head_dim * 2 * (self.n_heads + self.n_kv_heads)  # wq, wo; wk, wv
        dense = 2 * 3 * self.dim * self.hidden_dim
        routed = 2 * self.dim * (self.num_experts + 3 * self.num_experts_per_tok * self.moe_hidden_dim)
        num_moe = len(self.moe_layers)
        mlps = (self.n_layers - num_moe) * dense + num_moe * routed
        return self.n_layers * attention + mlps + 2 * self.dim * self.vocab_size

    def attention_flops_per_pair(self) -> int:
        """Forward FLOPs of one (query, key) pair, over all layers: its score q.k and its share of
        the weighted sum of values, 2 * head_dim each per head."""
        return self.n_layers * 4 * self.n_heads * self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """HF Qwen3-MoE's rule: layer ``layer`` holds experts instead of the dense SwiGLU."""
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the MoE layers, in order (the layer axis of ``RouterStats``)."""
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]

    @property
    def is_moe(self) -> bool:
        # Validation guarantees at least one MoE layer whenever there are experts.
        return self.num_experts > 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Qwen3ModelArgs":
        """Inverse of ``dataclasses.asdict`` (what checkpoints store); subclasses with nested
        dataclass fields override it, so callers use ``type(args).from_dict``."""
        return cls(**d)

    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any], attn_backend: str = "sdpa_dense", source: str = "config.json"
    ) -> "Qwen3ModelArgs":
        """The args of an HF ``Qwen3Config`` dict (the contents of ``config.json``).

        Reads ``Qwen3Config`` (model_type "qwen3") and ``Qwen3MoeConfig`` ("qwen3_moe"). Shape
        fields are required (for MoE also the expert count, top-k and expert size); the others
        default as in transformers. Anything this model cannot compute (shared experts, router
        biases, attention biases, sliding window, scaled RoPE, another activation) is a
        ValueError naming ``source`` and the field, never silently ignored.
        """
        _check_hf_config_supported(config, source)

        def get(key: str, kind: type, default: Any = REQUIRED) -> Any:
            return hf_config_field(config, key, kind, source, default)

        moe = _moe_from_hf(config, source) if config.get("model_type") == "qwen3_moe" else {}
        score_head, score_per_token = _hf_score_head(config, source)
        return cls(
            vocab_size=get("vocab_size", int),
            dim=get("hidden_size", int),
            n_layers=get("num_hidden_layers", int),
            n_heads=get("num_attention_heads", int),
            n_kv_heads=get("num_key_value_heads", int),
            head_dim=get("head_dim", int),
            hidden_dim=get("intermediate_size", int),
            norm_eps=get("rms_norm_eps", float, 1e-6),
            rope_theta=_hf_rope_theta(config, source),
            # A sequence classifier reads no LM head: nothing is tied whatever the file says.
            tie_embeddings=get("tie_word_embeddings", bool, False) and not score_head,
            max_seq_len=get("max_position_embeddings", int, 32768),
            attn_backend=attn_backend,
            score_head=score_head,
            score_per_token=score_per_token,
            source=source,
            **moe,
        )

    def _hf_head(self) -> str:
        if not self.score_head:
            return "ForCausalLM"
        return "ForTokenClassification" if self.score_per_token else "ForSequenceClassification"

    def to_hf_config(self, torch_dtype: str) -> dict[str, Any]:
        """``config.json`` of the equivalent HF ``Qwen3ForCausalLM`` (``Qwen3MoeForCausalLM`` for
        an MoE model; ``*ForSequenceClassification`` with one label for a score head,
        ``*ForTokenClassification`` for one read at every token), weights
        stored as ``torch_dtype``. A sequence classifier also needs ``pad_token_id`` (to find
        each row's last token), which the export adds with the tokenizer's ids.

        Laid out like the published Qwen3 checkpoints (top-level ``rope_theta``), which
        transformers 4.51+ and 5 (which moved it into ``rope_parameters``) both read.
        """
        family = "Qwen3Moe" if self.is_moe else "Qwen3"
        config = {
            "architectures": [family + self._hf_head()],
            "model_type": "qwen3_moe" if self.is_moe else "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.hidden_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_seq_len,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.n_layers,
            "torch_dtype": torch_dtype,
        }
        if self.is_moe:
            config.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_hidden_dim,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                # HF adds its balance loss only when asked for router logits.
                output_router_logits=self.output_router_logits,
                router_aux_loss_coef=self.router_aux_loss_coef,
            )
        if self.score_head:
            config.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
        return config


def as_reward_model(args: Qwen3ModelArgs) -> Qwen3ModelArgs:
    """``args`` with a score head in place of the LM head (untied: the embedding stays)."""
    return dataclasses.replace(args, score_head=True, score_per_token=False, tie_embeddings=False)


def as_critic(args: Qwen3ModelArgs) -> Qwen3ModelArgs:
    """``args`` with a score head read at every token in place of the LM head: a value model."""
    return dataclasses.replace(args, score_head=True, score_per_token=True, tie_embeddings=False)


def _hf_score_head(config: dict[str, Any], source: str) -> tuple[bool, bool]:
    """Whether an HF config is a one-label classifier rather than a causal LM, and whether it
    classifies tokens (a critic) rather than sequences (a reward model). transformers counts
    labels by ``id2label`` (two when absent)."""
    architectures = config.get("architectures") or []
    kinds = {
        kind for kind in ("Sequence", "Token") for name in architectures if name.endswith(f"For{kind}Classification")
    }
    if not kinds:
        return False, False
    num_labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
    if num_labels != 1:
        raise ValueError(
            f"{source}: a {'token' if 'Token' in kinds else 'sequence'} classifier with {num_labels} labels; "
            "only one-label ones (reward models, critics: num_labels = 1) are supported"
        )
    return True, kinds == {"Token"}


def with_router_aux_loss(args: Qwen3ModelArgs, aux_loss_coef: float) -> Qwen3ModelArgs:
    """``args`` carrying the balance loss of a run trained with ``moe.aux_loss_coef``, so that an
    HF export writes the values in force.

    A run with a balance loss (coefficient > 0) writes its coefficient, with
    ``output_router_logits = true`` since HF adds the loss only then. A run without one (0, the
    default) keeps the values of the imported ``config.json`` (of a named flavor: HF's 0.001 and
    false), so that a round trip HF -> training -> HF changes nothing the run did not set.
    """
    if aux_loss_coef == 0:
        return args
    return dataclasses.replace(args, router_aux_loss_coef=aux_loss_coef, output_router_logits=True)


# Qwen2-MoE / DeepSeek-style MoE features that Qwen3-MoE (and our MoE) does not have; a
# config enabling one describes another model.
_UNSUPPORTED_MOE_FIELDS = (
    "shared_expert_intermediate_size",
    "n_shared_experts",
    "num_shared_experts",
    "router_bias",
    "moe_router_bias",
    "gate_bias",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
)


def _check_hf_config_supported(config: dict[str, Any], source: str) -> None:
    model_type = config.get("model_type")
    if model_type not in ("qwen3", "qwen3_moe"):
        raise ValueError(
            f"{source}: model_type is {model_type!r}; only Qwen3 ('qwen3') and Qwen3-MoE ('qwen3_moe') are supported"
        )
    for key, supported in (("hidden_act", "silu"), ("attention_bias", False), ("use_sliding_window", False)):
        if config.get(key, supported) != supported:
            raise ValueError(f"{source}: {key}={config[key]!r} is not supported (only {supported!r})")
    layer_types = config.get("layer_types") or []
    if any(layer_type != "full_attention" for layer_type in layer_types):
        raise ValueError(f"{source}: layer_types={layer_types!r}; only 'full_attention' layers are supported")


def _moe_from_hf(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The MoE fields of a ``Qwen3MoeConfig`` dict (empty when it has no experts: a dense model)."""
    for key in _UNSUPPORTED_MOE_FIELDS:
        if config.get(key) not in (None, 0, False):
            raise ValueError(f"{source}: {key}={config[key]!r} is not supported (Qwen3-MoE has none)")
    # The published configs say num_experts; transformers 5 writes its alias num_local_experts.
    spellings = {key: config[key] for key in ("num_experts", "num_local_experts") if key in config}
    if len(set(map(repr, spellings.values()))) > 1:
        raise ValueError(f"{source}: num_experts and num_local_experts disagree: {spellings}")
    key = next(iter(spellings), "num_experts")
    num_experts = hf_config_field(config, key, int, source)
    if num_experts == 0:
        return {}  # transformers builds every layer dense: the MoE fields mean nothing
    layers = config.get("mlp_only_layers") or []
    if not isinstance(layers, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
        raise ValueError(f"{source}: field 'mlp_only_layers' must be a list of layer indices, got {layers!r}")
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": hf_config_field(config, "num_experts_per_tok", int, source),
        "moe_hidden_dim": hf_config_field(config, "moe_intermediate_size", int, source),
        # transformers' Qwen3MoeConfig default (the published checkpoints say true).
        "norm_topk_prob": hf_config_field(config, "norm_topk_prob", bool, source, False),
        "decoder_sparse_step": hf_config_field(config, "decoder_sparse_step", int, source, 1),
        "mlp_only_layers": tuple(layers),
        "router_aux_loss_coef": hf_config_field(config, "router_aux_loss_coef", float, source, HF_ROUTER_AUX_LOSS_COEF),
        "output_router_logits": hf_config_field(config, "output_router_logits", bool, source, HF_OUTPUT_ROUTER_LOGITS),
    }


def _hf_rope_theta(config: dict[str, Any], source: str) -> float:
    """RoPE base as transformers resolves it: ``rope_scaling`` (4.x) wins over ``rope_parameters``
    (5.x), whose ``rope_theta`` wins over the top-level one (4.x); default 10000."""
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(key) or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{source}: field {key!r} must be an object, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{source}: {key} has rope_type={rope_type!r}; only unscaled ('default') RoPE is supported")
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor={partial!r} is not supported (only 1.0)")
    theta = rope.get("rope_theta", config.get("rope_theta", 10_000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ValueError(f"{source}: rope_theta must be a positive number, got {theta!r}")
    return float(theta)


def _published_moe(dim, n_layers, n_heads, hidden_dim, moe_hidden_dim) -> Qwen3ModelArgs:
    # Shared by the released Qwen3 MoE models (Qwen3-30B-A3B, Qwen3-235B-A22B config.json):
    # 4 KV heads, 128 experts, top-8 renormalized, every layer MoE; intermediate_size is in the
    # config although no layer is dense.
    return dataclasses.replace(
        _published(dim, n_layers, n_heads, hidden_dim, tie_embeddings=False),
        n_kv_heads=4,
        num_experts=128,
        num_experts_per_tok=8,
        moe_hidden_dim=moe_hidden_dim,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=(),
    )


def _published(dim, n_layers, n_heads, hidden_dim, tie_embeddings) -> Qwen3ModelArgs:
    # Shared by every released Qwen3 dense model (config.json on the hub).
    return Qwen3ModelArgs(
        vocab_size=151936,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        head_dim=128,
        hidden_dim=hidden_dim,
        norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_embeddings=tie_embeddings,
        max_seq_len=40960,
    )


# Tiny, for CPU tests and smoke runs.
_DEBUGMODEL = Qwen3ModelArgs(
    vocab_size=512,
    dim=128,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=32,
    hidden_dim=384,
    rope_theta=1_000_000.0,
    tie_embeddings=False,
    max_seq_len=2048,
)

qwen3_flavors: dict[str, Qwen3ModelArgs] = {
    "debugmodel": _DEBUGMODEL,
    "0.6B": _published(dim=1024, n_layers=28, n_heads=16, hidden_dim=3072, tie_embeddings=True),
    "1.7B": _published(dim=2048, n_layers=28, n_heads=16, hidden_dim=6144, tie_embeddings=True),
    "4B": _published(dim=2560, n_layers=36, n_heads=32, hidden_dim=9728, tie_embeddings=True),
    "8B": _published(dim=4096, n_layers=36, n_heads=32, hidden_dim=12288, tie_embeddings=False),
    "14B": _published(dim=5120, n_layers=40, n_heads=40, hidden_dim=17408, tie_embeddings=False),
    "32B": _published(dim=5120, n_layers=64, n_heads=64, hidden_dim=25600, tie_embeddings=False),
    # Tiny MoE for CPU tests and smoke runs: the debugmodel's attention, a dense first layer
    # (mlp_only_layers) then three MoE layers of 8 experts, top-2.
    "debugmodel_moe": dataclasses.replace(
        _DEBUGMODEL,
        n_layers=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_hidden_dim=64,
        norm_topk_prob=True,
        mlp_only_layers=(0,),
    ),
    "30B-A3B": _published_moe(dim=2048, n_layers=48, n_heads=32, hidden_dim=6144, moe_hidden_dim=768),
    "235B-A22B": _published_moe(dim=4096, n_layers=94, n_heads=64, hidden_dim=12288, moe_hidden_dim=1536),
}


def architecture_differences(a: Any, b: Any) -> list[tuple[str, Any, Any]]:
    """``(field, a's value, b's value)`` for every architecture field where the two differ.

    Compares every dataclass field of ``type(a)`` except its ``RUNTIME_FIELDS``, so subclasses
    (the VLM args) are covered. Nested dataclass fields (the vision args) are compared field by
    field under dotted names, skipping their own runtime fields. Args of different types differ
    as a whole (``("type", ...)``).
    """
    if type(a) is not type(b):
        return [("type", type(a).__name__, type(b).__name__)]
    runtime = getattr(type(a), "RUNTIME_FIELDS", ())
    differences = []
    for f in fields(a):
        if f.name in runtime:
            continue
        ours, theirs = getattr(a, f.name), getattr(b, f.name)
        if is_dataclass(ours) and is_dataclass(theirs):
            differences += [(f"{f.name}.{name}", x, y) for name, x, y in architecture_differences(ours, theirs)]
        elif ours != theirs:
            differences.append((f.name, ours, theirs))
    return differences


def find_flavor(args: Qwen3ModelArgs, flavors: dict[str, Qwen3ModelArgs] | None = None) -> str | None:
    """The named flavor (of ``flavors``, default the Qwen3 ones) with the same architecture as ``args``."""
    flavors = qwen3_flavors if flavors is None else flavors
    return next((name for name, flavor in flavors.items() if not architecture_differences(args, flavor)), None)


def check_flavor(
    args: Qwen3ModelArgs, flavor: str, source: str, flavors: dict[str, Qwen3ModelArgs] | None = None
) -> None:
    """Raise a ValueError listing the differences when ``args`` (read from ``source``) is not
    ``flavor`` of ``flavors`` (default the Qwen3 ones)."""
    flavors = qwen3_flavors if flavors is None else flavors
    differences = architecture_differences(args, flavors[flavor])
    if not differences:
        return
    says = ", ".join(f"{name}={ours}" for name, ours, _ in differences)
    has = ", ".join(f"{name}={theirs}" for name, _, theirs in differences)
    match = find_flavor(args, flavors)
    hint = (
        f" ({source} matches model.flavor={match!r})"
        if match
        else f' (no named flavor matches it; model.flavor = "hf" takes the architecture from {source} itself)'
    )
    raise ValueError(
        f"checkpoint from another model flavor: {source} says {says}; model.flavor={flavor!r} has {has}{hint}"
    )
