"""Quantize/dequantize references: exact byte layouts and round-trip tolerances.

Bounds (docs/model.md, flatkv_jax/model/quant.py), per element with block scale ``s``:
fp8 e4m3 ``2**-4 |x| + 2**-10 s``; bf16 ``2**-8 |x|``; e2m1 ``0.25 |x| + 0.25 s``.
Long local run: ``FLATKV_MODEL_EXAMPLES=200 pytest tests/model/test_model_quant.py``.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flatkv_jax import formats
from flatkv_jax.model import quant

EXAMPLES = int(os.environ.get("FLATKV_MODEL_EXAMPLES", "10"))
MLA = formats.fp8_ds_mla()  # 448 + 128 + 7 + 1 = 584 bytes
MLA_TINY = formats.fp8_ds_mla(nope_dim=64, rope_dim=16)
MX = formats.indexer_mxfp4(128)  # 64 + 4 = 68 bytes
FP8 = formats.indexer_fp8(128)  # 128 + 4 = 132 bytes


def _rows(seed, n, dim, spread=3.0):
    rng = np.random.default_rng(seed)
    # Values over several binades per row, plus an all-zero row and a tiny row.
    x = rng.standard_normal((n, dim)).astype(np.float32) * np.exp2(
        rng.uniform(-spread, spread, (n, 1))
    ).astype(np.float32)
    x[0] = 0.0
    x[1] *= 1e-30
    return jnp.asarray(x)


def _block_scale(x, block, max_code):
    amax = np.abs(np.asarray(x)).reshape(x.shape[0], -1, block).max(-1)
    with np.errstate(divide="ignore"):
        s = np.maximum(np.exp2(np.ceil(np.log2(amax / max_code))), 2.0**-126)
    return np.repeat(np.where(amax > 0, s, 0.0), block, axis=-1)


@settings(max_examples=EXAMPLES, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_fp8_ds_mla_round_trip_within_tolerance(seed):
    x = _rows(seed, 6, 512)
    b = quant.encode(MLA, x)
    assert b.shape == (6, 584) and b.dtype == jnp.uint8
    y = np.asarray(quant.decode(MLA, b))
    xn, xr = np.asarray(x)[:, :448], np.asarray(x)[:, 448:]
    s = _block_scale(xn, 64, 448.0)
    assert np.all(np.abs(y[:, :448] - xn) <= 2**-4 * np.abs(xn) + 2**-10 * s)
    assert np.all(np.abs(y[:, 448:] - xr) <= 2**-8 * np.abs(xr))
    # Decoded values are exactly representable: a second round trip changes nothing.
    assert np.array_equal(np.asarray(quant.roundtrip(MLA, jnp.asarray(y))), y)


def test_fp8_ds_mla_byte_layout():
    x = np.zeros((1, 80), np.float32)
    x[0, 0], x[0, 1], x[0, 63] = 1.0, -448.0, 0.5  # block amax 448 -> scale 1 (byte 127)
    x[0, 64:] = 1.5  # RoPE part, bf16 1.5 = 0x3FC0
    b = np.asarray(quant.encode(MLA_TINY, jnp.asarray(x)))[0]
    seg = {s.name: s for s in MLA_TINY.segments}
    assert MLA_TINY.nbytes == 104 and seg["pad"].nbytes == 7
    assert b[0] == 0x38 and b[1] == 0xFE and b[63] == 0x30  # e4m3: 1.0, -448, 0.5
    rope = b[seg["rope_bf16"].offset : seg["rope_bf16"].offset + 32].view(np.uint16)
    assert np.all(rope == 0x3FC0)
    assert b[seg["scales_ue8m0"].offset] == 127
    assert np.all(b[seg["pad"].offset :] == 0)
    assert np.array_equal(np.asarray(quant.decode(MLA_TINY, jnp.asarray(b[None]))), x)


def test_ue8m0_scale_is_the_smallest_power_of_two_that_avoids_clipping():
    x = np.zeros((3, 80), np.float32)
    x[0, 0] = 448.0 * 4  # exactly representable at scale 4
    x[1, 0] = 448.0 * 4 + 1.0  # needs scale 8
    x[2, 0] = 448.0 * 2**-130  # tiny: the scale stops at 2**-126 (byte 1), the value is exact
    b = np.asarray(quant.encode(MLA_TINY, jnp.asarray(x)))
    sc = MLA_TINY.segment("scales_ue8m0").offset
    assert list(b[:, sc]) == [129, 130, 1]
    y = np.asarray(quant.decode(MLA_TINY, jnp.asarray(b)))
    assert y[0, 0] == x[0, 0] and y[2, 0] == x[2, 0]
    assert abs(y[1, 0] - x[1, 0]) <= 2**-4 * x[1, 0]


@settings(max_examples=EXAMPLES, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_mxfp4_round_trip_within_tolerance(seed):
    x = _rows(seed, 6, 128)
    b = quant.encode(MX, x)
    assert b.shape == (6, 68) and b.dtype == jnp.uint8
    y = np.asarray(quant.decode(MX, b))
    s = _block_scale(x, 32, 6.0)
    assert np.all(np.abs(y - np.asarray(x)) <= 0.25 * np.abs(np.asarray(x)) + 0.25 * s)
    assert np.array_equal(np.asarray(quant.roundtrip(MX, jnp.asarray(y))), y)


def test_mxfp4_byte_layout():
    x = np.zeros((1, 32), np.float32)
    x[0, :8] = [6.0, -0.5, 1.0, 3.0, 1.25, -6.0, 0.0, 4.0]  # amax 6 -> scale 1 (byte 127)
    fmt = formats.indexer_mxfp4(32)
    b = np.asarray(quant.encode(fmt, jnp.asarray(x)))[0]
    assert fmt.nbytes == 17
    # Codes: 6 -> 7, -0.5 -> 9, 1 -> 2, 3 -> 5, 1.25 -> 2 (tie toward zero), -6 -> 15, 0, 4 -> 6;
    # element 2i in the low nibble.
    assert list(b[:4]) == [0x97, 0x52, 0xF2, 0x60]
    assert b[16] == 127
    y = np.asarray(quant.decode(fmt, jnp.asarray(b[None])))[0]
    assert list(y[:8]) == [6.0, -0.5, 1.0, 3.0, 1.0, -6.0, 0.0, 4.0]


@settings(max_examples=EXAMPLES, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_indexer_fp8_round_trip_within_tolerance(seed):
    x = _rows(seed, 6, 128)
    b = quant.encode(FP8, x)
    assert b.shape == (6, 132) and b.dtype == jnp.uint8
    y = np.asarray(quant.decode(FP8, b))
    xs = np.asarray(x)
    scale = np.abs(xs).max(-1, keepdims=True) / 448.0
    assert np.all(np.abs(y - xs) <= 2**-4 * np.abs(xs) + 2**-9 * scale)
    stored = np.asarray(b)[:, 128:].copy().view(np.float32)[:, 0]
    np.testing.assert_allclose(stored[2:], scale[2:, 0], rtol=1e-6)
    assert stored[0] == 1.0  # all-zero row


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plain_rows(dtype):
    fmt = formats.plain(16, dtype)
    x = _rows(0, 3, 16)
    b = quant.encode(fmt, x)
    assert b.dtype == jnp.dtype(dtype)
    y = np.asarray(quant.decode(fmt, b))
    tol = 0.0 if dtype == "float32" else 2**-8
    assert np.all(np.abs(y - np.asarray(x)) <= tol * np.abs(np.asarray(x)))


def test_codec_errors():
    with pytest.raises(
        ValueError, match=r"x=\(2, 7\) is invalid: rows of format 'indexer_mxfp4' hold 128 values"
    ):
        quant.encode(MX, jnp.zeros((2, 7), jnp.float32))
    with pytest.raises(
        ValueError, match=r"stored=.*is invalid: rows of format 'fp8_ds_mla' are \(584,\) uint8"
    ):
        quant.decode(MLA, jnp.zeros((2, 584), jnp.float32))
    with pytest.raises(ValueError, match=r"format='compressor_state' is invalid: the model stores"):
        quant.value_dim(formats.compressor_state(8, overlap=True))
