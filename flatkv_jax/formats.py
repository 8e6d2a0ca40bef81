"""Row formats: the byte layout of one cache row of one field.

A row format is a frozen, hashable description (dtype + row shape + named byte segments);
pools store rows of exactly ``nbytes`` bytes, so a page's stride equals its payload. The
named constructors build the formats production engines use for DeepSeek V4 and plain
formats for tests; every constructor validates its arguments.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from flatkv_jax.errors import check_positive_int, fail

#: dtypes a row may be stored in (names understood by ``jnp.dtype``).
ROW_DTYPES = ("uint8", "int8", "bfloat16", "float16", "float32", "int32")

_ITEMSIZE = {"uint8": 1, "int8": 1, "bfloat16": 2, "float16": 2, "float32": 4, "int32": 4}


@dataclasses.dataclass(frozen=True)
class Segment:
    """A named byte range inside a packed row (for quantized formats).

    Attributes:
      name: what the bytes hold, e.g. ``"nope_fp8"``.
      offset: first byte within the row.
      nbytes: length in bytes.
    """

    name: str
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class RowFormat:
    """How one row of one field is stored.

    Attributes:
      name: format name, e.g. ``"fp8_ds_mla"``.
      dtype: storage dtype name (one of :data:`ROW_DTYPES`).
      shape: row shape in elements of ``dtype``; a pool of this field has shape
        ``[num_pages, rows_per_page, *shape]``.
      segments: for packed byte formats, the named byte ranges (empty for plain rows).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    segments: tuple[Segment, ...] = ()

    def __post_init__(self):
        if self.dtype not in ROW_DTYPES:
            fail(
                "dtype",
                self.dtype,
                f"a row dtype must be one of {ROW_DTYPES}",
                "store the row in one of those dtypes (pack other formats into uint8)",
                exc=TypeError,
            )
        if not isinstance(self.shape, tuple) or not self.shape:
            fail("shape", self.shape, "a row shape must be a non-empty tuple", "pass e.g. (512,)")
        for d in self.shape:
            check_positive_int("shape entry", d, "every row dimension must be >= 1")
        end = 0
        for seg in self.segments:
            if seg.offset != end:
                fail(
                    "segments",
                    self.segments,
                    "segments must tile the row contiguously from byte 0",
                    "list segments in byte order without gaps",
                )
            end = seg.offset + seg.nbytes
        if self.segments and end != self.nbytes:
            fail(
                "segments",
                self.segments,
                f"segments cover {end} bytes but the row holds {self.nbytes}",
                "make the segments add up to the row size",
            )

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``."""
        return _ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes per row."""
        return self.itemsize * math.prod(self.shape)

    @property
    def np_dtype(self) -> np.dtype:
        """The storage dtype as a NumPy dtype (bfloat16 via ml_dtypes, as JAX does)."""
        import jax.numpy as jnp

        return np.dtype(jnp.dtype(self.dtype))

    def segment(self, name: str) -> Segment:
        """Returns the segment called ``name``."""
        for seg in self.segments:
            if seg.name == name:
                return seg
        fail(
            "segment",
            name,
            f"format {self.name!r} has segments {[s.name for s in self.segments]}",
            "ask for one of those",
        )


def _packed(name: str, parts: list[tuple[str, int]]) -> RowFormat:
    segs, off = [], 0
    for seg_name, n in parts:
        if n > 0:
            segs.append(Segment(seg_name, off, n))
            off += n
    return RowFormat(name=name, dtype="uint8", shape=(off,), segments=tuple(segs))


def fp8_ds_mla(
    nope_dim: int = 448, rope_dim: int = 64, scale_block: int = 64, align: int = 8
) -> RowFormat:
    """DeepSeek "fp8_ds_mla" KV row: fp8 e4m3 no-RoPE part, bf16 RoPE part, UE8M0 scales.

    With the V4 defaults: 448 fp8 bytes + 64 bf16 (128 bytes) + 7 UE8M0 scales (one per 64
    no-RoPE values) + 1 pad byte = 584 bytes.

    Args:
      nope_dim: no-RoPE dims, stored as fp8 (1 byte each); a multiple of ``scale_block``.
      rope_dim: RoPE dims, stored as bf16.
      scale_block: values per UE8M0 scale byte.
      align: the row is padded to a multiple of this many bytes.
    """
    check_positive_int("nope_dim", nope_dim)
    check_positive_int("rope_dim", rope_dim)
    check_positive_int("scale_block", scale_block)
    check_positive_int("align", align)
    if nope_dim % scale_block:
        fail(
            "nope_dim",
            nope_dim,
            f"the fp8 part must be a whole number of {scale_block}-value scale blocks",
            f"use a multiple of {scale_block} (448 in V4)",
        )
    payload = nope_dim + 2 * rope_dim + nope_dim // scale_block
    pad = -payload % align
    return _packed(
        "fp8_ds_mla",
        [
            ("nope_fp8", nope_dim),
            ("rope_bf16", 2 * rope_dim),
            ("scales_ue8m0", nope_dim // scale_block),
            ("pad", pad),
        ],
    )


def indexer_mxfp4(dim: int = 128, block: int = 32) -> RowFormat:
    """Lightning-indexer key in MXFP4: two e2m1 values per byte + one UE8M0 scale per block.

    ``dim=128`` gives 64 value bytes + 4 scale bytes = 68 bytes.
    """
    check_positive_int("dim", dim)
    check_positive_int("block", block)
    if dim % block or block % 2:
        fail(
            "dim",
            dim,
            f"MXFP4 needs dim divisible by an even block ({block})",
            "use dim = 128 and block = 32",
        )
    return _packed("indexer_mxfp4", [("values_e2m1", dim // 2), ("scales_ue8m0", dim // block)])


def indexer_fp8(dim: int = 128) -> RowFormat:
    """Lightning-indexer key in FP8 e4m3 with one fp32 scale: ``dim + 4`` bytes (132 for 128)."""
    check_positive_int("dim", dim)
    return _packed("indexer_fp8", [("values_fp8", dim), ("scale_fp32", 4)])


def compressor_state(dim: int, overlap: bool) -> RowFormat:
    """fp32 compressor state of one raw token: its ``kv`` and ``score`` vectors.

    Shape ``(series, 2, dim)`` with ``series = 2`` when the compressor overlaps windows
    (ratio 4 keeps the current and the previous window's series) else 1; axis 1 is
    (kv, score). V4: ratio-4 attention 2*2*512*4 = 8192 B, ratio-4 indexer 2*2*128*4 = 2048 B,
    ratio 128 1*2*512*4 = 4096 B.
    """
    check_positive_int("dim", dim)
    if not isinstance(overlap, bool):
        fail(
            "overlap", overlap, "it must be a bool", "pass overlap=True for ratio 4", exc=TypeError
        )
    return RowFormat(name="compressor_state", dtype="float32", shape=(2 if overlap else 1, 2, dim))


def plain(dim: int | tuple[int, ...], dtype: str = "bfloat16") -> RowFormat:
    """A plain row of ``dim`` values of ``dtype`` (bf16/fp32 rows for experiments and tests)."""
    shape = (dim,) if isinstance(dim, int) else tuple(dim)
    return RowFormat(name=f"plain_{dtype}", dtype=dtype, shape=shape)
