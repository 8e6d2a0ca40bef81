"""Per-group division and modulo by static spans (shifts and masks for powers of two)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from flatkv_jax.coordinator.layout import ceil_div_groups, div_groups, mod_groups


@pytest.mark.parametrize(
    "values",
    [(64, 128, 4, 4, 128, 8), (1, 2, 1 << 20), (3, 64, 5), (7,), (1, 1)],
    ids=["v4-spans", "powers-of-two", "mixed", "odd", "ones"],
)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_group_division_matches_numpy_floor_semantics(values, axis):
    g = len(values)
    rng = np.random.default_rng(g + axis)
    shape = (g, 37) if axis == 0 else (37, g)
    # Negative operands too (a window's first read before position 0): floor, not truncate.
    x = rng.integers(-5000, 5000, size=shape, dtype=np.int32)
    x.flat[:4] = [0, -1, np.iinfo(np.int32).max - (1 << 20), np.iinfo(np.int32).min + 1]
    v = np.asarray(values, np.int64).reshape((g, 1) if axis == 0 else (1, g))
    got_div = np.asarray(jax.jit(lambda a: div_groups(a, values, axis))(x))
    got_mod = np.asarray(jax.jit(lambda a: mod_groups(a, values, axis))(x))
    np.testing.assert_array_equal(got_div, x // v)
    np.testing.assert_array_equal(got_mod, x % v)
    small = np.clip(x, -(1 << 24), 1 << 24)
    got_ceil = np.asarray(jax.jit(lambda a: ceil_div_groups(a, values, axis))(small))
    np.testing.assert_array_equal(got_ceil, -(-small // v))


def test_group_division_broadcasts_a_singleton_operand():
    # reclaim divides one committed row [1, B] by each group's period: [G, B] out.
    c = np.arange(-3, 300, 7, dtype=np.int32)[None, :]
    values = (1, 4, 128)
    got = np.asarray(div_groups(c, values, 0))
    np.testing.assert_array_equal(got, c // np.asarray(values)[:, None])
