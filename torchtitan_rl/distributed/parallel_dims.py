"""Parallel degrees, their validation, and the named device meshes (docs/design.md, 'Meshes')."""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# Order matters: the innermost (last) dims are the ones whose ranks are neighbours, so TP,
# which communicates most, gets adjacent ranks (same node); pipeline parallel, which sends only
# activations between neighbouring stages, is outermost (across nodes).
_MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

# Flattened meshes: name -> the world-mesh dims it spans. Only ``replica`` spans ``pp``: the
# stages of a pipeline hold the same samples and different layers, so every sum over samples or
# tokens (and over a layer's shards) stays within one stage.
_FLATTENED = {
    "batch": ("dp_replicate", "dp_shard"),
    "fsdp": ("dp_shard", "cp"),
    "loss": ("dp_replicate", "dp_shard", "cp"),
    # The ranks of one DP replica: they hold the same samples (RL rollouts are shared among them).
    "cp_tp": ("cp", "tp"),
    # Every rank holding the same samples: a replica's pipeline stages and CP / TP ranks (they
    # split the step's generation and exchange the rollouts).
    "replica": ("pp", "cp", "tp"),
    # The ranks of a replica, each with its own tokens: MoE experts are FSDP-sharded over them,
    # or split over their ``ep`` groups under expert parallel (see ``build_meshes``).
    "expert": ("dp_shard", "cp", "tp"),
    # Sums of per-token quantities whose tokens are spread over every rank of a stage (router counts).
    "world": ("dp_replicate", "dp_shard", "cp", "tp"),
}


@dataclass
class ParallelDims:
    """The training ranks' degrees. ``world_size`` counts the training ranks: the launch's first
    ``world_size`` ranks; the ``num_rollout_ranks`` after them only generate (GRPO). ``pp`` is
    the number of pipeline ranks (``distributed.pipeline``): each holds the same data as its
    peers and a slice of the layers."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    world_size: int
    num_rollout_ranks: int = 0
    ep: int = 1
    pp: int = 1
    _meshes: dict[str, DeviceMesh | None] = field(default_factory=dict, init=False, repr=False)
    _trainer_group: dist.ProcessGroup | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        self._validate()

    @classmethod
    def from_config(cls, parallelism, world_size: int) -> "ParallelDims":
        """The training ranks' degrees of the ``[parallelism]`` section in a launch of
        ``world_size`` ranks (less the rollout ranks)."""
        p = parallelism
        if p.rollout_ranks >= world_size:
            raise ValueError(
                f"parallelism.rollout_ranks={p.rollout_ranks} leaves no training rank in a launch of {world_size} rank(s)"
            )
        return cls(
            dp_replicate=p.data_parallel_replicate_degree,
            dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree,
            tp=p.tensor_parallel_degree,
            world_size=world_size - p.rollout_ranks,
            num_rollout_ranks=p.rollout_ranks,
            ep=p.expert_parallel_degree,
            pp=p.pipeline_parallel_degree,
        )

    def _validate(self):
        if self.pp < 1:
            raise ValueError(f"parallelism.pipeline_parallel_degree must be >= 1, got {self.pp}")
        if self.ep < 1:
            raise ValueError(f"parallelism.expert_parallel_degree must be >= 1, got {self.ep}")
        names = {
            "dp_replicate": "parallelism.data_parallel_replicate_degree",
            "dp_shard": "parallelism.data_parallel_shard_degree",
            "cp": "parallelism.context_parallel_degree",
            "tp": "parallelism.tensor_parallel_degree",
        }
        for dim in ("dp_replicate", "cp", "tp"):
            if getattr(self, dim) < 1:
                raise ValueError(f"{names[dim]} must be >= 1, got {getattr(self, dim)}")
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ValueError(f"{names['dp_shard']} must be -1 or >= 1, got {self.dp_shard}")
        others = self.pp * self.dp_replicate * self.cp * self.tp
        world = (
            f"the number of training ranks {self.world_size} (the world size less parallelism.rollout_ranks="
            f"{self.num_rollout_ranks})"
            if self.num_rollout_ranks
            else f"the world size {self.world_size}"
        )
        if self.dp_shard == -1:
            if self.world_size % others != 0:
                raise ValueError(
                    f"{world} is not divisible by {self._pp_term()}{names['dp_replicate']} "
                    f"({self.dp_replicate}) * {names['cp']} ({self.cp}) * {names['tp']} ({self.tp}) "
                    f"= {others}; cannot infer {names['dp_shard']} = -1"
                )
            self.dp_shard = self.world_size // others
        if others * self.dp_shard != self.world_size:
            raise ValueError(
                f"{self._pp_term()}{names['dp_replicate']} ({self.dp_replicate}) * {names['dp_shard']} "
                f"({self.dp_shard}) * {names['cp']} ({self.cp}) * {names['tp']} ({self.tp}) = {others * self.dp_shard} "
                f"does not equal {world}"
            )
        replica = self.dp_shard * self.cp * self.tp
        if replica % self.ep != 0:
            raise ValueError(
                f"parallelism.expert_parallel_degree ({self.ep}) must divide the ranks of a data-parallel replica, "
                f"{names['dp_shard']} ({self.dp_shard}) * {names['cp']} ({self.cp}) * {names['tp']} ({self.tp}) "
                f"= {replica}: expert parallel groups are carved out of them"
            )

    def _pp_term(self) -> str:
        return f"parallelism.pipeline_parallel_degree ({self.pp}) * " if self.pp > 1 else ""

    @property
    def stage_size(self) -> int:
        """The training ranks of one pipeline stage (all of them without pipeline parallel)."""
        return self.world_size // self.pp

    @property
    def batch_degree(self) -> int:
        """How many ranks load different samples (the DP degree)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_degree(self) -> int:
        return self.dp_shard * self.cp

    @property
    def expert_fsdp_degree(self) -> int:
        """How many ranks of a replica hold the same experts (and FSDP-shard them)."""
        return self.dp_shard * self.cp * self.tp // self.ep

    @property
    def is_trainer(self) -> bool:
        """Whether this process is a training rank (not a rollout rank)."""
        return not dist.is_initialized() or dist.get_rank() < self.world_size

    def trainer_group(self) -> dist.ProcessGroup | None:
        """The training ranks' group for collectives that are not on a mesh (checkpoints,
        evaluation sums); None when they are the whole launch (the default group)."""
        return self._trainer_group

    def build_meshes(self, device_type: str) -> None:
        """Create the training ranks' mesh and its named sub-meshes; dims of size 1 get no group.

        Exception: HSDP without sharding (dp_replicate > 1, dp_shard * cp == 1) keeps a
        size-1 ``dp_shard`` dim because FSDP2 expresses replication as a 2-D mesh.
        Every rank of the launch calls this, rollout ranks included: creating a group is
        collective over the launch.
        """
        if self.num_rollout_ranks:
            self._trainer_group = dist.new_group(list(range(self.world_size)))
        sizes = {
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp": self.cp,
            "tp": self.tp,
        }
        keep = [d for d in _MESH_DIMS if sizes[d] > 1]
        if self.dp_replicate > 1 and self.fsdp_degree == 1:
            keep.insert(keep.index("dp_replicate") + 1, "dp_shard")
        if not keep:
            self._meshes = {name: None for name in (*_MESH_DIMS, *_FLATTENED)}
            return
        shape = tuple(sizes[d] for d in keep)
        if self.num_rollout_ranks:
            # The training ranks are a prefix of the launch; rollout ranks hold no coordinate.
            world = DeviceMesh(device_type, torch.arange(self.world_size).view(shape), mesh_dim_names=tuple(keep))
        else:
            world = init_device_mesh(device_type, shape, mesh_dim_names=tuple(keep))
        meshes: dict[str, DeviceMesh | None] = {d: (world[d] if d in keep else None) for d in _MESH_DIMS}
        for name, dims in _FLATTENED.items():
            present = tuple(d for d in dims if d in keep and sizes[d] > 1)
            if not present:
                meshes[name] = None
            elif len(present) == 1:
                meshes[name] = world[present[0]]
            else:
                meshes[name] = world[present]._flatten(name)
        if self.dp_replicate > 1:
            # HSDP: replicate over dp_replicate, shard over the (possibly size-1) fsdp mesh.
            shard_dims = tuple(d for d in ("dp_shard", "cp") if d in keep)
            if len(shard_dims) == 2:
                meshes["hsdp"] = world["dp_replicate", "fsdp"]
            else:
                meshes["hsdp"] = world[("dp_replicate", shard_dims[0])]
            # The expert mesh's dim in the world mesh: flattened, a single dim, or the kept size-1 dp_shard.
            expert_dims = tuple(d for d in _FLATTENED["expert"] if sizes[d] > 1)
            expert_dim = "expert" if len(expert_dims) > 1 else (expert_dims or ("dp_shard",))[0]
            meshes["expert_hsdp"] = world[("dp_replicate", expert_dim)]
        if self.ep > 1:
            meshes.update(self._expert_parallel_meshes(device_type))
        self._meshes = meshes

    def _expert_parallel_meshes(self, device_type: str) -> dict[str, DeviceMesh]:
        """``ep``: groups of ``ep`` consecutive ranks of a replica (ranks ordered dp_shard, cp,
        tp as in the world mesh, so an ep group takes the tp ranks first, then cp, then
        dp_shard: the neighbours); ``expert_fsdp``: the mesh that shards each group's experts,
        its ranks those of the other groups of every replica holding the same experts (2-D with
        dp_replicate; kept even with one rank, so experts always have their own FSDP group).

        A mesh of its own, not a sub-mesh of the world mesh: the ep groups cut across the
        world's dims (ep 2 of tp 4), which its dims cannot express. FSDP2 builds the experts'
        2-D (FSDP, ep) layout from two sub-meshes of this one.
        """
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "efsdp": self.expert_fsdp_degree, "ep": self.ep}
        # The training ranks in the world mesh's order (they are a prefix of the launch); a
        # pipeline stage's ranks hold their own experts.
        ranks = torch.arange(self.world_size).reshape(tuple(sizes.values()))
        keep = [name for name, size in sizes.items() if size > 1 or name in ("efsdp", "ep")]
        ranks = ranks.reshape([sizes[name] for name in keep])
        mesh = DeviceMesh(device_type, ranks, mesh_dim_names=tuple(keep))
        # Sums over a stage's part of it (the experts' share of the gradient norm) then take
        # one collective instead of one per dim.
        mesh[tuple(name for name in keep if name != "pp")]._flatten("expert_all")
        if not self.is_trainer:
            return {}  # a rollout rank took part in creating the groups; it holds no coordinate
        shard_dims = ("dp_replicate", "efsdp") if self.dp_replicate > 1 else "efsdp"
        return {"ep": mesh["ep"], "expert_fsdp": mesh[shard_dims]}

    def mesh(self, name: str) -> DeviceMesh | None:
        """A named mesh, or ``None`` when that mesh has a single rank (nothing to communicate)."""
        assert self._meshes, "build_meshes() first"
        return self._meshes.get(name)

    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards over: 2-D (replicate, shard) for HSDP, else the ``fsdp`` mesh."""
        if self.dp_replicate > 1:
            return self.mesh("hsdp")
        return self.mesh("fsdp")

    def expert_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards MoE experts over: every rank of a replica (dp_shard x cp x tp),
        2-D with dp_replicate for HSDP; under expert parallel, the ranks holding the same
        experts (``expert_fsdp``, possibly of one rank)."""
        if self.ep > 1:
            return self.mesh("expert_fsdp")
        if self.dp_replicate > 1:
            return self.mesh("expert_hsdp")
        return self.mesh("expert")

    def batch_rank(self) -> int:
        """This rank's index among the ranks that load different samples."""
        batch = self.mesh("batch")
        return 0 if batch is None else batch.get_local_rank()

    def batch_rank_of(self, rank: int) -> int:
        """``batch_rank()`` of training rank ``rank``, known on every rank of the launch: the world
        mesh holds the training ranks in (pp, dp_replicate, dp_shard, cp, tp) order, so the CP x TP
        ranks of a batch rank are consecutive within a stage."""
        return rank % self.stage_size // (self.cp * self.tp)
