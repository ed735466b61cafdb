"""Every knob of a run, one dataclass per TOML section.

The string literal under each field is its documentation: ``--help`` reads it from this
file's source, so it is the only place a field is described. Simple ranges sit next to
the field (``bounded``) so the parser can check them and ``--help`` can print them.
"""

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from torchtitan_rl.config.validation import validate_job_config


def bounded(default, *, gt=None, ge=None, lt=None, le=None):
    """A field default plus the numeric range that ``ConfigManager`` enforces on it."""
    bounds = {"gt": gt, "ge": ge, "lt": lt, "le": le}
    return field(default=default, metadata={k: v for k, v in bounds.items() if v is not None})


@dataclass
class Job:
    """What this run is and where its outputs go."""

    config_file: str = ""
    """Path of the TOML recipe to load; CLI overrides are applied on top of it."""

    dump_folder: str = "./outputs"
    """Folder for TensorBoard logs, the resolved config and (later) checkpoints."""

    description: str = ""
    """Free-form description of the run, for humans."""

    recipe: Literal["sft", "grpo", "service", "dpo", "reward_model"] = "sft"
    """sft: supervised fine-tuning on training.dataset. grpo: RL from verifiable rewards: the
    policy samples completions of a task's prompts ([rl], [generation]), a verifier rewards
    them, and the loss of [loss] trains on group advantages. service: a Tinker-compatible
    training service ([service]): clients of the tinker SDK train LoRA adapters of the model
    and sample from them over HTTP. dpo: preference learning on training.dataset's chosen /
    rejected pairs with loss.loss_fn = dpo, ipo or simpo. reward_model: a Bradley–Terry reward
    model (the model with a scalar score head read at each sequence's last token) trained on
    training.dataset's pairs; exports as a Hugging Face Qwen3ForSequenceClassification."""


@dataclass
class Model:
    """Which model to build."""

    name: Literal["qwen3", "vlm"] = "qwen3"
    """Model family (``torchtitan_rl.models.registry``). qwen3: Qwen3 dense language model.
    vlm: vision-language model in the Mistral3 / Pixtral layout on a Qwen3 language model
    (a Pixtral vision transformer, 2x2 patch merger and MLP projector); trains on rows with
    images."""

    flavor: str = "debugmodel"
    """Size preset of the family: for qwen3 debugmodel, 0.6B, 1.7B, 4B, 8B, 14B, 32B and the
    MoE debugmodel_moe, 30B-A3B, 235B-A22B; for vlm debugmodel, 0.6B (Pixtral vision tower of
    Mistral-Small-3.1 on Qwen3-0.6B). "hf" takes the architecture from the config.json of
    checkpoint.initial_load_path (Hugging Face) or model.hf_assets_path: any Qwen3 size."""

    freeze_vision: bool = False
    """vlm: keep the vision tower's weights fixed (the projector and language model train)."""

    image_token: str = "[IMG]"
    """vlm: the placeholder token whose embedding an image feature replaces (one per merged
    patch), a special token of the tokenizer. With the three defaults ([IMG], [IMG_BREAK],
    [IMG_END]: Pixtral's, also specials of the byte tokenizer) and a tokenizer that has none of
    them but Qwen's vision specials (any stock Qwen2.5 / Qwen3 tokenizer.json), Qwen's are used:
    <|image_pad|>, <|vision_pad|>, <|vision_end|>."""

    image_break_token: str = "[IMG_BREAK]"
    """vlm: the token that ends each row of an image's placeholders (<|vision_pad|> with a stock
    Qwen tokenizer, see model.image_token)."""

    image_end_token: str = "[IMG_END]"
    """vlm: the token that ends an image's placeholders, in place of its last row break
    (<|vision_end|> with a stock Qwen tokenizer, see model.image_token)."""

    hf_assets_path: str = ""
    """Directory with an HF ``tokenizer.json`` (and, for loading weights, ``config.json`` and
    safetensors). Empty uses the built-in byte tokenizer."""

    attn_backend: Literal["auto", "sdpa_varlen", "sdpa_dense", "sdpa_loop", "flex"] = "auto"
    """Document-causal attention kernel. sdpa_varlen batches packed sequences of similar length
    into padded SDPA calls (work ∝ Σ len², also on a context-parallel share); sdpa_dense is one
    SDPA under a dense [tokens, tokens] mask (the reference; work ∝ tokens²); sdpa_loop runs
    SDPA once per packed sequence; flex uses flex_attention (CUDA only: no CPU backward). auto:
    flex on CUDA, sdpa_varlen otherwise."""


@dataclass
class Optimizer:
    """Optimizer hyper-parameters."""

    name: Literal["AdamW"] = "AdamW"
    """Optimizer class."""

    lr: float = bounded(8e-4, gt=0)
    """Peak learning rate, used at the first step after warmup."""

    beta1: float = bounded(0.9, ge=0, lt=1)
    """Adam first-moment decay."""

    beta2: float = bounded(0.95, ge=0, lt=1)
    """Adam second-moment decay."""

    eps: float = bounded(1e-8, gt=0)
    """Adam denominator epsilon."""

    weight_decay: float = bounded(0.1, ge=0)
    """Decoupled (AdamW) weight decay."""

    implementation: Literal["auto", "fused", "foreach"] = "auto"
    """AdamW kernel: fused (one kernel per parameter group; equal to foreach up to float
    rounding; figures in docs/benchmarks/optimizer.md) or foreach (multi-tensor ops). auto picks
    fused."""


@dataclass
class LRScheduler:
    """Learning-rate schedule: linear warmup, then decay to ``min_lr_factor * lr``."""

    warmup_steps: int = bounded(0, ge=0)
    """Steps of linear warmup from 0 to ``optimizer.lr``."""

    decay_type: Literal["linear", "cosine"] = "linear"
    """Shape of the decay after warmup, until ``training.steps``."""

    min_lr_factor: float = bounded(0.0, ge=0, le=1)
    """Final learning rate as a fraction of ``optimizer.lr``."""


@dataclass
class Training:
    """Steps, batch shapes, data and precision."""

    steps: int = bounded(200, gt=0)
    """Number of optimizer steps."""

    seq_len: int = bounded(512, ge=2)
    """Maximum number of model input tokens per sequence."""

    global_batch_size: int = bounded(8, gt=0)
    """Sequences per optimizer step, summed over all data-parallel ranks (the mini-batch the
    loss is normalized over)."""

    max_tokens_per_microbatch: int = bounded(0, ge=0)
    """Token budget of one packed micro-batch. 0 puts the rank's whole share of the mini-batch
    in one micro-batch; otherwise it must be >= seq_len so any sequence fits."""

    pipeline_microbatches: int = bounded(0, ge=0)
    """Pipeline parallel: split each rank's share of a mini-batch into at least this many
    micro-batches (fewer only when it has fewer samples), so that the stages have work at
    once; the pipeline's idle share (bubble) is about (stages - 1) / (micro-batches + stages -
    1) for 1F1B. 0: the number of pipeline stages. A step's micro-batches are padded to its
    longest (stages exchange fixed-shape activations), so keep them of similar size."""

    max_patches_per_microbatch: int = bounded(0, ge=0)
    """vlm: vision-patch budget of one packed micro-batch (the images' patches, before the
    2x2 merge), bounding the vision tower's work and memory. 0 means no budget. A sample
    whose images exceed it is an error: samples are never split."""

    max_image_tokens: int = bounded(256, gt=0)
    """vlm: largest number of image feature tokens (merged patches) per image; larger images
    are downscaled, keeping their aspect ratio, until they fit."""

    balance_dp_compute: bool = True
    """Assign the samples of each mini-batch to the data-parallel ranks by estimated compute
    (tokens, tokens squared, vision patches) instead of in contiguous slices, and pack each
    rank's share into the fewest micro-batches of about equal cost (costliest first) instead
    of in order, so that the ranks, which meet at every micro-batch's FSDP collectives, hold
    the same number of micro-batches of about the same work. The gradient does not change
    (except under token_mean_legacy, layout-dependent on purpose). SFT: computed identically
    on every rank from the global mini-batch, no communication. GRPO: the rollouts of each
    mini-batch are split over the ranks after scoring (two small host all-gathers per step:
    the sample lengths, then the samples that move). data/dp_cost_imbalance logs the slowest
    rank's total cost over the mean of the split used (also data/dp_cost_imbalance_contiguous
    and _balanced); false keeps each rank's contiguous share, packed in order."""

    max_norm: float = bounded(1.0, ge=0)
    """Gradient-norm clipping threshold. 0 disables clipping (the norm is still logged)."""

    dataset: str = "arithmetic"
    """Built-in task name, or the name of a dataset in the local HF cache. Used when
    dataset_path is empty."""

    dataset_path: str = ""
    """Local jsonl/json/parquet file or directory to train on; overrides dataset."""

    dataset_split: str = "train"
    """Split to read from the dataset."""

    dataset_cache_dir: str = ""
    """Folder where dataset_path's files are prepared, once per node by local rank 0, into
    memory-mapped Arrow files that every rank of the node shares (page cache) instead of
    holding a copy each. Named after the files' paths, sizes and modification times: a later
    run on the same files re-uses them, an edited file is prepared again; delete the folder's
    files to reclaim the space. Empty: <job.dump_folder>/dataset_cache."""

    dataset_cache_timeout_seconds: int = bounded(3600, gt=0)
    """How long the other ranks of a node wait for local rank 0 to prepare dataset_path's files."""

    dataset_prefetch: bool = True
    """Plan and tokenize the next step's mini-batch (and decode its images) in a background
    thread while the current step trains. The batches are the same either way."""

    num_synthetic_samples: int = bounded(20000, gt=0)
    """Number of samples a built-in synthetic task generates."""

    long_sample_policy: Literal["truncate", "drop"] = "truncate"
    """What to do with a sample longer than seq_len: cut it to seq_len, or skip it."""

    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Parameter dtype for compute on CUDA. CPU always trains in float32."""

    mixed_precision_reduce: Literal["float32"] = "float32"
    """Dtype of gradient reductions across ranks."""


@dataclass
class Parallelism:
    """Device mesh degrees; their product must equal the world size (less the rollout ranks)."""

    data_parallel_replicate_degree: int = bounded(1, ge=1)
    """HSDP replicate degree (parameters replicated, gradients summed)."""

    data_parallel_shard_degree: int = -1
    """FSDP shard degree. -1 takes the ranks left over by the other degrees; otherwise >= 1."""

    tensor_parallel_degree: int = bounded(1, ge=1)
    """Tensor-parallel degree (Megatron-style with sequence parallel; heads, KV heads, the MLP
    hidden size and the vocabulary must be divisible by it)."""

    disable_loss_parallel: bool = False
    """Under tensor parallel, gather each chunk's logits over the vocabulary before the loss
    instead of computing it vocab-parallel. Same numbers, more memory; a debugging aid."""

    context_parallel_degree: int = bounded(1, ge=1)
    """Context-parallel degree (each sequence split over this many ranks)."""

    expert_parallel_degree: int = bounded(1, ge=1)
    """Expert parallel degree for MoE models: each group of this many ranks splits every MoE
    layer's experts (num_experts / degree per rank) and sends each token to its experts' owner
    with all-to-all. Carved out of the ranks of a data-parallel replica (dp_shard * cp * tp, which
    it must divide, as it must num_experts): a group takes tp ranks first, then cp, then
    dp_shard. The ranks holding the same experts FSDP-shard them. 1: no expert parallel, every
    rank computes every expert, FSDP-sharded over dp_shard * cp * tp."""

    pipeline_parallel_degree: int = bounded(1, ge=1)
    """Pipeline-parallel degree: the model's layers split into stages over this many ranks,
    which pass hidden states (and their gradients) from stage to stage while working on
    different micro-batches at once. The outermost mesh dim (across nodes first). SFT, GRPO
    and DPO (dense, MoE and vision-language models); not yet with tied embeddings, PPO's
    critic, a reward model (trained, or in the RL loop) or the service."""

    pipeline_schedule: Literal["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"] = "1F1B"
    """The order in which the stages run the micro-batches' forward and backward passes
    (torch.distributed.pipelining's schedules). GPipe: every forward, then every backward (all
    micro-batches' activations alive at once). 1F1B: one forward, one backward once the
    pipeline is full (activations of at most pp micro-batches per stage). Interleaved1F1B:
    several smaller stages per rank, a smaller bubble for more point-to-point traffic.
    InterleavedZeroBubble and ZBVZeroBubble (two stages per rank in a V): input and weight
    gradients in separate passes that fill the bubble. See docs/parallelism.md."""

    pipeline_layers_per_stage: int = bounded(0, ge=0)
    """Layers per pipeline stage (the last stage takes what is left); the stages must number
    pipeline_parallel_degree for GPipe and 1F1B, a multiple of it for the interleaved
    schedules, twice it for ZBVZeroBubble. 0: one stage per rank (two per rank for the
    multi-stage schedules) with the layers spread evenly, earlier stages taking one more when
    they do not divide."""

    rollout_ranks: int = bounded(0, ge=0)
    """GRPO: reserve the last N ranks of the launch for generation (0 = colocated: every rank
    trains and generates). The other ranks train with the degrees above (their product is the
    world size minus N); after each RL step they broadcast the weights to the rollout ranks,
    which generate the next steps' rollouts meanwhile (rl.max_staleness). job.recipe = "service":
    the last N ranks run the sampling requests (the training ranks then never generate); they take
    the base weights once and each sampler snapshot's adapters from rank 0."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Which FSDP-sharded blocks free their gathered parameters after forward (backward then
    gathers them again). default: every block but the last one run in forward order, whose
    backward follows at once: one all-gather fewer per micro-batch for one block's gathered
    parameters kept. always: every block, the least memory. never: none, every block's
    parameters stay gathered from its forward to its backward: about half the all-gathers, for
    the memory of the unsharded model. MoE experts follow their block; a vision tower runs
    before the decoder, so its blocks are never last. The embeddings, final norm and output
    head (the root group) stay gathered after forward under every policy: the loss applies the
    output head after the model's forward."""


@dataclass
class ActivationCheckpoint:
    """Recompute activations in backward instead of keeping them (less memory, more compute).
    Parameter names, checkpoints and results are the same with or without it."""

    mode: Literal["none", "full", "selective"] = "none"
    """none: keep every activation. full: recompute every transformer block. selective:
    recompute every activation_checkpoint.selective_every-th block."""

    selective_every: int = bounded(2, ge=1)
    """selective: checkpoint blocks 0, k, 2k, ... for k = this value."""


@dataclass
class Compile:
    """torch.compile of each transformer block (the language model's and a vision tower's),
    with dynamic shapes in the packed token count, so micro-batches of new lengths reuse the
    compiled graphs (each compiles at most twice: for a first length, then dynamic). Attention and MoE experts run eagerly between the compiled parts; the
    embedding, final norm, output head and loss are not compiled. Parameter names and
    checkpoints are the same with or without it, results equal up to float rounding. Composes
    with FSDP, tensor and context parallel and activation checkpointing."""

    enable: bool = False
    """Compile every transformer block's forward (and with it its backward)."""

    backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """torch.compile backend: inductor generates fused kernels (C++ on CPU, Triton on CUDA);
    aot_eager and eager only trace the graphs (for debugging a compile problem)."""


@dataclass
class Loss:
    """The loss function and how its per-token terms are normalized; identical for any
    parallel layout. Every term (policy gradient, KL, entropy) is weighted by the same
    reduction weights, see docs/loss_reduction.md."""

    reduction: Literal[
        "token_mean", "sequence_mean", "seq_mean_token_sum_norm", "sum", "token_mean_legacy", "prompt_mean"
    ] = "token_mean"
    """token_mean: every loss token of the mini-batch weighs the same (1/N).
    sequence_mean: every sequence weighs the same (1/(n_i*B), GRPO).
    seq_mean_token_sum_norm: constant horizon 1/(L*B) (Dr. GRPO), L = loss.horizon.
    sum: raw sum of token losses; the caller normalizes.
    token_mean_legacy: token mean per micro-batch, then mean over micro-batches; reproduces
    the old layout-dependent behaviour on purpose.
    prompt_mean: every prompt group weighs the same, then every token within it
    (1/(P*N_p)); RL recipes only, samples need a prompt group."""

    horizon: int | None = bounded(None, gt=0)
    """The constant L of seq_mean_token_sum_norm. None uses training.seq_len."""

    logits_chunk_size: int = bounded(1024, gt=0)
    """Tokens per chunk of the output head and loss: at most this many tokens' logits exist at
    once. Each chunk's gradient is taken during the forward pass, so nothing is recomputed."""

    loss_fn: Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "gspo", "dpo", "ipo", "simpo"] = (
        "cross_entropy"
    )
    """Per-token policy term, with A the advantage and r = p_theta / p_old (p_old: the
    sampler's, or the proximal policy's when the RL recipe recomputes it):
    cross_entropy: -log p_theta (SFT).
    importance_sampling: -r*A.
    ppo: max(-r*A, -clip(r, 1-clip_low, 1+clip_high)*A), optionally dual-clipped.
    cispo: -stopgrad(clip(r, 1-clip_low, 1+clip_high))*A*log p_theta.
    gspo: ppo's form on the sequence ratio s = exp(mean over the sequence's loss tokens of
    log r), clipped per sequence (GSPO; use loss.reduction = "sequence_mean" for the paper's
    objective). importance_sampling, ppo, cispo and gspo need advantages and sampler log-probs
    (RL recipes). dpo, ipo and simpo are the preference losses of job.recipe = "dpo", on a
    completion's summed log-prob S and the reference's R, with h = (S_c - R_c) - (S_r - R_r):
    dpo: -log sigmoid(beta*h) (with loss.label_smoothing e: -(1-e) log sigmoid(beta*h) -
    e log sigmoid(-beta*h)); ipo: (h' - 1/(2*beta))^2, h' = h with each log-ratio divided by its
    completion's tokens; simpo (no reference): -log sigmoid(beta*(S_c/n_c - S_r/n_r) - gamma),
    gamma = loss.simpo_gamma."""

    beta: float = 0.1
    """dpo / ipo / simpo: the preference losses' beta (DPO's KL strength; IPO's tau; SimPO's
    reward scale); > 0."""

    label_smoothing: float = 0.0
    """dpo / simpo: the probability that a pair's labels are flipped (conservative DPO); in
    [0, 0.5)."""

    simpo_gamma: float = 0.5
    """simpo: the target reward margin gamma."""

    center_rewards_coefficient: float = bounded(0.0, ge=0)
    """reward_model: adds this times the mean of (s_chosen + s_rejected)^2 over the pairs to the
    Bradley–Terry loss, which centers the scores on 0 (the pair loss only sees differences); >= 0."""

    nll_coef: float = 0.0
    """dpo / ipo / simpo: adds this times the chosen completions' negative log-likelihood per
    token (over all chosen tokens of the mini-batch) to the loss, which keeps the chosen answers
    likely (RPO; TRL's loss_type "sft" term with its loss_weights, OpenRLHF's nll_loss_coef); >= 0."""

    clip_low: float | None = None
    """ppo / cispo / gspo: the ratio's lower clip bound is 1 - clip_low; in [0, 1). None: the
    loss function's default, 0.2 (ppo, cispo) or 3e-4 (gspo, the GSPO paper's)."""

    clip_high: float | None = None
    """ppo / cispo / gspo: the ratio's upper clip bound is 1 + clip_high; >= 0. None: 0.2
    (ppo, cispo; DAPO's clip-higher uses e.g. 0.28) or 4e-4 (gspo)."""

    dual_clip_c: float | None = None
    """ppo: dual clip for negative advantages, the loss never exceeds -dual_clip_c * A; > 1.
    None disables it."""

    kl_coef: float = 0.0
    """Coefficient of the KL penalty to the reference policy (per token, weighted like the
    policy term); >= 0. Needs reference log-probs (RL recipes)."""

    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    """KL estimator, with d = log p_theta - log p_ref: k1 = d, k2 = d^2/2,
    k3 = exp(-d) - 1 + d (unclamped: up to ~5e8 per token when p_theta << p_ref),
    low_var_kl = min(k3, 10), the default (the clamped k3)."""

    entropy_coef: float = 0.0
    """Coefficient of the entropy bonus: the loss gets -entropy_coef * H_t per token
    (weighted like the policy term). Negative values penalize entropy."""

    value_clip: float = bounded(0.0, ge=0)
    """rl.advantage = "gae": clip the critic's new values to old_value ± value_clip in the value
    loss max((V - R)^2, (clip(V) - R)^2) / 2, with old_value the critic's value when the rollouts
    were scored (verl's cliprange_value, default 0.5 there); 0 disables clipping."""


@dataclass
class MoE:
    """Mixture-of-experts flavors (e.g. model.flavor = "debugmodel_moe", "30B-A3B"): router
    losses, exact for any parallel layout (docs/loss_reduction.md), and the expert kernel. The
    objective is the token loss + aux_loss_coef * moe/aux_loss + z_loss_coef * moe/z_loss."""

    aux_loss_coef: float = bounded(0.0, ge=0)
    """Coefficient of the load-balancing loss E * sum_e f_e * P_e (f: share of top-k
    assignments, P: mean router probability of expert e); 0 disables it. A Hugging Face export
    writes it as router_aux_loss_coef (with output_router_logits = true); with 0 it keeps the
    values of the imported config.json (a named flavor: 0.001 and false)."""

    aux_loss_scope: Literal["global", "sequence", "microbatch"] = "global"
    """Which tokens one load-balancing loss covers. global: the whole mini-batch (global-batch
    balance; with several micro-batches per rank a no-grad counting pass routes
    them all first). sequence: each sequence, averaged over sequences. microbatch: each
    micro-batch, averaged over micro-batches; depends on the parallel layout on purpose
    (like loss.reduction = token_mean_legacy)."""

    aux_loss_layers: Literal["pooled", "sum"] = "pooled"
    """pooled: one loss over the statistics of all MoE layers (the form a Hugging Face
    Qwen3-MoE export computes). sum: one loss per layer, summed."""

    z_loss_coef: float = bounded(0.0, ge=0)
    """Coefficient of the router z-loss, the mean over real tokens of the sum over MoE layers of
    logsumexp(router logits)^2; 0 disables it."""

    experts_impl: Literal["auto", "grouped_mm", "loop"] = "auto"
    """Expert kernel: grouped_mm (torch._grouped_mm, fp32/bf16), loop (one matmul per expert;
    any dtype), auto (grouped_mm where it supports the dtype)."""

    router_replay: Literal["off", "record", "rollout"] = "off"
    """RL (grpo): routing replay from the sampler to the trainer. rollout: the generator records
    each token's top-k experts in every MoE layer, and the trainer's passes over the rollouts
    (proximal log-probs and the update) route those tokens to the recorded experts instead of
    their own top-k; the weights of the recorded experts still come from the trainer's router,
    so it keeps its gradient (docs/moe.md, 'Routing replay'). record: record and report
    moe/routing_agreement without replaying. off: neither."""

    router_replay_prompt: bool = False
    """With router_replay: also record and replay the routing of the prompt tokens (by default
    only the positions from the last prompt token on, each of which samples a token or reads an
    observation, are recorded). Costs L * k bytes per prompt token and rollout."""


@dataclass
class LoRA:
    """Low-rank adapters (LoRA) beside frozen base weights, for SFT and GRPO: only the adapters
    (and, with lora.train_embeddings, the input embedding) get gradients and optimizer state.
    Exact under every parallel layout like full fine-tuning (docs/design.md, "LoRA")."""

    enable: bool = False
    """Train adapters instead of the full model."""

    rank: int = bounded(8, ge=1)
    """Inner dimension r of each adapter (A is [r, in], B is [out, r])."""

    alpha: float = bounded(16.0, gt=0)
    """The adapter's output is scaled by alpha / rank (PEFT's lora_alpha)."""

    dropout: float = bounded(0.0, ge=0, lt=1)
    """Dropout on each adapter's input (PEFT's lora_dropout). Its random masks depend on how
    tokens are split over micro-batches and ranks, so with dropout the gradient is no longer
    independent of the layout; not supported with tensor parallel."""

    target_modules: list[str] = field(default_factory=lambda: ["wq", "wk", "wv", "wo", "w1", "w2", "w3"])
    """Linear layers to adapt: the attention projections wq, wk, wv, wo, the dense MLP's w1 (gate),
    w2 (down), w3 (up) in every layer, output (the head; not with tied embeddings), and for vlm
    projector (the projector's merger and two linears). MoE experts are not adapted (their
    layers' attention is)."""

    init: Literal["kaiming", "gaussian"] = "kaiming"
    """Initialization of A: kaiming (uniform, bound 1/sqrt(in), PEFT's default) or gaussian
    (std 1/rank). B starts at zero, so training starts from the base model."""

    train_embeddings: bool = False
    """Also train the input embedding (whole, as PEFT's modules_to_save)."""

    base_dtype: Literal["float32", "bfloat16"] = "float32"
    """Storage dtype of the adapted layers' frozen base weights; bfloat16 halves their memory
    and is cast to the compute dtype in the forward. Adapters keep float32."""

    export_merged: bool = False
    """With checkpoint.last_save_in_hf: also write the base with the adapters merged, as a plain
    Hugging Face model (``merged/`` inside the export)."""


@dataclass
class RL:
    """GRPO (job.recipe = "grpo"): prompts, rewards, advantages, updates, evaluation."""

    task: str = "arithmetic"
    """Verifiable task: a built-in one (arithmetic, reverse, calculator, guess_number, shapes),
    dataset (rows {"prompt" | "messages", "answer", ...} of rl.task_path; messages may hold
    images, for a vision-language model), or a user's task factory "package.module:function"
    (called at start-up with the keywords among seed, task_path, num_train_prompts and
    num_eval_prompts it declares; returns an object with train_problems, eval_problems,
    optionally spare_problems, and reward(problem, completion, stopped)). calculator and
    guess_number are the problems of the environments of those names (rl.env); shapes asks the
    colour, the shape or the number of shapes drawn in fresh images (model.name = "vlm")."""

    reward_fn: str = ""
    """A user's reward function "package.module:function", replacing the task's verifier:
    called as fn(problem, completion, stopped) with the Problem (its messages, answer, source and,
    for a dataset row, its other columns in problem.extra), the completion's text without its
    stop token and whether it stopped on a stop token. Returns a number, or a dict of named
    numbers whose sum is the reward, each logged as rl/reward_<name>. A completion is correct
    (pass@k) when a "correct" component of 0 or 1 says so, else when its reward is >= 1.
    Imported and checked at start-up; "" keeps the task's verifier."""

    reward_model: str = ""
    """A reward model that scores every completion: a Hugging Face
    Qwen3ForSequenceClassification directory (job.recipe = "reward_model" writes one with
    checkpoint.last_save_in_hf), whose tokenizer must be the policy's. It reads the prompt and
    the completion (its stop token included) and its score at the last token, times
    rl.reward_model_weight, is added to the verifier's reward (or rl.reward_fn's) and logged as
    rl/reward_model; with rl.reward_model_alone it is the whole reward. Scored on an unsharded
    replica in generation.dtype, in packed batches of training.max_tokens_per_microbatch tokens
    (0: training.seq_len), wherever the rollouts are made (the training ranks, or the rollout
    ranks), after the verifier. Single-turn text tasks only. "" = no reward model."""

    reward_model_weight: float = bounded(1.0, gt=0)
    """The factor of the reward model's (normalized) score in the reward."""

    reward_model_normalize: bool = False
    """Standardize the reward model's scores over each sampling round's rollouts (those of
    every rank: the same for every layout) to mean 0 and standard deviation 1 before
    rl.reward_model_weight, so the weight sets their scale next to the verifier's reward."""

    reward_model_alone: bool = False
    """The reward is the reward model's score alone; the verifier (or rl.reward_fn) still
    judges which completions are correct (rl/pass@1, the evaluation) but adds nothing. Rows of
    a dataset task may then lack an answer: they count as not correct."""

    env: str = ""
    """Multi-turn environment: a built-in one (calculator, guess_number) or a user's class as
    "package.module:ClassName" (imported and checked at start-up); "" = single-turn, the task's
    verifier scores each completion. Each episode is made from one of rl.task's problems, gives
    the first messages and answers every turn of the policy; an episode ends when the
    environment says so, after rl.max_turns turns, or when it would not fit training.seq_len.
    Its reward is the sum of its turns' rewards. Observation tokens (tool outputs, the chat
    template's glue) are attended to but carry no loss."""

    max_turns: int = bounded(4, ge=1)
    """With rl.env: the most turns of the policy per episode."""

    task_path: str = ""
    """The rows of rl.task = "dataset": a .jsonl, .json or .parquet file, or a directory of files
    of one format (e.g. written by datasets' to_json / to_parquet); offered to a task factory too."""

    eval_task_path: str = ""
    """rl.task = "dataset": a file (or directory) of held-out rows to evaluate on, instead of
    holding rl.num_eval_prompts rows of rl.task_path out; train rows that repeat one of its
    prompts are left out of training (counted in the log)."""

    answer_match: Literal["exact", "numeric"] = "exact"
    """dataset task: a completion is correct when it equals the answer (exact, after stripping
    whitespace) or parses as the same number (numeric)."""

    num_train_prompts: int = bounded(0, ge=0)
    """Size of the training prompt pool; 0 takes every row not held out of a dataset task, 1000
    problems of a built-in one (a task factory gets it as num_train_prompts). A small pool (e.g. 8) is what a tiny model can visibly learn
    by RL in minutes."""

    num_eval_prompts: int = bounded(64, ge=0)
    """Held-out prompts for evaluation (never in the training pool). With rl.eval_interval = 0
    none are held out: a dataset task trains on every row. With rl.eval_task_path, how many of
    its rows to evaluate on (a seeded draw; 0: all)."""

    partial_credit: float = bounded(0.0, ge=0)
    """Weight of the partial reward of a wrong answer (matching characters in place, 0..1)."""

    format_reward: float = bounded(0.0, ge=0)
    """Reward added when the completion ends with a stop token (not cut at
    generation.max_new_tokens)."""

    group_size: int = bounded(8, ge=1)
    """Completions sampled per prompt; the group is the advantage's baseline (at least 2),
    except under rl.advantage = "gae", where the critic is and 1 is allowed."""

    prompts_per_step: int = bounded(16, ge=1)
    """Prompts per RL step over all ranks (the rollout batch is prompts_per_step * group_size
    completions); divisible by rl.num_minibatches times the data-parallel degree."""

    advantage: Literal["grpo", "dr_grpo", "rloo", "gae"] = "grpo"
    """grpo: group z-score (r - mean) / (std + eps), Bessel std. dr_grpo: r - mean (Dr. GRPO).
    rloo: r minus the mean of the group's other samples. gae: PPO with a learned critic
    ([critic]): per-token advantages by generalized advantage estimation (rl.gamma, rl.lam)
    over each rollout's sampled tokens, from the critic's values and the reward on the last
    sampled token, whitened over the step's rollouts; the critic learns the returns in the same
    step. Dense text qwen3 models only."""

    gamma: float = bounded(1.0, ge=0, le=1)
    """rl.advantage = "gae": the discount per sampled token (observation tokens of an episode
    take no step)."""

    lam: float = bounded(1.0, ge=0, le=1)
    """rl.advantage = "gae": GAE's lambda (1: Monte-Carlo returns minus the values; 0: one-step
    temporal differences)."""

    kl_in_reward_coef: float = bounded(0.0, ge=0)
    """rl.advantage = "gae": subtract this times log p_sampler - log p_ref (per sampled token,
    k1) from each token's reward, verl's use_kl_in_reward; needs rl.use_reference = true. 0
    disables it (loss.kl_coef is the KL term in the loss instead)."""

    advantage_eps: float = bounded(1e-6, gt=0)
    """The eps of grpo's (r - mean) / (std + eps)."""

    filter_zero_variance_groups: bool = False
    """Drop groups whose rewards are all equal (zero advantage: no signal) before training;
    they are counted in rl/filtered_groups."""

    ppo_epochs: int = bounded(1, ge=1)
    """Passes over each rollout batch."""

    num_minibatches: int = bounded(1, ge=1)
    """Optimizer steps per pass over a rollout batch. With more than one (or ppo_epochs > 1, a
    rollout correction, or rl.max_staleness > 0) the ratio's denominator is the proximal policy
    pi_prox, the policy before the update (decoupled PPO), and the sampler's log-probs are kept
    apart for the correction; see rl.proximal for where pi_prox's log-probs come from."""

    proximal: Literal["auto", "recompute"] = "auto"
    """Where the proximal policy's log-probs come from. auto: when the update is the only
    optimizer step on its rollouts (ppo_epochs = 1, num_minibatches = 1, max_staleness = 0),
    pi_prox is the policy being trained, so they are the update's own forward (detached) and the
    rollout-correction weights are computed inside the loss pass: no separate forward over the
    rollouts; otherwise a separate forward before the update recomputes them. recompute: that
    separate forward whenever pi_prox is used (the same numbers up to float rounding)."""

    rollout_correction: Literal["none", "tis", "mis", "icepop", "geo_mask"] = "none"
    """Weight of each token's policy term for the sampler/trainer mismatch, with
    rho = pi_prox / pi_sampler (per token, or the sequence's product, see
    rl.rollout_correction_level): tis: min(rho, max). mis: rho where rho <= max, else 0.
    icepop: rho where min <= rho <= max, else 0. geo_mask: 1 where the sequence's geometric
    mean ratio is in [min, max], else 0 (per sequence: set rl.rollout_correction_level =
    "sequence"). none: 1. A weight of 0 masks
    the token (it still counts in the reduction). Uses pi_prox every step (rl.proximal)."""

    rollout_correction_level: Literal["token", "sequence"] = "token"
    """Whether rho is each token's ratio or its sequence's product of ratios (tis, mis, icepop);
    geo_mask works per sequence and takes "sequence" only."""

    rollout_correction_max: float = bounded(2.0, gt=0)
    """The cap C of tis and the upper bound of mis, icepop and geo_mask."""

    rollout_correction_min: float = bounded(0.5, ge=0)
    """The lower bound of icepop and geo_mask (below max)."""

    use_reference: bool = False
    """Keep a frozen copy of the starting policy (FSDP-sharded like it) for the KL penalty
    loss.kl_coef; needed exactly when loss.kl_coef > 0. With lora.enable the reference is the
    base (the policy with its adapters off, no copy), so RL must start from untrained adapters."""

    eval_interval: int = bounded(0, ge=0)
    """Evaluate every this many steps (and at the last step, and, on a run that starts RL, at
    step 0: the policy RL starts from): greedy pass@1 and sampled pass@k on the held-out
    prompts. 0 disables evaluation."""

    eval_num_samples: int = bounded(8, ge=1)
    """k of the sampled pass@k evaluation (completions per held-out prompt)."""

    dump_rollouts: bool = True
    """Write every trained rollout of every step to <job.dump_folder>/rollouts/step-<N>.jsonl.gz
    and every evaluation to <job.dump_folder>/evals/step-<N>.jsonl.gz (text, token counts,
    reward and its components, advantage, policy version, log-prob means; fields in docs/rl.md).
    Gathered to rank 0 and written by a background thread; roughly the completions' text
    gzip-compressed per step. Read them with scripts/show_rollouts.py."""

    dump_routing: bool = True
    """With rl.dump_rollouts and moe.router_replay: also write each rollout's recorded experts to
    rollouts/step-<N>.routing.npy (docs/rl.md). They weigh (MoE layers x top_k) bytes per recorded
    token, e.g. 384 for 30B-A3B, all gathered to rank 0: turn this off for large MoE runs that do
    not need them."""

    log_samples: int = bounded(4, ge=0)
    """Rollouts per step (and evaluation prompts per evaluation) shown as a TensorBoard text
    table (tags rollouts/samples and eval/samples): prompt, completion, reward, advantage. 0: none."""

    print_samples: bool = False
    """Also print the rl.log_samples table to the console every metrics.log_freq steps."""

    sft_warmup_steps: int = bounded(0, ge=0)
    """SFT steps before RL on answered problems of the task that are neither RL training nor
    held-out prompts: fresh problems of a built-in task; for a dataset task or a task factory,
    the rows left out of rl.num_train_prompts or the factory's spare_problems (an error when
    there are none). Run only when the run starts from scratch (no checkpoint to resume, no
    checkpoint.initial_load_path; with rl.sft_warmup_only also from initial_load_path's
    weights): a random model never earns a reward."""

    sft_warmup_only: bool = False
    """Run the SFT warm-up (and, with rl.eval_interval > 0, the held-out evaluation of its
    result at step 0), save the warmed-up model as checkpoint step-0 and exit, without RL. The
    save is model only, in checkpoint.export_dtype, in Hugging Face format with
    checkpoint.last_save_in_hf (needs checkpoint.enable). A GRPO run starts from it with
    checkpoint.initial_load_path = "<job.dump_folder>/<checkpoint.folder>/step-0" (and
    checkpoint.initial_load_in_hf for the Hugging Face form)."""

    sft_warmup_batch_size: int = bounded(32, ge=1)
    """Sequences per SFT warm-up step (over all ranks; divisible by the data-parallel degree)."""

    sft_warmup_lr: float = bounded(3e-3, gt=0)
    """Learning rate of the SFT warm-up (its own AdamW, discarded before RL)."""

    sft_warmup_demonstrations: float = bounded(1.0, ge=0, le=1)
    """With rl.env: the fraction of warm-up rows that are whole episodes solved the environment's
    way (its demonstration(problem), e.g. calling the calculator); the others answer at once. Below
    1 the warm-up teaches the format and leaves RL to find when the environment's way pays."""

    sft_warmup_demonstration_steps: int = bounded(0, ge=0)
    """With rl.env: the first this many of the rl.sft_warmup_steps train on demonstrations only
    (every row solved the environment's way), the rest on the rl.sft_warmup_demonstrations mix.
    A skill the demonstrations teach, like copying a tool's result into the answer, is then
    learned without direct answers to the same questions competing for those tokens; the mix
    after it sets how often the policy takes the environment's way. At most rl.sft_warmup_steps;
    needs an rl.env with a demonstration(problem)."""

    dynamic_sampling: bool = False
    """DAPO dynamic sampling: after the step's rl.prompts_per_step prompts, draw further rounds
    of as many prompts from the stream until the step has rl.prompts_per_step groups with
    signal (rewards not all equal), at most rl.max_sampling_rounds rounds, and train the first
    ones found (in round, then prompt order). Implies rl.filter_zero_variance_groups (do not set
    both). The rollout metrics (rl/reward_mean, rl/pass@1, rl/groups_*, rl/filtered_groups, ...)
    cover every group generated in the step; rl/dynamic_sampling/rounds counts the rounds drawn
    and rl/dynamic_sampling/groups_with_signal the groups with signal they found."""

    max_staleness: int = bounded(0, ge=0)
    """With parallelism.rollout_ranks: how many RL steps the weights that generate a step's
    rollouts may lag behind the policy that trains on them. The rollouts of step t are generated
    with the weights after step max(start, t - 1 - K) (K this value; start: the step the run
    started or resumed at), so the rollout ranks generate up to K steps ahead while the trainers
    train; 0 is synchronous (the same numbers as the colocated run). The schedule depends on
    (t, K) only, never on timing. Above 0 the proximal log-probs are recomputed, so the ratio is
    taken to the policy before the update and rl.rollout_correction weights the gap to the
    sampler's weights (decoupled PPO). Logged: rl/staleness_mean, rl/staleness_max (in steps,
    over the trained rollouts), rl/dropped_stale (rollout batches dropped for lagging more
    than K, which only a resume with a smaller K meets: they are generated again) and
    rl/stale_logprob_diff_* (the log-prob gap of stale rollouts to the proximal policy)."""

    max_sampling_rounds: int = bounded(3, ge=1)
    """Most rounds of rl.dynamic_sampling per step. When they find fewer groups with signal than
    rl.prompts_per_step, the step trains on those (a warning is logged)."""

    overlong_buffer: int = bounded(0, ge=0)
    """DAPO overlong reward shaping; 0 disables. With L = generation.max_new_tokens and B this
    buffer (below L), a completion of n tokens (stop token included) longer than L - B loses
    rl.overlong_penalty * (n - (L - B)) / B of reward before the advantages. Logged:
    rl/overlong/penalized (fraction of rollouts penalized) and rl/reward_overlong (mean penalty)."""

    overlong_penalty: float = bounded(1.0, ge=0)
    """The reward a completion of generation.max_new_tokens tokens loses under rl.overlong_buffer."""

    mask_truncated: bool = False
    """Completions cut at generation.max_new_tokens carry no loss tokens; their rewards still
    enter their group's advantage baseline. rl/masked_truncated counts the trained rollouts
    masked in the step."""


@dataclass
class Generation:
    """Sampling of rollouts (job.recipe = "grpo")."""

    max_new_tokens: int = bounded(16, ge=1)
    """Longest completion; a completion cut here counts as truncated."""

    temperature: float = bounded(1.0, gt=0)
    """Sampling temperature. The trainer evaluates log-probs of the same softmax(logits / T)."""

    top_p: float = bounded(1.0, gt=0, le=1)
    """Nucleus sampling; 1 disables. Below 1 the sampler draws from a truncated distribution
    while the trainer evaluates the full softmax, which biases every ratio-based loss: refused
    for training rollouts."""

    top_k: int = bounded(0, ge=0)
    """Sample among the k most likely tokens; 0 disables. Refused like top_p < 1."""

    stop_tokens: list[str] = field(default_factory=lambda: ["<|im_end|>", "<|endoftext|>"])
    """Special tokens that end a completion (kept in it, and in the loss)."""

    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of the generator's replica of the policy, and of the weights sent to rollout ranks.
    auto: the trainer's compute dtype, training.mixed_precision_param on CUDA (bfloat16 by
    default), float32 on the CPU. bfloat16 on the CPU samples with
    other numerics than the float32 trainer: the sampler/trainer mismatch that
    rl.rollout_correction corrects (rl/sampler_logprob_diff_*: trainer vs sampler log-probs of
    the same weights; rl/rollout_corr/kl_*, which with rl.max_staleness also holds the staleness
    that rl/stale_logprob_diff_* shows)."""

    seed: int = 0
    """Seed of the rollouts: each completion's randomness depends only on (seed, step, prompt,
    sample), never on the parallel layout."""

    max_prompts_per_batch: int = bounded(8, ge=1)
    """Prompts whose rows (times rl.group_size) a rank's KV cache holds at once: a ceiling, not a
    batch to wait for. Rows that finish leave and the next queued prompt takes their rows once
    all its samples fit (continuous batching). Rollouts do not depend on it up to the rounding
    of float kernels for other batch shapes."""

    compile: bool = False
    """Compile the generator's decode step: one graph per bucket of running rows (powers of two
    from 8, up to the KV cache's rows) and of cache slots (powers of two from 64: a cache may
    hold up to twice the slots its rows need), with CUDA graphs on CUDA (mode="reduce-overhead").
    Worth it on GPUs, where an eager decode step of a small batch is bound by kernel launches;
    each bucket compiles once per run (seconds to minutes)."""


@dataclass
class Service:
    """The Tinker-compatible service (job.recipe = "service"): rank 0 serves the tinker SDK's
    HTTP API; every rank runs the accepted operations in one order. Training clients are LoRA
    adapters of the [model] (lora.rank is the largest rank a client may ask for, on the layers
    of lora.target_modules), with an AdamW state each; loss.reduction must be "sum"."""

    host: str = "127.0.0.1"
    """Address the HTTP server binds; the loopback default serves this machine only."""

    port: int = bounded(8000, ge=0, le=65535)
    """TCP port of the HTTP server; 0 picks a free one (logged, and written to
    job.dump_folder/service.json)."""

    api_key: str = ""
    """When set, requests must carry it as X-API-Key (the SDK's api_key / TINKER_API_KEY); empty
    accepts any key."""

    base_models: list[str] = field(default_factory=lambda: ["Qwen/Qwen3-8B"])
    """The base_model names clients may ask for; all of them name this launch's [model] (one
    model per launch: its weights fill the ranks). The first is reported as the model's name."""

    lora_alpha: float = bounded(32.0, gt=0)
    """Every client's adapters are scaled by lora_alpha / (the client's rank)."""

    keepalive_seconds: float = bounded(5.0, gt=0)
    """While no operation is queued, rank 0 tells the other ranks it is alive this often, so that
    an idle service never runs into comm.collective_timeout_seconds."""


@dataclass
class Preference:
    """Preference learning (job.recipe = "dpo"): evaluation on pairs held out of training.dataset."""

    eval_interval: int = bounded(0, ge=0)
    """Evaluate every this many steps (and at step 0 and the last step) on preference.num_eval_pairs
    pairs held out of training.dataset: the loss and rewards/* of the pairs (eval/loss,
    eval/rewards/accuracies, ...), and how often the greedy completion of a pair's prompt is its
    chosen completion token for token (eval/greedy_is_chosen; generation.max_new_tokens,
    generation.stop_tokens). 0 disables evaluation and holds no pair out."""

    num_eval_pairs: int = bounded(64, ge=1)
    """Pairs held out of training.dataset for evaluation (a seeded draw of rows, never trained
    on), with preference.eval_interval > 0."""


@dataclass
class Critic:
    """PPO's value model (rl.advantage = "gae"): the policy's architecture with a scalar head per
    token, trained in every RL step on the policy's meshes with its own AdamW (optimizer.beta1,
    beta2, eps and implementation, and lr_scheduler's decay are shared with the policy)."""

    lr: float = bounded(1e-5, gt=0)
    """The critic's peak learning rate."""

    lr_warmup_steps: int = bounded(0, ge=0)
    """Linear learning-rate warm-up of the critic, in its optimizer steps."""

    weight_decay: float = bounded(0.0, ge=0)
    """The critic's AdamW weight decay."""

    max_norm: float = bounded(1.0, gt=0)
    """Clip the critic's gradient to this global norm (logged before clipping as critic/grad_norm)."""

    value_coef: float = bounded(1.0, gt=0)
    """Factor of the value loss (it scales the critic's gradient only; the policy is apart)."""

    warmup_steps: int = bounded(0, ge=0)
    """The first this many RL steps train the critic only: the policy does not move until its
    baseline has learned something (verl's critic_warmup). Below training.steps."""

    lora: bool = False
    """Train the critic as LoRA adapters with [lora]'s settings (needs lora.enable) plus its value
    head, on a frozen base; false trains the whole critic. Its checkpoints hold the whole critic;
    its Hugging Face export is the merged model."""

    initial_load_path: str = ""
    """A Hugging Face directory the critic starts from: a Qwen3ForTokenClassification with one
    label (the critic this recipe exports at the last save with checkpoint.last_save_in_hf, in
    <step>/critic), a Qwen3ForSequenceClassification reward model (its head, bias 0), or a
    language model (its body, a fresh head); of the policy's architecture. "" starts from the
    policy's starting weights (after rl.sft_warmup_steps, or checkpoint.initial_load_path) with
    a fresh head."""


@dataclass
class Metrics:
    """Logging."""

    log_freq: int = bounded(10, ge=1)
    """Log metrics every this many steps."""

    enable_tensorboard: bool = True
    """Write TensorBoard event files."""

    save_tb_folder: str = "tb"
    """TensorBoard subfolder of job.dump_folder."""


@dataclass
class Profiling:
    """Memory profiling of chosen steps (off by default)."""

    enable_memory_snapshot: bool = False
    """Record the memory of the steps in memory_snapshot_steps, one file per rank and step. On
    CUDA: an allocator snapshot (.pickle, for https://pytorch.org/memory_viz). On CPU, which has
    no allocator history: a timeline of the bytes the step allocates, from the PyTorch profiler
    (.json)."""

    memory_snapshot_steps: list[int] = field(default_factory=lambda: [1])
    """Steps to record (1-based, each at most training.steps). Step 1 also allocates the
    optimizer state; later steps show the steady state."""

    memory_snapshot_max_entries: int = bounded(100000, ge=1)
    """Allocator history entries kept on CUDA (older ones are dropped); unused on CPU."""

    save_memory_snapshot_folder: str = "memory_snapshot"
    """Subfolder of job.dump_folder for the files, as step_{N}/rank{R}_dp{d}_cp{c}_tp{t}_*."""


@dataclass
class Checkpoint:
    """Saving and resuming the training state (torch.distributed.checkpoint), and initial weights."""

    enable: bool = False
    """Save checkpoints every checkpoint.interval steps and at the last step, and resume from
    the latest complete one in checkpoint.folder at start-up."""

    folder: str = "checkpoint"
    """Subfolder of job.dump_folder holding the step-{N} checkpoints."""

    interval: int = bounded(500, ge=1)
    """Save every this many steps (the last step is always saved)."""

    keep_latest_k: int = bounded(0, ge=0)
    """Keep only the newest k complete checkpoints; 0 keeps all. A checkpoint is deleted only
    after a newer one is complete, so the only complete checkpoint is never deleted."""

    load_step: int = bounded(-1, ge=-1)
    """Step to resume from; -1 takes the latest complete checkpoint."""

    initial_load_path: str = ""
    """Weights to start from when checkpoint.folder holds no checkpoint yet: a Hugging Face
    directory (with checkpoint.initial_load_in_hf) or one of our step-{N} folders. Empty
    starts from random weights."""

    initial_load_model_only: bool = True
    """Load only the model weights from initial_load_path (not optimizer, schedule, data
    position or step). Hugging Face weights are always model only."""

    initial_load_in_hf: bool = False
    """initial_load_path is a Hugging Face directory (config.json + safetensors)."""

    initial_load_adapter_path: str = ""
    """With lora.enable: a PEFT adapter directory (adapter_config.json +
    adapter_model.safetensors) whose adapters training starts from, on top of the base weights
    of initial_load_path. Its rank, alpha and target modules must be this run's."""

    last_save_model_only: bool = False
    """At the last step save only the model weights, in checkpoint.export_dtype."""

    last_save_in_hf: bool = False
    """Write the last step's model-only save in Hugging Face format (safetensors +
    config.json + tokenizer files), loadable by transformers. Needs last_save_model_only."""

    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of a model-only last save."""

    async_mode: Literal["disabled", "async"] = "disabled"
    """disabled: saves block the step. async: the state is copied to host memory and written
    in the background; the checkpoint is marked complete once every rank finished writing."""


@dataclass
class Debug:
    """Reproducibility."""

    seed: int = 42
    """Random seed for model init and data order."""

    deterministic: bool = False
    """Use deterministic kernels (slower). On CUDA the loss's per-sequence sums and an MoE
    layer's combine (float index_add_) and indexing backwards otherwise add in a varying
    order, so reruns and resumes match bit for bit only with this on; on the CPU they always
    do."""


@dataclass
class Comm:
    """Process groups and how long a rank waits for the others."""

    collective_timeout_seconds: int = bounded(300, gt=0)
    """The timeout of every collective of the launch's process groups (on NCCL, the watchdog's):
    the start-up, the training step's collectives, a checkpoint's barriers, the rollout ranks'
    split of a step. A rank may wait in one while a peer works alone (rank 0 writing a file of
    a Hugging Face export between two gathers), so it must cover the longest such stretch. With
    parallelism.rollout_ranks it also bounds one transfer of a message or of the weights, once
    both sides are at it."""

    silent_peer_timeout_seconds: int = bounded(120, gt=0)
    """With parallelism.rollout_ranks: how long a rank may send no heartbeat before a rank that
    waits in the rollout-rank protocol stops the run with an error naming it (stopped, hung or on
    a lost host; a rank that exits stops the launch at once through torchrun). Every rank beats
    every tenth of this (5 s at most) through the launch's key-value store, so a wait on a peer
    that is alive has no bound: the trainers' SFT warm-up, checkpoint load and saves,
    evaluation and final export, and the rollout ranks' generation ahead take what they take.
    Below comm.collective_timeout_seconds, so that the silent rank is named before a collective
    it stalls ends the run with the backend's message. A process that holds Python's GIL
    for longer without a break looks silent too."""


@dataclass
class Estimate:
    """``python train.py --job.config_file X --estimate``: print each rank's memory under the
    config's layout (no process group, no weights) and exit, instead of training (docs/memory.md)."""

    enable: bool = False
    """Estimate instead of training (``--estimate`` is short for ``--estimate.enable true``)."""

    world_size: int = bounded(8, ge=1)
    """The ranks of the launch to estimate for (rollout ranks included), as torchrun's
    ``--nproc_per_node`` times the nodes."""

    device_memory: float = bounded(80.0, gt=0)
    """GiB of one device's memory: whether each rank's peak fits it."""

    search: bool = False
    """Also list every layout of estimate.world_size ranks (degrees, activation checkpointing,
    and for GRPO rollout ranks and generation.max_prompts_per_batch) that the config's rules
    accept and that fits estimate.device_memory, fastest first by the cost model in
    docs/memory.md."""

    num_layouts: int = bounded(10, ge=1)
    """How many of the fitting layouts estimate.search prints."""


@dataclass
class JobConfig:
    """The full configuration of a run; each field is one TOML section."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    loss: Loss = field(default_factory=Loss)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    moe: MoE = field(default_factory=MoE)
    lora: LoRA = field(default_factory=LoRA)
    rl: RL = field(default_factory=RL)
    generation: Generation = field(default_factory=Generation)
    service: Service = field(default_factory=Service)
    preference: Preference = field(default_factory=Preference)
    critic: Critic = field(default_factory=Critic)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    debug: Debug = field(default_factory=Debug)
    comm: Comm = field(default_factory=Comm)
    estimate: Estimate = field(default_factory=Estimate)

    # Keys of earlier versions: naming one stops the parse with its successor's name.
    renamed_keys: ClassVar[dict[str, str]] = {
        "comm.init_timeout_seconds": "comm.collective_timeout_seconds",
        "comm.rollout_timeout_seconds": "comm.silent_peer_timeout_seconds",
    }

    def validate(self) -> None:
        """The rules that span keys (``config/validation.py``); ``ConfigManager`` runs them after
        parsing. Those that need a part's facts (model, loss, task) run in
        ``recipes/config_checks.py``."""
        validate_job_config(self)
