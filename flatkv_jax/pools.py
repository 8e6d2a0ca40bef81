"""Pools: the pre-sized device arrays of a plan, one per (group, field, layer).

The geometry stays in the static :class:`~flatkv_jax.plan.CachePlan`; :class:`Pools` holds
arrays only, so a jitted step can take it donated and return it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from flatkv_jax.errors import fail
from flatkv_jax.plan import CachePlan


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pools:
    """Every pool array of a plan.

    Attributes:
      arrays: per group (plan order), per field (group order), per layer (group order), one
        array of shape ``[num_pages, rows_per_page, *row_shape]`` and the field's dtype.
        ``arrays[g][f][l]``. Page 0 (null) is zero; the last page is scratch.
    """

    arrays: tuple[tuple[tuple[jax.Array, ...], ...], ...]

    def group(self, plan: CachePlan, name: str) -> tuple[tuple[jax.Array, ...], ...]:
        """The arrays of group ``name``: ``[field][layer]``."""
        return self.arrays[plan.group_index(name)]

    def get(self, plan: CachePlan, group: str, field: str, layer: int) -> jax.Array:
        """The array of one (group, field, layer); ``layer`` is the model layer index."""
        g = plan.group(group)
        if layer not in g.layers:
            fail(
                "layer",
                layer,
                f"group {group!r} is used by layers {g.layers}",
                "pass one of those layers",
            )
        fi = [f.name for f in g.fields].index(g.field(field).name)
        return self.arrays[plan.group_index(group)][fi][g.layers.index(layer)]

    def flat_group(self, gi: int) -> tuple[jax.Array, ...]:
        """All arrays of group index ``gi`` as one flat tuple (fields x layers), for zero_pages."""
        return tuple(a for per_field in self.arrays[gi] for a in per_field)

    def with_flat_group(self, gi: int, flat: tuple[jax.Array, ...]) -> Pools:
        """A copy with group ``gi``'s arrays replaced by ``flat`` (as from :meth:`flat_group`)."""
        it = iter(flat)
        new_g = tuple(tuple(next(it) for _ in per_field) for per_field in self.arrays[gi])
        return Pools((*self.arrays[:gi], new_g, *self.arrays[gi + 1 :]))

    def zero_group(self, gi: int, page_ids: jax.Array, *, impl=None) -> Pools:
        """Zeroes ``page_ids`` (int32[K], -1 padded) in every array of group ``gi`` in one
        :func:`kernels_pallas.zero_pages` call; donate the pools for an in-place update.

        Args:
          gi: group index (plan order).
          page_ids: the group's zero list.
          impl: ``kernels_pallas.Impl`` (the reference when ``None``).
        """
        from kernels_pallas import Impl, zero_pages  # kernels sit beside the core, not under it

        flat = zero_pages(
            self.flat_group(gi), page_ids, impl=Impl.REFERENCE if impl is None else impl
        )
        return self.with_flat_group(gi, flat)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in jax.tree_util.tree_leaves(self))


def pool_specs(plan: CachePlan) -> tuple[tuple[tuple[jax.ShapeDtypeStruct, ...], ...], ...]:
    """Shapes and dtypes of every pool array, nested like :attr:`Pools.arrays`."""
    return tuple(
        tuple(
            tuple(
                jax.ShapeDtypeStruct(plan.pool_shape(g, f.name), jnp.dtype(f.format.dtype))
                for _ in g.layers
            )
            for f in g.fields
        )
        for g in plan.groups
    )


def create_pools(
    plan: CachePlan,
    *,
    sharding: jax.sharding.Sharding | Mapping[str, jax.sharding.Sharding] | None = None,
) -> Pools:
    """Allocates every pool of ``plan`` as zeros, directly on device.

    The arrays are produced by a jitted ``jnp.zeros`` with ``out_shardings``, so nothing of the
    pool is staged on the host. The bytes allocated equal ``plan.total_pool_bytes``.

    Args:
      plan: the cache plan.
      sharding: optional sharding for every array, or per group name.

    Returns:
      The pools (all zero, so page 0 is the null page).
    """
    specs = pool_specs(plan)
    if isinstance(sharding, Mapping):
        unknown = sorted(set(sharding) - {g.name for g in plan.groups})
        if unknown:
            fail(
                "sharding",
                unknown,
                "keys must be group names of the plan",
                "use the recipe's group names",
            )
    arrays = []
    for g, g_specs in zip(plan.groups, specs, strict=True):
        s = sharding.get(g.name) if isinstance(sharding, Mapping) else sharding
        per_field = []
        for f_specs in g_specs:
            make = _zeros_maker(f_specs[0].shape, f_specs[0].dtype, s)
            per_field.append(tuple(make() for _ in f_specs))
        arrays.append(tuple(per_field))
    return Pools(tuple(arrays))


@functools.lru_cache(maxsize=256)
def _zeros_maker(shape: tuple[int, ...], dtype: jnp.dtype, sharding: jax.sharding.Sharding | None):
    # Cached so that creating pools again (tests, sleep/wake) reuses the compiled zeros.
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
