"""The device coordinator (:mod:`flatkv_jax.coordinator`) behind the harness's Backend protocol.

Every operation is one call of the coordinator's jitted op (the plan static, the state
donated), so a differential run compiles each op once per plan and batch size and then
reuses it across every trace. Pages an op hands out are zeroed in every pool array of their
group with ``kernels_pallas.zero_pages`` (the step's zero list), and the harness's rows are
written with ``kernels_pallas.write_rows`` at ``slot = page * rows_per_page + row`` computed
from the device tables, so the logical view read back by :meth:`DeviceBackend.view` is what
a model step would see.

Prefix reuse: with ``prefix_reuse`` (the default once the coordinator's ``AdmitBatch`` has a
``tokens`` field) admit passes the prompts and namespaces and extend the step's tokens, so the
coordinator matches and publishes; without, it passes none (the coordinator then never hits):
compare it with ``RadixOracle(plan, prefix_reuse=False)``. Many traces at once:
:mod:`flatkv_jax.oracle.lockstep`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from flatkv_jax import coordinator as coord
from flatkv_jax.errors import fail
from flatkv_jax.oracle.batches import (
    Counts,
    LogicalView,
    OpResult,
    OracleAdmitBatch,
    OracleExtendBatch,
    OracleHandleBatch,
    empty_result,
)
from flatkv_jax.plan import CachePlan, check_plan
from flatkv_jax.pools import Pools, create_pools
from kernels_pallas import write_rows

_I32 = jnp.int32


@functools.partial(jax.jit, donate_argnums=(0,))
def _zero(arrays, zero_lists):
    """Zeroes each group's zero list in every array of that group (mutate first)."""
    pools = Pools(arrays)
    for gi, ids in enumerate(zero_lists):
        pools = pools.zero_group(gi, ids)
    return pools.arrays


@functools.partial(jax.jit, donate_argnums=(0,))
def _write(group_arrays, slots, values):
    """Writes ``values[f][l]`` at ``slots`` (-1 skips) in every array of one group."""
    return tuple(
        tuple(write_rows(a, v, slots) for a, v in zip(per_field, vals, strict=True))
        for per_field, vals in zip(group_arrays, values, strict=True)
    )


@jax.jit
def _gather(arrays, tables):
    """Rows every (slot, absolute row) maps to: ``[R, width * rpp, *row]`` per array."""
    out = []
    for per_group, t in zip(arrays, tables, strict=True):
        pages = jnp.maximum(t, 0)
        out.append(
            tuple(
                tuple(a[pages].reshape(t.shape[0], -1, *a.shape[2:]) for a in per_field)
                for per_field in per_group
            )
        )
    return tuple(out)


class DeviceBackend:
    """The jitted coordinator plus pools, driven from the host through NumPy batches.

    Args:
      plan: the cache plan.
      fifo_depth: in-flight steps per request (as ``create_state``).
      max_count: the ops' static per-row token bound (default as the coordinator's).
      prefix_reuse: pass tokens (default: whether the coordinator's batches have them).
    """

    def __init__(
        self,
        plan: CachePlan,
        *,
        fifo_depth: int = 2,
        max_count: int | None = None,
        prefix_reuse: bool | None = None,
    ):
        check_plan(plan)
        self.plan = plan
        self.fifo_depth = fifo_depth
        self.max_count = max_count
        has = "tokens" in {f.name for f in dataclasses.fields(coord.AdmitBatch)}
        if prefix_reuse and not has:
            fail(
                "prefix_reuse",
                prefix_reuse,
                "the coordinator's AdmitBatch has no tokens field (no prefix index)",
                "pass prefix_reuse=False",
            )
        self.prefix_reuse = has if prefix_reuse is None else bool(prefix_reuse)
        lim = plan.limits
        # Rows one op can write per group: every valid row, every token it schedules.
        self._write_rows = lim.max_requests * lim.max_count
        self.reset()

    def reset(self) -> None:
        self.state = coord.create_state(self.plan, self.fifo_depth, prefix=self.prefix_reuse)
        if not hasattr(self, "arrays"):
            self.arrays = create_pools(self.plan).arrays
        else:  # fresh zeros of the same shapes (create_pools would compile anew each time)
            self.arrays = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), self.arrays)

    # --- operations -------------------------------------------------------------------------
    def _step(self, op, batch, extra: dict) -> OpResult:
        kw = {} if self.max_count is None else {"max_count": self.max_count}
        self.state, r = op(self.plan, self.state, batch, **kw)
        self.arrays = _zero(self.arrays, r.zero)
        out = empty_result(batch.valid.shape[0])
        for f in ("status", "slot", "generation", "hit", "count", "short_group", "short_pages"):
            getattr(out, f)[:] = np.asarray(getattr(r, f))
        return out

    def admit(self, batch: OracleAdmitBatch) -> OpResult:
        kw = dict(
            valid=jnp.asarray(batch.valid),
            prompt_len=jnp.asarray(batch.prompt_len, _I32),
            first_chunk=jnp.asarray(batch.first_chunk, _I32),
        )
        if self.prefix_reuse:
            kw.update(
                tokens=jnp.asarray(batch.tokens, _I32), namespace=jnp.asarray(batch.namespace, _I32)
            )
        return self._step(coord.admit, coord.AdmitBatch(**kw), {})

    def extend(self, batch: OracleExtendBatch) -> OpResult:
        kw = dict(
            valid=jnp.asarray(batch.valid),
            slot=jnp.asarray(batch.slot, _I32),
            generation=jnp.asarray(batch.generation, _I32),
            count=jnp.asarray(batch.count, _I32),
        )
        if self.prefix_reuse:
            kw.update(tokens=jnp.asarray(batch.tokens, _I32))
        return self._step(coord.extend, coord.ExtendBatch(**kw), {})

    def _status_only(self, op, batch) -> OpResult:
        self.state, r = op(self.plan, self.state, batch)
        return self._statuses(r)

    @staticmethod
    def _statuses(r) -> OpResult:
        """An :class:`OpResult` holding only the statuses of a coordinator result."""
        out = empty_result(np.shape(r.status)[0])
        out.status[:] = np.asarray(r.status)
        return out

    def _handles(self, batch: OracleHandleBatch) -> dict:
        return dict(
            valid=jnp.asarray(batch.valid),
            slot=jnp.asarray(batch.slot, _I32),
            generation=jnp.asarray(batch.generation, _I32),
        )

    def _retire_batch(self, batch: OracleHandleBatch) -> coord.RetireBatch:
        return coord.RetireBatch(**self._handles(batch), accepted=jnp.asarray(batch.arg, _I32))

    def retire(self, batch: OracleHandleBatch) -> OpResult:
        return self._status_only(coord.retire, self._retire_batch(batch))

    def retire_reclaim(self, batch: OracleHandleBatch) -> OpResult:
        """``coord.retire_reclaim``: retire, then reclaim of the rows it committed, in one
        sweep (the host's is ``RadixOracle.retire_reclaim``)."""
        return self._status_only(coord.retire_reclaim, self._retire_batch(batch))

    def rewind(self, batch: OracleHandleBatch) -> OpResult:
        return self._status_only(
            coord.rewind,
            coord.RewindBatch(**self._handles(batch), extent=jnp.asarray(batch.arg, _I32)),
        )

    def reclaim(self, batch: OracleHandleBatch) -> OpResult:
        return self._status_only(coord.reclaim, coord.HandleBatch(**self._handles(batch)))

    def release(self, batch: OracleHandleBatch) -> OpResult:
        return self._status_only(
            coord.release,
            coord.ReleaseBatch(**self._handles(batch), mode=jnp.asarray(batch.arg, _I32)),
        )

    # --- observation ------------------------------------------------------------------------
    def counts(self) -> Counts:
        st = jax.device_get(self.state)
        free, in_use, cached = [], [], []
        for g, pool, t in zip(self.plan.groups, st.pools, st.tables, strict=True):
            t = np.asarray(t)
            refs = np.bincount(t[t > 0].ravel(), minlength=self.plan.pages(g))
            rc = np.asarray(pool.refcount)
            free.append(int(pool.top))
            in_use.append(int(np.count_nonzero(refs)))
            cached.append(int(np.count_nonzero((rc > 0) & (refs == 0))))
        live = np.asarray(st.live)
        return Counts(
            free=np.array(free, np.int64),
            in_use=np.array(in_use, np.int64),
            cached_only=np.array(cached, np.int64),
            live=live,
            generation=np.asarray(st.generation, np.int64),
            extent=np.where(live, np.asarray(st.extent), 0).astype(np.int64),
            committed=np.where(live, np.asarray(st.committed), 0).astype(np.int64),
            in_flight=np.where(live, np.asarray(st.fifo_len), 0).astype(np.int64),
            pending=np.where(live, np.asarray(st.pending), 0).astype(np.int64),
        )

    def view(self) -> LogicalView:
        tables = tuple(self.state.tables)
        rows = jax.device_get(_gather(self.arrays, tables))
        return LogicalView(tuple(np.asarray(t) for t in jax.device_get(tables)), rows)

    def write(self, group: int, slots: np.ndarray, rows: np.ndarray, values) -> None:
        g = self.plan.groups[group]
        rpp = g.rows_per_page
        table = np.asarray(self.state.tables[group])
        pages = table[np.asarray(slots), np.asarray(rows) // rpp]
        flat = np.where(pages >= 1, pages * rpp + np.asarray(rows) % rpp, -1).astype(np.int32)
        k = self._write_rows
        if flat.size > k:
            fail(
                "rows",
                flat.size,
                f"one op writes at most {k} rows per group",
                "write fewer rows per call",
            )
        pad = k - flat.size
        slot_arr = jnp.asarray(np.concatenate([flat, np.full(pad, -1, np.int32)]))
        vals = tuple(
            tuple(
                jnp.asarray(np.concatenate([v, np.zeros((pad, *v.shape[1:]), v.dtype)]))
                for v in per_layer
            )
            for per_layer in values
        )
        arrays = list(self.arrays)
        arrays[group] = _write(arrays[group], slot_arr, vals)
        self.arrays = tuple(arrays)
