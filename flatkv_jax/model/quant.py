"""Quantize / dequantize references for the cache row formats, in their exact byte layout.

Every function packs fp32 rows into the bytes a pool of that :class:`~flatkv_jax.formats.RowFormat`
stores (and back), so the model exercises the production layouts:

- ``fp8_ds_mla`` (KV rows): ``nope_fp8`` = the no-RoPE dims as fp8 e4m3, one UE8M0 scale per
  ``scale_block`` values; ``rope_bf16`` = the RoPE dims as bf16 (2 bytes each, the platform's
  bf16 byte order); ``scales_ue8m0`` = one biased exponent byte per block; ``pad`` = zeros.
- ``indexer_mxfp4`` (indexer keys): ``values_e2m1`` = two e2m1 codes per byte (element ``2i``
  in the low nibble, ``2i+1`` in the high nibble); ``scales_ue8m0`` = one byte per 32 values.
- ``indexer_fp8``: ``values_fp8`` = fp8 e4m3; ``scale_fp32`` = one fp32 scale as 4 bytes.
- ``plain_float32`` / ``plain_bfloat16``: the values cast to the storage dtype.

Scales: a UE8M0 scale is the power of two ``2**ceil(log2(amax / max_code))`` (so no value
clips), stored as ``exponent + 127`` and at least 1 (scales stay normal fp32: XLA:CPU flushes
subnormals); an all-zero block stores byte 0 and decodes to zeros. The
fp8 indexer scale is ``amax / 448`` in fp32 (1 for an all-zero row).

Tolerances (per element, ``s`` = the element's block scale; the tests check these bounds):

- fp8 e4m3 values: ``|x - q(x)| <= 2**-4 * |x| + 2**-10 * s`` (3 mantissa bits, subnormals
  below ``2**-6 * s``).
- bf16 values: ``|x - q(x)| <= 2**-8 * |x|``.
- e2m1 values: ``|x - q(x)| <= 0.25 * |x| + 0.25 * s`` (grid 0, .5, 1, 1.5, 2, 3, 4, 6; round to
  nearest, ties toward zero).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from flatkv_jax.errors import fail
from flatkv_jax.formats import RowFormat

FP8_MAX = 448.0
E2M1_MAX = 6.0
#: Magnitudes of the e2m1 codes 0..7 (code bit 3 is the sign).
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_BLOCK = 32


# --- scalar helpers ------------------------------------------------------------------------
def _ue8m0_encode(amax: jax.Array, max_code: float) -> jax.Array:
    """Biased exponent byte of the smallest power of two ``s`` with ``amax / s <= max_code``."""
    # frexp is exact: v = m * 2**e with m in [0.5, 1), so ceil(log2 v) = e - (m == 0.5).
    # Tiny blocks are lifted by 2**64 first: amax / max_code must not underflow into the
    # subnormals that XLA:CPU flushes to zero.
    tiny = amax < 2.0**-64
    m, e = jnp.frexp(jnp.where(tiny, amax * 2.0**64, amax) / max_code)
    exp = jnp.where(m == 0.5, e - 1, e) - jnp.where(tiny, 64, 0)
    # Byte >= 1 keeps the scale a normal fp32 (XLA:CPU flushes subnormals to zero); byte 0 is
    # left to all-zero blocks.
    biased = jnp.where(amax > 0, jnp.clip(exp + 127, 1, 254), 0)
    return biased.astype(jnp.uint8)


def _ue8m0_decode(byte: jax.Array) -> jax.Array:
    """fp32 power of two ``2**(byte - 127)`` (byte 0, all-zero blocks only, decodes as 0)."""
    return lax.bitcast_convert_type(byte.astype(jnp.int32) << 23, jnp.float32)


def _safe(scale: jax.Array) -> jax.Array:
    """A divisor for ``x / scale`` that is 1 where the scale is 0 (all-zero blocks)."""
    return jnp.where(scale > 0, scale, jnp.float32(1.0))


def _to_bytes(x: jax.Array) -> jax.Array:
    """``[..., n]`` of a 2- or 4-byte dtype -> ``uint8[..., n * itemsize]``."""
    b = lax.bitcast_convert_type(x, jnp.uint8)
    return b.reshape(*x.shape[:-1], -1)


def _from_bytes(b: jax.Array, dtype) -> jax.Array:
    size = jnp.dtype(dtype).itemsize
    return lax.bitcast_convert_type(b.reshape(*b.shape[:-1], -1, size), dtype)


def _fp8_bytes(v: jax.Array) -> jax.Array:
    q = jnp.clip(v, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return lax.bitcast_convert_type(q, jnp.uint8)


def _fp8_values(b: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(b, jnp.float8_e4m3fn).astype(jnp.float32)


def _block_amax(x: jax.Array, block: int) -> jax.Array:
    return jnp.max(jnp.abs(x.reshape(*x.shape[:-1], -1, block)), axis=-1)


def _per_value(scales: jax.Array, block: int) -> jax.Array:
    return jnp.repeat(scales, block, axis=-1)


# --- fp8_ds_mla -----------------------------------------------------------------------------
def _mla_dims(fmt: RowFormat) -> tuple[int, int, int]:
    nope = fmt.segment("nope_fp8").nbytes
    rope = fmt.segment("rope_bf16").nbytes // 2
    n_scales = fmt.segment("scales_ue8m0").nbytes
    return nope, rope, nope // n_scales


def encode_fp8_ds_mla(fmt: RowFormat, x: jax.Array) -> jax.Array:
    nope, rope, block = _mla_dims(fmt)
    xn, xr = x[..., :nope], x[..., nope:]
    scale_b = _ue8m0_encode(_block_amax(xn, block), FP8_MAX)
    vals = _fp8_bytes(xn / _per_value(_safe(_ue8m0_decode(scale_b)), block))
    rope_b = _to_bytes(xr.astype(jnp.bfloat16))
    pad = jnp.zeros((*x.shape[:-1], fmt.nbytes - nope - 2 * rope - scale_b.shape[-1]), jnp.uint8)
    return jnp.concatenate([vals, rope_b, scale_b, pad], axis=-1)


def decode_fp8_ds_mla(fmt: RowFormat, b: jax.Array) -> jax.Array:
    nope, rope, block = _mla_dims(fmt)
    seg = fmt.segment("scales_ue8m0")
    scales = _ue8m0_decode(b[..., seg.offset : seg.offset + seg.nbytes])
    xn = _fp8_values(b[..., :nope]) * _per_value(scales, block)
    xr = _from_bytes(b[..., nope : nope + 2 * rope], jnp.bfloat16).astype(jnp.float32)
    return jnp.concatenate([xn, xr], axis=-1)


# --- MXFP4 ----------------------------------------------------------------------------------
def _e2m1_codes(v: jax.Array) -> jax.Array:
    grid = jnp.asarray(E2M1_GRID, jnp.float32)
    mag = jnp.abs(jnp.clip(v, -E2M1_MAX, E2M1_MAX))
    # argmin picks the first minimum: ties go to the smaller magnitude (toward zero).
    idx = jnp.argmin(jnp.abs(mag[..., None] - grid.reshape((1,) * mag.ndim + (-1,))), axis=-1)
    idx = idx.astype(jnp.uint8)
    sign = jnp.where(v < 0, jnp.uint8(8), jnp.uint8(0))
    return idx | sign


def _e2m1_values(codes: jax.Array) -> jax.Array:
    grid = jnp.asarray(E2M1_GRID, jnp.float32)
    mag = grid[(codes & 7).astype(jnp.int32)]
    return jnp.where((codes & 8) != 0, -mag, mag)


def encode_mxfp4(fmt: RowFormat, x: jax.Array) -> jax.Array:
    scale_b = _ue8m0_encode(_block_amax(x, MXFP4_BLOCK), E2M1_MAX)
    codes = _e2m1_codes(x / _per_value(_safe(_ue8m0_decode(scale_b)), MXFP4_BLOCK))
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return jnp.concatenate([packed, scale_b], axis=-1)


def decode_mxfp4(fmt: RowFormat, b: jax.Array) -> jax.Array:
    nvals = fmt.segment("values_e2m1").nbytes
    packed, scale_b = b[..., :nvals], b[..., nvals:]
    codes = jnp.stack([packed & 15, packed >> 4], axis=-1).reshape(*b.shape[:-1], 2 * nvals)
    return _e2m1_values(codes) * _per_value(_ue8m0_decode(scale_b), MXFP4_BLOCK)


# --- FP8 indexer ----------------------------------------------------------------------------
def encode_indexer_fp8(fmt: RowFormat, x: jax.Array) -> jax.Array:
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, jnp.float32(1.0))
    return jnp.concatenate([_fp8_bytes(x / scale), _to_bytes(scale)], axis=-1)


def decode_indexer_fp8(fmt: RowFormat, b: jax.Array) -> jax.Array:
    dim = fmt.segment("values_fp8").nbytes
    scale = _from_bytes(b[..., dim:], jnp.float32)
    return _fp8_values(b[..., :dim]) * scale


# --- dispatch -------------------------------------------------------------------------------
_CODECS = {
    "fp8_ds_mla": (encode_fp8_ds_mla, decode_fp8_ds_mla),
    "indexer_mxfp4": (encode_mxfp4, decode_mxfp4),
    "indexer_fp8": (encode_indexer_fp8, decode_indexer_fp8),
}


# One compiled codec per (format, shape) outside jit; inlined when traced inside a step.
@functools.partial(jax.jit, static_argnums=0)
def _encode(fmt: RowFormat, x: jax.Array) -> jax.Array:
    if fmt.name in _CODECS:
        return _CODECS[fmt.name][0](fmt, x)
    return x.astype(fmt.dtype)


@functools.partial(jax.jit, static_argnums=0)
def _decode(fmt: RowFormat, stored: jax.Array) -> jax.Array:
    if fmt.name in _CODECS:
        return _CODECS[fmt.name][1](fmt, stored)
    return stored.astype(jnp.float32)


def value_dim(fmt: RowFormat) -> int:
    """How many fp32 values one row of ``fmt`` holds."""
    if fmt.name == "fp8_ds_mla":
        nope, rope, _ = _mla_dims(fmt)
        return nope + rope
    if fmt.name == "indexer_mxfp4":
        return 2 * fmt.segment("values_e2m1").nbytes
    if fmt.name == "indexer_fp8":
        return fmt.segment("values_fp8").nbytes
    if fmt.name.startswith("plain_") and len(fmt.shape) == 1:
        return fmt.shape[0]
    fail(
        "format",
        fmt.name,
        "the model stores fp8_ds_mla, indexer_mxfp4, indexer_fp8 or 1-D plain rows",
        "pick one of those",
    )


def encode(fmt: RowFormat, x: jax.Array) -> jax.Array:
    """Packs fp32 rows into the storage of ``fmt``.

    Args:
      fmt: the row format.
      x: ``float32[..., value_dim(fmt)]``.

    Returns:
      ``[..., *fmt.shape]`` of ``fmt.dtype`` (``uint8`` for packed formats), ready for a pool.
    """
    if x.shape[-1] != value_dim(fmt):
        fail(
            "x",
            x.shape,
            f"rows of format {fmt.name!r} hold {value_dim(fmt)} values",
            "pass rows of that width",
        )
    return _encode(fmt, x.astype(jnp.float32))


def decode(fmt: RowFormat, stored: jax.Array) -> jax.Array:
    """Unpacks stored rows of ``fmt`` to ``float32[..., value_dim(fmt)]``."""
    if stored.shape[-len(fmt.shape) :] != fmt.shape or stored.dtype != jnp.dtype(fmt.dtype):
        fail(
            "stored",
            (stored.shape, str(stored.dtype)),
            f"rows of format {fmt.name!r} are {fmt.shape} {fmt.dtype}",
            "pass rows read from a pool of that format",
        )
    return _decode(fmt, stored)


def roundtrip(fmt: RowFormat, x: jax.Array) -> jax.Array:
    """``decode(fmt, encode(fmt, x))``: what a reader of the cache sees for rows ``x``."""
    return decode(fmt, encode(fmt, x))
