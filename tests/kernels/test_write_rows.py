"""Parity of write_rows: reference and Pallas (interpret=True) against a NumPy oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import (
    GEOMETRIES,
    assert_bits_equal,
    oracle_write,
    poisoned_pool,
    random_rows,
    real_slots,
)

from kernels_pallas import Impl, write_rows
from kernels_pallas.write_rows import pallas_tpu, reference

IMPLS = [
    pytest.param(dict(impl=Impl.REFERENCE), id="reference"),
    pytest.param(dict(impl=Impl.PALLAS_TPU, interpret=True), id="pallas_tpu-interpret"),
]


def _slots_for(case: str, geo, rng: np.random.Generator) -> np.ndarray:
    real = real_slots(geo)
    if case == "empty":
        return np.zeros((0,), np.int32)
    if case == "full":
        return rng.permutation(real).astype(np.int32)
    if case == "all_skip":
        return np.full((5,), -1, np.int32)
    if case == "random":
        n = max(1, real.size // 3)
        chosen = rng.choice(real, size=n, replace=False).astype(np.int32)
        # Interleave padding, as a serving step does for idle request slots.
        chosen[rng.random(n) < 0.25] = -1
        return chosen
    raise AssertionError(case)


@pytest.mark.parametrize("impl_kw", IMPLS)
@pytest.mark.parametrize("case", ["empty", "full", "all_skip", "random"])
@pytest.mark.parametrize("geo", GEOMETRIES, ids=str)
def test_write_rows_matches_oracle(geo, case, impl_kw, rng):
    pool = poisoned_pool(geo)
    slots = _slots_for(case, geo, rng)
    rows = random_rows(geo, slots.size, rng)
    expected = oracle_write(pool, rows, slots)

    fn = jax.jit(lambda p, r, s: write_rows(p, r, s, **impl_kw), donate_argnums=0)
    out = fn(jnp.asarray(pool), jnp.asarray(rows), jnp.asarray(slots))

    # Bit-exact: written rows equal, every untouched byte still the 0xAB / NaN poison.
    assert_bits_equal(out, expected)


@pytest.mark.parametrize("impl_kw", IMPLS)
def test_out_of_range_slots_are_dropped_never_wrapped_or_clamped(impl_kw, rng):
    geo = GEOMETRIES[2]  # 9 pages x 4 rows of 68 bytes
    pool = poisoned_pool(geo)
    total = geo.num_pages * geo.rows_per_page
    # -2 would wrap to the scratch page under NumPy rules; total / total+7 would clamp onto
    # the last page under dynamic_update_slice. All must be dropped.
    slots = np.array([-2, 5, total, -total, total + 7, 9, -1], np.int32)
    rows = random_rows(geo, slots.size, rng)
    out = write_rows(jnp.asarray(pool), jnp.asarray(rows), jnp.asarray(slots), **impl_kw)
    expected = poisoned_pool(geo)
    expected[1, 1] = rows[1]
    expected[2, 1] = rows[5]
    assert_bits_equal(out, expected)


def test_reference_and_kernel_are_the_same_function(rng):
    """The exported reference has the kernel's signature and agrees with it directly."""
    geo = GEOMETRIES[1]
    pool = jnp.asarray(poisoned_pool(geo))
    slots = jnp.asarray(_slots_for("random", geo, rng))
    rows = jnp.asarray(random_rows(geo, slots.shape[0], rng))
    a = reference.write_rows(pool, rows, slots)
    b = pallas_tpu.write_rows(pool, rows, slots, interpret=True)
    assert_bits_equal(a, b)


@pytest.mark.parametrize("block_rows", [1, 3, 128])
def test_kernel_block_sizes_cover_tail_blocks(block_rows, rng):
    geo = GEOMETRIES[2]
    pool = poisoned_pool(geo)
    slots = rng.permutation(real_slots(geo))[:13].astype(np.int32)  # 13: a ragged tail block
    rows = random_rows(geo, slots.size, rng)
    out = pallas_tpu.write_rows(
        jnp.asarray(pool),
        jnp.asarray(rows),
        jnp.asarray(slots),
        interpret=True,
        block_rows=block_rows,
    )
    assert_bits_equal(out, oracle_write(pool, rows, slots))


def test_impl_accepts_string_value(rng):
    geo = GEOMETRIES[2]
    pool = jnp.asarray(poisoned_pool(geo))
    slots = jnp.asarray([4, -1], jnp.int32)
    rows = jnp.asarray(random_rows(geo, 2, rng))
    out = write_rows(pool, rows, slots, impl="pallas_tpu", interpret=True)
    assert_bits_equal(out, write_rows(pool, rows, slots))
