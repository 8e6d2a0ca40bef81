"""Every validation message: static (trace-time) checks and the opt-in dynamic checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import Impl, check_page_ids, check_write_slots, write_rows, zero_pages

POOL = jnp.zeros((6, 4, 68), jnp.uint8)  # pages 1..4 real, 5 scratch; 24 slots
ROWS = jnp.zeros((3, 68), jnp.uint8)
SLOTS = jnp.asarray([4, -1, 9], jnp.int32)


# ---- write_rows, static ----


@pytest.mark.parametrize(
    ("pool", "rows", "slots", "exc", "match"),
    [
        (np.zeros((6,), np.uint8), ROWS, SLOTS, ValueError, r"pool must have rank >= 2"),
        ([1, 2], ROWS, SLOTS, TypeError, r"pool must be an array"),
        (jnp.zeros((2, 4, 68), jnp.uint8), ROWS, SLOTS, ValueError, r"has 2 pages but needs >= 3"),
        (POOL, "rows", SLOTS, TypeError, r"rows must be an array"),
        (POOL, jnp.zeros((3, 64), jnp.uint8), SLOTS, ValueError, r"stores rows of shape \(68,\)"),
        (
            POOL,
            jnp.zeros((3, 1, 68), jnp.uint8),
            SLOTS,
            ValueError,
            r"rows must be \[N, \*\(68,\)\]",
        ),
        (POOL, ROWS.astype(jnp.int8), SLOTS, TypeError, r"rows dtype int8 != pool dtype uint8"),
        (POOL, ROWS, [4, -1, 9], TypeError, r"slots must be a jax/numpy array of int32"),
        (POOL, ROWS, SLOTS.reshape(3, 1), ValueError, r"slots must have rank 1"),
        (POOL, ROWS, SLOTS.astype(jnp.uint32), TypeError, r"slots must have dtype int32.*astype"),
        (POOL, ROWS, SLOTS[:2], ValueError, r"slots has 2 entries but rows has 3"),
    ],
)
def test_write_rows_static_errors(pool, rows, slots, exc, match):
    with pytest.raises(exc, match=match):
        write_rows(pool, rows, slots)


def test_write_rows_static_errors_fire_at_trace_time():
    f = jax.jit(lambda p, r, s: write_rows(p, r, s))
    with pytest.raises(TypeError, match="rows dtype float32 != pool dtype uint8"):
        f.lower(POOL, ROWS.astype(jnp.float32), SLOTS)


def test_pool_too_large_for_int32_slots():
    huge = jax.ShapeDtypeStruct((2**20, 2**11, 1), jnp.uint8)
    with pytest.raises(ValueError, match="too many for int32 slot ids"):
        jax.eval_shape(
            write_rows,
            huge,
            jax.ShapeDtypeStruct((1, 1), jnp.uint8),
            jax.ShapeDtypeStruct((1,), jnp.int32),
        )


@pytest.mark.parametrize("bad", ["pallas", 3, None])
def test_unknown_impl(bad):
    with pytest.raises(
        ValueError,
        match=r"impl=.* is invalid: .* runs a known implementation.*Fix: .*Impl.REFERENCE",
    ):
        write_rows(POOL, ROWS, SLOTS, impl=bad)
    with pytest.raises(ValueError, match=r"runs a known implementation"):
        zero_pages((POOL,), SLOTS, impl=bad)


def test_interpret_without_pallas_impl():
    with pytest.raises(
        ValueError, match=r"interpret=True is invalid: .*interpret only applies to Pallas impls"
    ):
        write_rows(POOL, ROWS, SLOTS, impl=Impl.REFERENCE, interpret=True)
    with pytest.raises(
        ValueError, match=r"interpret=True is invalid: .*interpret only applies to Pallas impls"
    ):
        zero_pages((POOL,), SLOTS, interpret=True)


# ---- zero_pages, static ----


@pytest.mark.parametrize(
    ("pools", "ids", "exc", "match"),
    [
        ((), SLOTS, ValueError, r"pools is empty"),
        ((POOL, jnp.zeros((7, 4, 68), jnp.uint8)), SLOTS, ValueError, r"pools\[1\] has 7 pages"),
        ({"k": jnp.zeros((6,), jnp.uint8)}, SLOTS, ValueError, r"pools\['k'\] must have rank"),
        ((POOL,), SLOTS.astype(jnp.int16), TypeError, r"page_ids must have dtype int32"),
        ((POOL,), SLOTS[None], ValueError, r"page_ids must have rank 1"),
    ],
)
def test_zero_pages_static_errors(pools, ids, exc, match):
    with pytest.raises(exc, match=match):
        zero_pages(pools, ids)


# ---- dynamic checks ----


def test_check_write_slots_accepts_valid():
    check_write_slots(POOL, np.array([4, -1, 19, 5, -1], np.int32))
    check_write_slots(POOL.shape, jnp.zeros((0,), jnp.int32))


@pytest.mark.parametrize(
    ("slots", "match"),
    [
        (
            [4, -2],
            r"positions \[1\] \(-2, \.\.\.\)' is invalid: .* are negative but only -1 means skip",
        ),
        ([4, 24], r"\(24, \.\.\.\)' is invalid: .* out of range.*6 \* 4 = 24"),
        ([4, 3], r"positions \[1\] \(3, \.\.\.\)' is invalid: .* target page 0, the null page"),
        (
            [20, 4],
            r"positions \[0\] \(20, \.\.\.\)' is invalid: .* target page 5, the reserved scratch page",
        ),
        ([4, 7, 4, -1], r"slot 4 at positions \[0, 2\]' is invalid: .*slot 4 appears 2 times"),
        (np.zeros((2, 2), np.int32), r"must be a rank-1 integer array"),
    ],
)
def test_check_write_slots_errors(slots, match):
    with pytest.raises(ValueError, match=match):
        check_write_slots(POOL, np.asarray(slots, np.int32))


def test_dynamic_checks_refuse_tracers():
    with pytest.raises(TypeError, match=r"must run outside jax\.jit"):
        jax.jit(lambda s: check_write_slots(POOL.shape, s))(SLOTS)
    with pytest.raises(TypeError, match=r"must run outside jax\.jit"):
        jax.jit(lambda s: check_page_ids(6, s))(SLOTS)


def test_check_page_ids_accepts_valid_including_null_and_duplicates():
    check_page_ids((POOL, POOL), np.array([0, 1, 4, 4, -1], np.int32))
    check_page_ids(6, np.zeros((0,), np.int32))


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([1, -3], r"positions \[1\] \(-3, \.\.\.\)' is invalid: .* are negative"),
        ([6, 1], r"positions \[0\] \(6, \.\.\.\)' is invalid: .* out of range.*num_pages = 6"),
        ([5], r"name page 5, the reserved scratch page"),
    ],
)
def test_check_page_ids_errors(ids, match):
    with pytest.raises(ValueError, match=match):
        check_page_ids({"a": POOL}, np.asarray(ids, np.int32))
