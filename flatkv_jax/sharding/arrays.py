"""Cache arrays with a leading rank axis, created directly on their devices.

Every leaf of a sharded :class:`~flatkv_jax.coordinator.CacheState` or
:class:`~flatkv_jax.pools.Pools` has shape ``[n_ranks, *per_rank_shape]`` and sharding
``NamedSharding(mesh, P(RANK_AXIS))``: device ``r`` holds exactly rank ``r``'s block
``[1, *per_rank_shape]``. The arrays are produced on device by a jitted function with those
output shardings (each device computes its own block), so nothing of the stacked size is
ever built on the host or moved between devices.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from flatkv_jax.errors import fail, is_int
from flatkv_jax.plan import CachePlan, check_plan
from flatkv_jax.pools import Pools, pool_specs
from flatkv_jax.sharding.mesh import RANK_AXIS, mesh_ranks, rank_seeds


def rank_sharding(mesh: Mesh) -> NamedSharding:
    """``NamedSharding(mesh, P(RANK_AXIS))``: the leading axis split over the ranks."""
    return NamedSharding(mesh, P(RANK_AXIS))


def create_state_sharded(
    plan: CachePlan,
    mesh: Mesh,
    fifo_depth: int = 2,
    *,
    prefix: bool = True,
    seed=None,
):
    """One empty cache state per rank, stacked along a leading rank axis, sharded over ``mesh``.

    Rank ``r`` equals ``create_state(plan, fifo_depth, prefix=prefix,
    seed=rank_seeds(seed, n)[r])`` bit for bit (:func:`unstack_rank` shows it); its page ids
    are rank-local (every rank has the plan's whole page range).

    Args:
      plan: the per-rank cache plan (every rank holds ``plan.num_pages`` pages per group and
        ``plan.limits.max_requests`` request slots).
      mesh: from :func:`~flatkv_jax.sharding.rank_mesh`.
      fifo_depth, prefix: as ``create_state``.
      seed: see :func:`~flatkv_jax.sharding.rank_seeds` (``None``: a secret seed per rank).

    Returns:
      The stacked state; only the seeds (16 bytes per rank) travel from the host.

    Raises:
      TypeError/ValueError: a bad mesh, or any argument ``create_state`` rejects.
    """
    plan = check_plan(plan)
    n = mesh_ranks(mesh)
    words = np.stack(rank_seeds(seed, n))
    try:
        hash((fifo_depth, prefix))
    except TypeError:  # let create_state name the bad argument (abstractly: nothing built)
        _check_state_args(plan, fifo_depth, prefix)
    make = _state_maker(plan, mesh, fifo_depth, prefix)
    return make(jax.device_put(words, rank_sharding(mesh)))


def _check_state_args(plan, fifo_depth, prefix) -> None:
    from flatkv_jax.coordinator import create_state

    # create_state raises its own messages for bad arguments; an abstract evaluation builds
    # nothing on any device.
    jax.eval_shape(lambda: create_state(plan, fifo_depth, prefix=prefix, seed=0))


@functools.lru_cache(maxsize=64)
def _state_maker(plan, mesh, fifo_depth, prefix):
    from flatkv_jax.coordinator import create_state

    _check_state_args(plan, fifo_depth, prefix)

    def one_rank(words):  # words: uint32[1, SEED_WORDS], this rank's seed
        state = create_state(plan, fifo_depth, prefix=prefix, seed=0)
        state = dataclasses.replace(state, key_seed=words[0])
        return jax.tree.map(lambda x: x[None], state)

    spec = P(RANK_AXIS)
    # out_shardings: on a mesh of one, jit would otherwise report the outputs as P().
    return jax.jit(
        jax.shard_map(one_rank, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False),
        out_shardings=rank_sharding(mesh),
    )


def create_pools_sharded(plan: CachePlan, mesh: Mesh) -> Pools:
    """Every pool of ``plan`` once per rank, stacked along a leading rank axis, zeros.

    Leaf ``[g][f][l]`` has shape ``[n_ranks, num_pages, rows_per_page, *row_shape]``; device
    ``r`` holds rank ``r``'s pool, equal to ``create_pools(plan)``'s. Each array is its own
    buffer (the step donates them) and is made by a jitted ``jnp.zeros`` with
    ``out_shardings``: no host staging. Bytes per device: ``plan.total_pool_bytes``.

    Args:
      plan: the per-rank cache plan.
      mesh: from :func:`~flatkv_jax.sharding.rank_mesh`.

    Raises:
      TypeError: a bad plan or mesh.
    """
    plan = check_plan(plan)
    n = mesh_ranks(mesh)
    sharding = rank_sharding(mesh)
    return Pools(
        jax.tree.map(
            lambda s: _zeros_maker((n, *s.shape), jnp.dtype(s.dtype), sharding)(),
            pool_specs(plan),
        )
    )


@functools.lru_cache(maxsize=256)
def _zeros_maker(shape, dtype, sharding):
    # Cached: creating pools again (tests, wake) reuses the compiled zeros.
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def n_ranks_of(tree) -> int:
    """The leading (rank) dimension shared by every leaf of a stacked tree."""
    leaves = jax.tree.leaves(tree)
    dims = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
    if len(dims) != 1 or None in dims:
        fail(
            "tree",
            type(tree).__name__,
            f"every leaf of a stacked tree has the same leading rank axis (found {sorted(dims, key=str)})",
            "pass a tree made by create_state_sharded / create_pools_sharded or a per_rank step",
        )
    return dims.pop()


def unstack_rank(tree, r: int):
    """Rank ``r``'s slice of a stacked tree (leading axis removed), as a host-side view.

    Only rank ``r``'s device block is read (``addressable_shards``), so no gather of the
    other ranks happens. Meant for tests, reports and debugging, not for the step.

    Args:
      tree: a stacked pytree (state, pools, step results).
      r: the rank, ``0 <= r < n_ranks``.

    Returns:
      The same tree with every leaf a NumPy array of rank ``r``'s shape.

    Raises:
      TypeError/ValueError: ``r`` not an int in range.
    """
    n = n_ranks_of(tree)
    if not is_int(r):
        fail("r", r, "a rank is an int", "pass an int in [0, n_ranks)", exc=TypeError)
    if not 0 <= r < n:
        fail("r", r, f"the tree has {n} ranks, so r lies in [0, {n})", f"pass 0 <= r <= {n - 1}")

    def take(x):
        if isinstance(x, jax.Array):
            for shard in x.addressable_shards:
                idx = shard.index[0] if shard.index else slice(None)
                start = idx.start or 0
                stop = x.shape[0] if idx.stop is None else idx.stop
                if start <= r < stop:
                    return np.asarray(shard.data)[r - start]
            fail(
                "r",
                r,
                "this process holds no shard of that rank (multi-process mesh)",
                "read a rank this process owns",
            )
        return np.asarray(x)[r]

    return jax.tree.map(take, tree)
