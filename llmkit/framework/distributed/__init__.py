"""Auto-parallel: ``import llmkit.framework.distributed as dist``.

A program is written for one device; a few tensors are placed on a :class:`ProcessMesh` with
placements (``Replicate()``, ``Shard(dim)``, ``Partial(op)``, one per mesh dim), and the framework
moves values between layouts. The backend (``init``) is ``sim`` (every rank in this process),
``mpi`` (one process per rank under ``mpiexec``) or ``nccl`` (GPUs). See docs/parallel.md.
"""

from ..placement import Partial, Placement, ProcessMesh, Replicate, Shard
from .api import from_local, local_shards, reshard, shard_tensor, unshard
from .comm import CollectiveError, get_backend, get_rank, get_world_size, init, run_ranks, timeout
from .dist_array import DistArray
from .static import PartitionError, partition
from .world import DIST  # noqa: F401  (registers the distributed world with dispatch)

__all__ = [
    "CollectiveError",
    "DistArray",
    "Partial",
    "PartitionError",
    "Placement",
    "ProcessMesh",
    "Replicate",
    "Shard",
    "from_local",
    "get_backend",
    "get_rank",
    "get_world_size",
    "init",
    "local_shards",
    "partition",
    "reshard",
    "run_ranks",
    "shard_tensor",
    "timeout",
    "unshard",
]
