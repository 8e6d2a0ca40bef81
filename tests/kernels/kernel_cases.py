"""Shared helpers of the kernel tests: pool geometries, poisoned pools, a NumPy oracle."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

POISON_U8 = 0xAB


@dataclasses.dataclass(frozen=True)
class Geometry:
    """One pool geometry: ``[num_pages, rows_per_page, *row_shape]`` of ``dtype``."""

    name: str
    num_pages: int
    rows_per_page: int
    row_shape: tuple[int, ...]
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_pages, self.rows_per_page, *self.row_shape)

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(jnp.bfloat16) if self.dtype == "bfloat16" else np.dtype(self.dtype)

    def __str__(self) -> str:
        return self.name


# The project's row formats (packed fp8/MXFP4 rows, bf16 rows, fp32 compressor state scaled
# down) at page sizes from 1 to 64 rows; page counts stay small to keep interpret mode fast.
GEOMETRIES = [
    Geometry("u8x584_r64", 5, 64, (584,), "uint8"),
    Geometry("u8x132_r16", 7, 16, (132,), "uint8"),
    Geometry("u8x68_r4", 9, 4, (68,), "uint8"),
    Geometry("u8x68_r1", 12, 1, (68,), "uint8"),
    Geometry("bf16x512_r8", 6, 8, (512,), "bfloat16"),
    Geometry("f32x2x2x16_r4", 6, 4, (2, 2, 16), "float32"),
]


def poisoned_pool(geo: Geometry) -> np.ndarray:
    """A pool whose every byte is a sentinel: 0xAB for integers, NaN for floats."""
    if np.issubdtype(geo.np_dtype, np.integer):
        return np.full(geo.shape, POISON_U8, dtype=geo.np_dtype)
    return np.full(geo.shape, np.nan, dtype=geo.np_dtype)


def random_rows(geo: Geometry, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` random rows; float rows avoid NaN so bit comparisons are meaningful."""
    shape = (n, *geo.row_shape)
    if np.issubdtype(geo.np_dtype, np.integer):
        return rng.integers(0, 256, size=shape, dtype=np.uint8).astype(geo.np_dtype)
    return rng.standard_normal(shape).astype(np.float32).astype(geo.np_dtype)


def real_slots(geo: Geometry) -> np.ndarray:
    """Every slot of the real pages 1 .. num_pages-2 (not the null or the scratch page)."""
    r = geo.rows_per_page
    return np.arange(r, (geo.num_pages - 1) * r, dtype=np.int32)


def oracle_write(pool: np.ndarray, rows: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """NumPy oracle of write_rows: in-range slots written, everything else untouched."""
    out = pool.copy()
    p, r = pool.shape[:2]
    for row, slot in zip(rows, slots, strict=True):
        if 0 <= slot < p * r:
            out[slot // r, slot % r] = row
    return out


def oracle_zero(pool: np.ndarray, page_ids: np.ndarray) -> np.ndarray:
    out = pool.copy()
    for page in page_ids:
        if 0 <= page < pool.shape[0]:
            out[page] = 0
    return out


def assert_bits_equal(actual, expected) -> None:
    """Bit-exact comparison (NaN poison included)."""
    a = np.ascontiguousarray(np.asarray(actual))
    e = np.ascontiguousarray(np.asarray(expected))
    assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, a.dtype, e.shape, e.dtype)
    ab, eb = a.view(np.uint8), e.view(np.uint8)
    if not np.array_equal(ab, eb):
        bad = np.argwhere(ab.reshape(a.shape[0], -1) != eb.reshape(e.shape[0], -1))
        raise AssertionError(f"pools differ at (page, byte) {bad[:5].tolist()} ...")


def as_jnp(x: np.ndarray):
    return jnp.asarray(x)
