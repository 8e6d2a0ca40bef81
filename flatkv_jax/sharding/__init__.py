"""Data-parallel ranks on a device mesh: sharded pools and cache state, per-rank steps.

Each data-parallel (attention) rank holds its own requests and its own slice of every pool;
rank ``r`` lives on device ``r`` of a one-axis mesh (:data:`RANK_AXIS`). Every cache array
has a leading ``[n_ranks]`` axis sharded over that axis; a single-rank function runs on all
ranks at once through :func:`per_rank` (``jax.jit`` of ``jax.shard_map``), with no traffic
between devices. Page ids are rank-local. See docs/scaling.md.

- :func:`rank_mesh`, :data:`RANK_AXIS`, :func:`rank_seeds` (:mod:`.mesh`)
- :func:`create_state_sharded`, :func:`create_pools_sharded`, :func:`unstack_rank`,
  :func:`rank_sharding` (:mod:`.arrays`)
- :func:`per_rank`, :class:`RankStep`, :func:`collectives_in` (:mod:`.step`)
- :func:`rank_report`, :class:`RankReport` (:mod:`.report`)
"""

from flatkv_jax.sharding.arrays import (
    create_pools_sharded,
    create_state_sharded,
    rank_sharding,
    unstack_rank,
)
from flatkv_jax.sharding.mesh import RANK_AXIS, rank_mesh, rank_seeds
from flatkv_jax.sharding.report import RankReport, rank_capacity, rank_report
from flatkv_jax.sharding.step import COLLECTIVE_OPS, RankStep, collectives_in, per_rank

__all__ = [
    "COLLECTIVE_OPS",
    "RANK_AXIS",
    "RankReport",
    "RankStep",
    "collectives_in",
    "create_pools_sharded",
    "create_state_sharded",
    "per_rank",
    "rank_capacity",
    "rank_mesh",
    "rank_report",
    "rank_seeds",
    "rank_sharding",
    "unstack_rank",
]
