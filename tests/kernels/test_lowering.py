"""Lowering checks from this CPU machine: TPU kernels for ("tpu",), the GPU path for ("cuda",)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from kernel_cases import GEOMETRIES

from kernels_pallas import Impl, write_rows, zero_pages
from kernels_pallas._compat import JAX_VERSION
from kernels_pallas.gpu_decision import probe_mosaic_gpu_row_copy


def _write_args(geo, n=24):
    return (
        jax.ShapeDtypeStruct(geo.shape, geo.np_dtype),
        jax.ShapeDtypeStruct((n, *geo.row_shape), geo.np_dtype),
        jax.ShapeDtypeStruct((n,), jnp.int32),
    )


def _group_args(k=6):
    # One group: shared num_pages, different row shapes and dtypes.
    shapes = [
        ((7, 16, 132), jnp.uint8),
        ((7, 16, 584), jnp.uint8),
        ((7, 16, 2, 2, 16), jnp.float32),
    ]
    pools = tuple(jax.ShapeDtypeStruct(s, d) for s, d in shapes)
    return pools, jax.ShapeDtypeStruct((k,), jnp.int32)


def _export(fn, platform, *args):
    return jax.export.export(jax.jit(fn, donate_argnums=0), platforms=(platform,))(*args)


@pytest.mark.parametrize("geo", GEOMETRIES, ids=str)
def test_write_rows_pallas_lowers_for_tpu(geo):
    exp = _export(
        lambda p, r, s: write_rows(p, r, s, impl=Impl.PALLAS_TPU), "tpu", *_write_args(geo)
    )
    text = exp.mlir_module()
    assert "tpu_custom_call" in text
    assert "flatkv_write_rows" in text


def test_zero_pages_pallas_lowers_for_tpu():
    exp = _export(lambda p, i: zero_pages(p, i, impl=Impl.PALLAS_TPU), "tpu", *_group_args())
    text = exp.mlir_module()
    assert text.count("tpu_custom_call") == 1  # one kernel for the whole group
    assert "flatkv_zero_pages" in text


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_reference_lowers_for_accelerators(platform):
    """The GPU path is the reference (XLA scatter); it must lower, with no custom calls."""
    geo = GEOMETRIES[0]
    w = _export(lambda p, r, s: write_rows(p, r, s), platform, *_write_args(geo))
    z = _export(lambda p, i: zero_pages(p, i), platform, *_group_args())
    for exp in (w, z):
        text = exp.mlir_module()
        assert "stablehlo.scatter" in text
        assert "custom_call" not in text


@pytest.mark.parametrize("geo", GEOMETRIES[:1], ids=str)
def test_tpu_kernel_is_not_a_gpu_kernel(geo):
    """The TPU kernel (TPU compiler params, scalar prefetch) cannot lower for CUDA."""
    with pytest.raises(
        (NotImplementedError, ValueError),
        match=r"cannot be used for gpu lowering|Cannot lower pallas_call|Scalar prefetch not supported",
    ):
        _export(
            lambda p, r, s: write_rows(p, r, s, impl=Impl.PALLAS_TPU), "cuda", *_write_args(geo)
        )


@pytest.mark.skipif(JAX_VERSION[:2] != (0, 10), reason="errors recorded with jax 0.10.x")
@pytest.mark.parametrize(
    ("row_shape", "dtype", "expected"),
    [
        ((584,), jnp.uint8, "bytes divisible by the warpgroup size.*bytes=584"),
        ((146,), jnp.uint32, "bytes divisible by the warpgroup size.*bytes=584"),
        ((132,), jnp.uint8, "bytes divisible by the warpgroup size.*bytes=132"),
        ((68,), jnp.uint8, "bytes divisible by the warpgroup size.*bytes=68"),
        ((512,), jnp.bfloat16, "<=256 elements along each dimension"),
        ((128,), jnp.float32, None),
    ],
)
def test_mosaic_gpu_probe_matches_documented_decision(row_shape, dtype, expected):
    """The GPU decision in kernels_pallas/gpu_decision.py and docs/kernels.md, re-measured."""
    error = probe_mosaic_gpu_row_copy(row_shape, dtype)
    if expected is None:
        assert error is None  # the probe itself is a valid Mosaic GPU kernel
    else:
        assert error is not None
        assert re.search(expected, error), error
