"""Parity of zero_pages: reference and Pallas (interpret=True) against a NumPy oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import GEOMETRIES, Geometry, assert_bits_equal, oracle_zero, poisoned_pool

from kernels_pallas import Impl, zero_pages
from kernels_pallas.zero_pages import pallas_tpu, reference

IMPLS = [
    pytest.param(dict(impl=Impl.REFERENCE), id="reference"),
    pytest.param(dict(impl=Impl.PALLAS_TPU, interpret=True), id="pallas_tpu-interpret"),
]

NUM_PAGES = 7
# One group: the arrays share num_pages (and so page ids) but differ in dtype and row shape,
# and two arrays share a page signature (the kernel shares one zero page between them).
GROUP = [
    Geometry("u8x584", NUM_PAGES, 8, (584,), "uint8"),
    Geometry("u8x584_layer2", NUM_PAGES, 8, (584,), "uint8"),
    Geometry("u8x68", NUM_PAGES, 8, (68,), "uint8"),
    Geometry("bf16x512", NUM_PAGES, 8, (512,), "bfloat16"),
    Geometry("f32state", NUM_PAGES, 8, (2, 2, 16), "float32"),
]


def _ids(case: str, rng: np.random.Generator) -> np.ndarray:
    real = np.arange(1, NUM_PAGES - 1, dtype=np.int32)
    if case == "empty":
        return np.zeros((0,), np.int32)
    if case == "all_real":
        return rng.permutation(real).astype(np.int32)
    if case == "all_skip":
        return np.full((4,), -1, np.int32)
    if case == "random_with_null":
        ids = np.concatenate([rng.choice(real, 2, replace=False), [0, -1, -1]]).astype(np.int32)
        return rng.permutation(ids).astype(np.int32)
    if case == "duplicates":
        return np.array([3, 3, -1, 2, 3], np.int32)
    raise AssertionError(case)


@pytest.mark.parametrize("impl_kw", IMPLS)
@pytest.mark.parametrize(
    "case", ["empty", "all_real", "all_skip", "random_with_null", "duplicates"]
)
def test_zero_pages_group_matches_oracle(case, impl_kw, rng):
    pools = tuple(poisoned_pool(g) for g in GROUP)
    ids = _ids(case, rng)
    fn = jax.jit(lambda p, i: zero_pages(p, i, **impl_kw), donate_argnums=0)
    out = fn(tuple(jnp.asarray(p) for p in pools), jnp.asarray(ids))
    assert isinstance(out, tuple) and len(out) == len(pools)
    for got, pool in zip(out, pools, strict=True):
        assert_bits_equal(got, oracle_zero(pool, ids))


@pytest.mark.parametrize("impl_kw", IMPLS)
@pytest.mark.parametrize("geo", GEOMETRIES, ids=str)
def test_zero_pages_single_array_geometries(geo, impl_kw, rng):
    pool = poisoned_pool(geo)
    ids = np.array([geo.num_pages - 2, -1, 1], np.int32)
    out = zero_pages((jnp.asarray(pool),), jnp.asarray(ids), **impl_kw)
    assert_bits_equal(out[0], oracle_zero(pool, ids))


@pytest.mark.parametrize("impl_kw", IMPLS)
def test_dict_pytree_and_out_of_range_ids(impl_kw):
    pools = {"k": poisoned_pool(GROUP[0]), "state": poisoned_pool(GROUP[4])}
    # -2 must not wrap onto page num_pages-2; num_pages+3 must not clamp onto the scratch page.
    ids = np.array([-2, 2, NUM_PAGES, NUM_PAGES + 3, -NUM_PAGES], np.int32)
    out = zero_pages({k: jnp.asarray(v) for k, v in pools.items()}, jnp.asarray(ids), **impl_kw)
    assert set(out) == {"k", "state"}
    for k, v in pools.items():
        expected = v.copy()
        expected[2] = 0
        assert_bits_equal(out[k], expected)


@pytest.mark.parametrize("block_pages", [1, 2, 64])
def test_kernel_block_sizes_cover_tail_blocks(block_pages, rng):
    pools = tuple(poisoned_pool(g) for g in GROUP[:3])
    ids = np.array([5, -1, 1, 4, 0], np.int32)
    out = pallas_tpu.zero_pages(
        tuple(jnp.asarray(p) for p in pools),
        jnp.asarray(ids),
        interpret=True,
        block_pages=block_pages,
    )
    ref = reference.zero_pages(tuple(jnp.asarray(p) for p in pools), jnp.asarray(ids))
    for got, want, pool in zip(out, ref, pools, strict=True):
        assert_bits_equal(got, want)
        assert_bits_equal(got, oracle_zero(pool, ids))
