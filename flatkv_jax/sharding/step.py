"""``per_rank``: a single-rank function run on every rank of the mesh at once (``shard_map``)."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from flatkv_jax.errors import fail, is_int
from flatkv_jax.plan import CachePlan
from flatkv_jax.sharding.arrays import rank_sharding
from flatkv_jax.sharding.mesh import RANK_AXIS, mesh_ranks


def _indices(what: str, value) -> frozenset[int]:
    if is_int(value):
        value = (value,)
    if not isinstance(value, tuple | list | frozenset | set) or not all(is_int(i) for i in value):
        fail(
            what,
            value,
            "argument positions are a tuple of ints",
            f"pass e.g. {what}=(0, 1)",
            exc=TypeError,
        )
    if any(i < 0 for i in value):
        fail(
            what, value, "argument positions are non-negative", "count from the first argument (0)"
        )
    return frozenset(int(i) for i in value)


class RankStep:
    """A jitted ``shard_map`` of a single-rank function over the rank mesh (see :func:`per_rank`).

    Call it like the single-rank function, with stacked trees in place of per-rank ones.
    ``lower(*args)`` lowers it (for HLO / memory checks); ``jitted`` is the underlying
    ``jax.jit`` object.
    """

    def __init__(self, mesh, f, replicated, donate, static):
        self.mesh, self.f = mesh, f
        self.n_ranks = mesh_ranks(mesh)
        self.replicated, self.donate, self.static = replicated, donate, static
        self._sharding = rank_sharding(mesh)
        spec = P(RANK_AXIS)

        def run(*args):
            dyn = [i for i in range(len(args)) if i not in static]

            def body(*xs):
                full = list(args)
                for i, x in zip(dyn, xs, strict=True):
                    # Each device sees its [1, ...] block; the rank's function sees [...].
                    full[i] = x if i in replicated else jax.tree.map(lambda a: a[0], x)
                return jax.tree.map(lambda a: a[None], f(*full))

            in_specs = tuple(P() if i in replicated else spec for i in dyn)
            # check_vma=False: single-rank code (while loops whose carry starts from constants)
            # mixes rank-invariant and rank-varying values freely; the check only types
            # collectives, and the body has none.
            mapped = jax.shard_map(
                body, mesh=mesh, in_specs=in_specs, out_specs=spec, check_vma=False
            )
            return mapped(*(args[i] for i in dyn))

        self.jitted = jax.jit(
            run,
            static_argnums=tuple(sorted(static)),
            donate_argnums=tuple(sorted(donate)),
            out_shardings=self._sharding,  # every output leaf is stacked over the ranks
        )

    def check(self, *args) -> None:
        """The host checks every call makes (see :func:`per_rank`, "Raises")."""
        from flatkv_jax.coordinator.state import CacheState, state_layout
        from flatkv_jax.pools import Pools, pool_specs

        n = self.n_ranks
        plans = [a for i, a in enumerate(args) if i in self.static and isinstance(a, CachePlan)]
        for i, a in enumerate(args):
            if i in self.static or i in self.replicated:
                continue
            leaves = jax.tree.leaves(a)
            for x in leaves:
                lead = x.shape[0] if getattr(x, "ndim", 0) else None
                if lead != n:
                    fail(
                        f"args[{i}]",
                        f"{type(a).__name__} with a leaf of shape {getattr(x, 'shape', ())}",
                        f"a per_rank step over {n} ranks takes stacked trees whose every leaf "
                        f"has a leading rank axis of {n}",
                        f"create it for this mesh (create_state_sharded / create_pools_sharded "
                        f"with rank_mesh({n})), or list position {i} in replicated=",
                    )
            if leaves and isinstance(leaves[0], jax.Array) and leaves[0].is_fully_addressable:
                got = leaves[0].sharding
                if got != self._sharding and not got.is_equivalent_to(
                    self._sharding, leaves[0].ndim
                ):
                    fail(
                        f"args[{i}]",
                        f"{type(a).__name__} sharded as {got}",
                        f"the step's arrays are split over its mesh as {self._sharding}; "
                        "anything else would be moved between devices on every call",
                        "create the arrays with this mesh (create_state_sharded / "
                        "create_pools_sharded) or jax.device_put them once with "
                        "flatkv_jax.sharding.rank_sharding(mesh)",
                    )
            for plan in plans:
                if isinstance(a, CacheState) and a.layout.plan_key != state_layout(plan).plan_key:
                    fail(
                        f"args[{i}]",
                        f"a CacheState of plan key {a.layout.plan_key}",
                        "the state must belong to the step's plan (key "
                        f"{state_layout(plan).plan_key})",
                        "create it with create_state_sharded(plan, mesh) for this plan",
                    )
                if isinstance(a, Pools):
                    want = [((n, *x.shape), x.dtype) for x in jax.tree.leaves(pool_specs(plan))]
                    got = [(tuple(x.shape), x.dtype) for x in jax.tree.leaves(a)]
                    if want != got:
                        fail(
                            f"args[{i}]",
                            f"Pools of {len(got)} arrays, the first of shape "
                            f"{got[0][0] if got else None}",
                            f"the pools must have the shapes of the step's plan "
                            f"{plan.name or state_layout(plan).plan_key} over {n} ranks "
                            f"({len(want)} arrays, the first of shape {want[0][0]})",
                            "create them with create_pools_sharded(plan, mesh) for this plan",
                        )

    def __call__(self, *args):
        self.check(*args)
        return self.jitted(*args)

    def lower(self, *args):
        """``jax.jit(...).lower`` of the step (after the same host checks)."""
        self.check(*args)
        return self.jitted.lower(*args)

    def cache_size(self) -> int:
        """Compilations made so far (entries of the jit cache)."""
        return self.jitted._cache_size()


def per_rank(
    mesh: Mesh,
    f: Callable,
    *,
    replicated=(),
    donate=(),
    static=(),
) -> RankStep:
    """Runs ``f``, written for one rank, on every rank of ``mesh`` at once.

    ``f`` is a pure function of one rank's pytrees (today's single-device code: a coordinator
    op, a kernel, a model step). The result is ``jax.jit(jax.shard_map(...))`` over stacked
    trees: an argument at a position in ``replicated`` is passed whole to every rank
    (``P()``, e.g. model weights); ``static`` positions are hashable Python values (the plan);
    every other argument has a leading rank axis (``P(RANK_AXIS)``) that ``f`` does not see,
    and every output leaf gets it back. ``f`` runs on its rank's device only: nothing in the
    compiled step crosses devices (no collective is ever inserted).

    Args:
      mesh: from :func:`~flatkv_jax.sharding.rank_mesh`.
      f: the single-rank function.
      replicated: positions of arguments every rank receives whole.
      donate: positions of donated arguments (state, pools: updated in place per device).
      static: positions of static arguments.

    Returns:
      A :class:`RankStep`; it compiles once per argument shapes, like ``jax.jit``.

    Raises:
      TypeError/ValueError: here, bad positions or mesh; per call, a stacked argument whose
      leading axis is not the mesh's rank count, an array sharded another way, or a
      :class:`~flatkv_jax.coordinator.CacheState` / :class:`~flatkv_jax.pools.Pools` of
      another plan than a static ``CachePlan`` argument.
    """
    mesh_ranks(mesh)
    if not callable(f):
        fail("f", f, "per_rank wraps a function", "pass the single-rank function", exc=TypeError)
    replicated = _indices("replicated", replicated)
    donate = _indices("donate", donate)
    static = _indices("static", static)
    for name, a, b in (("static", static, replicated), ("static", static, donate)):
        if a & b:
            fail(
                name,
                sorted(a),
                "a static argument is neither replicated nor donated",
                "list each position once",
            )
    return RankStep(mesh, f, replicated, donate, static)


#: Every collective HLO op; ``all-reduce`` etc. also match their async ``-start``/``-done``
#: spellings. A per-rank step must contain none of them.
COLLECTIVE_OPS = (
    "all-reduce",
    "all-gather",
    "all-to-all",
    "collective-permute",
    "reduce-scatter",
    "collective-broadcast",
    "ragged-all-to-all",
)


def collectives_in(hlo_text: str) -> list[str]:
    """The collective ops named in a compiled step's HLO text (``compiled.as_text()``).

    Use it to check that a sharded step stays rank-local: ``collectives_in(text) == []``.
    """
    return [op for op in COLLECTIVE_OPS if op in hlo_text]
