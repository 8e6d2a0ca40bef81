"""No hidden pool copies: donated pools are aliased and temp memory stays small.

Uses ``jit(f, donate_argnums=0).lower(...).compile().memory_analysis()`` on CPU (jax 0.10.2
returns a CompiledMemoryStats with alias_size_in_bytes / temp_size_in_bytes). Pools are a few
MB so "temp is a small fraction of the pool" actually means something.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import Impl, write_rows, zero_pages

NUM_PAGES, ROWS, ROW_BYTES = 112, 64, 584  # 4.19 MB per pool
POOL = jax.ShapeDtypeStruct((NUM_PAGES, ROWS, ROW_BYTES), jnp.uint8)
STATE = jax.ShapeDtypeStruct((NUM_PAGES, ROWS, 2, 2, 16), jnp.float32)  # 1.8 MB
POOL_BYTES = NUM_PAGES * ROWS * ROW_BYTES
N_ROWS, N_PAGES = 256, 16
# Temp memory may hold the data the op writes (XLA:CPU materializes the broadcast zeros of a
# zero_pages scatter: K pages of each distinct page shape) plus a little slack — but never
# anything that grows with the pool. Any hidden copy of a pool costs >= 1.8 MB here.
SLACK_BYTES = 64 * 1024

IMPLS = [
    pytest.param(dict(impl=Impl.REFERENCE), id="reference"),
    pytest.param(dict(impl=Impl.PALLAS_TPU, interpret=True), id="pallas_tpu-interpret"),
]


def _nbytes(*avals) -> int:
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in avals)


def _stats(fn, *args, donate=True):
    jitted = jax.jit(fn, donate_argnums=0) if donate else jax.jit(fn)
    stats = jitted.lower(*args).compile().memory_analysis()
    assert stats is not None, "memory_analysis() unavailable on this backend"
    return stats


def _rows():
    return jax.ShapeDtypeStruct((N_ROWS, ROW_BYTES), jnp.uint8)


def _slots():
    return jax.ShapeDtypeStruct((N_ROWS,), jnp.int32)


def _pages():
    return jax.ShapeDtypeStruct((N_PAGES,), jnp.int32)


def _assert_in_place(stats, pool_bytes: int, written_bytes: int) -> None:
    assert stats.alias_size_in_bytes == pool_bytes, (
        f"donated pool not aliased: alias={stats.alias_size_in_bytes}, pool={pool_bytes}"
    )
    limit = written_bytes + SLACK_BYTES
    assert limit < 0.2 * pool_bytes  # keeps the bound meaningful
    assert stats.temp_size_in_bytes <= limit, (
        f"temp={stats.temp_size_in_bytes} bytes > written bytes + slack ({limit}); pool is "
        f"{pool_bytes} bytes — a hidden copy of (part of) the pool"
    )


ROWS_BYTES = N_ROWS * ROW_BYTES
# Zero pages of the distinct page shapes of the group (u8x584 twice, f32 state once).
ZERO_BYTES = N_PAGES * ROWS * (ROW_BYTES + 2 * 2 * 16 * 4)


@pytest.mark.parametrize("impl_kw", IMPLS)
def test_write_rows_is_in_place(impl_kw):
    stats = _stats(lambda p, r, s: write_rows(p, r, s, **impl_kw), POOL, _rows(), _slots())
    _assert_in_place(stats, POOL_BYTES, ROWS_BYTES)


@pytest.mark.parametrize("impl_kw", IMPLS)
def test_zero_pages_group_is_in_place(impl_kw):
    stats = _stats(lambda p, i: zero_pages(p, i, **impl_kw), (POOL, POOL, STATE), _pages())
    _assert_in_place(stats, _nbytes(POOL, POOL, STATE), ZERO_BYTES)


@pytest.mark.parametrize("impl_kw", IMPLS)
def test_zero_then_write_then_read_is_in_place(impl_kw):
    """The step ordering the library prescribes: mutate first (zero, write), read last."""

    def step(pool, rows, slots, pages, read_slots):
        (pool,) = zero_pages((pool,), pages, **impl_kw)
        pool = write_rows(pool, rows, slots, **impl_kw)
        read = pool[read_slots // ROWS, read_slots % ROWS]  # gather a few rows
        return pool, read

    read_slots = jax.ShapeDtypeStruct((8,), jnp.int32)
    stats = _stats(step, POOL, _rows(), _slots(), _pages(), read_slots)
    _assert_in_place(stats, POOL_BYTES, ROWS_BYTES + N_PAGES * ROWS * ROW_BYTES)


def test_without_donation_the_pool_is_copied():
    """Sanity check of the guard itself: no donation -> no alias (the output is a new pool)."""
    stats = _stats(lambda p, r, s: write_rows(p, r, s), POOL, _rows(), _slots(), donate=False)
    assert stats.alias_size_in_bytes == 0
    assert stats.output_size_in_bytes >= POOL_BYTES


def test_guard_detects_read_before_write_copy():
    """Canary: reading a pool before mutating it in one jit copies the whole pool (a known XLA
    behaviour, DESIGN.md section 9). If this stops failing the guard, the rule can be relaxed;
    if the guard stopped seeing it, the assertions above would be meaningless."""

    def read_then_write(pool, rows, slots, read_slots):
        read = pool[read_slots // ROWS, read_slots % ROWS]
        return write_rows(pool, rows, slots), read

    read_slots = jax.ShapeDtypeStruct((8,), jnp.int32)
    stats = _stats(read_then_write, POOL, _rows(), _slots(), read_slots)
    assert stats.temp_size_in_bytes >= POOL_BYTES
