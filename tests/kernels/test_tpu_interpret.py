"""TPU interpret mode (``pltpu.InterpretParams()``): simulates TPU memory rules (no direct
access to pl.ANY refs, out-of-bounds DMAs raise). Cost grows with the pool size, so the pools
here are tiny."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import (
    Geometry,
    assert_bits_equal,
    oracle_write,
    oracle_zero,
    poisoned_pool,
    random_rows,
    real_slots,
)

from kernels_pallas import Impl, write_rows, zero_pages
from kernels_pallas._compat import TPUInterpretParams

TINY = [
    Geometry("u8x68_r4", 5, 4, (68,), "uint8"),
    Geometry("u8x584_r2", 4, 2, (584,), "uint8"),
    Geometry("f32x2x2x16_r2", 4, 2, (2, 2, 16), "float32"),
]


@pytest.mark.parametrize("geo", TINY, ids=str)
def test_write_rows_tpu_interpret(geo, rng):
    pool = poisoned_pool(geo)
    slots = rng.permutation(real_slots(geo)).astype(np.int32)
    slots[0] = -1
    slots = np.concatenate([slots, [geo.num_pages * geo.rows_per_page + 3, -7]]).astype(np.int32)
    rows = random_rows(geo, slots.size, rng)
    out = write_rows(
        jnp.asarray(pool),
        jnp.asarray(rows),
        jnp.asarray(slots),
        impl=Impl.PALLAS_TPU,
        interpret=TPUInterpretParams(),
    )
    assert_bits_equal(out, oracle_write(pool, rows, slots))


def test_zero_pages_tpu_interpret():
    pools = (
        poisoned_pool(TINY[0]),
        poisoned_pool(Geometry("f32", TINY[0].num_pages, 4, (2, 2, 16), "float32")),
    )
    ids = np.array([2, -1, 0, 99, 3], np.int32)
    out = zero_pages(
        tuple(jnp.asarray(p) for p in pools),
        jnp.asarray(ids),
        impl=Impl.PALLAS_TPU,
        interpret=TPUInterpretParams(),
    )
    for got, pool in zip(out, pools, strict=True):
        assert_bits_equal(got, oracle_zero(pool, ids))
