"""Row formats: byte sizes of the production formats and validation messages."""

import pytest

from flatkv_jax import formats


def test_fp8_ds_mla_is_584_bytes_with_named_segments():
    f = formats.fp8_ds_mla()
    assert f.nbytes == 584 and f.dtype == "uint8" and f.shape == (584,)
    assert [(s.name, s.offset, s.nbytes) for s in f.segments] == [
        ("nope_fp8", 0, 448),
        ("rope_bf16", 448, 128),
        ("scales_ue8m0", 576, 7),
        ("pad", 583, 1),
    ]


def test_indexer_formats():
    assert formats.indexer_mxfp4().nbytes == 68
    assert formats.indexer_mxfp4().segment("scales_ue8m0").nbytes == 4
    assert formats.indexer_fp8().nbytes == 132


@pytest.mark.parametrize(
    ("dim", "overlap", "nbytes"),
    [(512, True, 8192), (128, True, 2048), (512, False, 4096)],
)
def test_compressor_state_bytes(dim, overlap, nbytes):
    f = formats.compressor_state(dim, overlap)
    assert f.nbytes == nbytes and f.dtype == "float32"


def test_plain_rows():
    assert formats.plain(512).nbytes == 1024
    assert formats.plain(512, "float32").nbytes == 2048
    assert formats.plain((8, 64), "bfloat16").shape == (8, 64)


def test_small_fp8_layout_pads_to_alignment():
    f = formats.fp8_ds_mla(nope_dim=48, rope_dim=16, scale_block=16)
    assert f.nbytes == 88  # 48 + 32 + 3 = 83 -> padded to 88


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (
            lambda: formats.fp8_ds_mla(nope_dim=100),
            ValueError,
            r"nope_dim=100 is invalid: the fp8 part must be a whole number of 64-value scale blocks\. Fix: use a multiple of 64",
        ),
        (
            lambda: formats.fp8_ds_mla(rope_dim=0),
            ValueError,
            r"rope_dim=0 is invalid: it must be positive",
        ),
        (
            lambda: formats.indexer_mxfp4(dim=100),
            ValueError,
            r"dim=100 is invalid: MXFP4 needs dim divisible by an even block",
        ),
        (
            lambda: formats.plain(8, "float64"),
            TypeError,
            r"dtype='float64' is invalid: a row dtype must be one of",
        ),
        (lambda: formats.plain(0), ValueError, r"shape entry=0 is invalid: it must be positive"),
        (
            lambda: formats.compressor_state(8, overlap=1),
            TypeError,
            r"overlap=1 is invalid: it must be a bool",
        ),
        (lambda: formats.indexer_fp8(dim=1.5), TypeError, r"dim=1.5 is invalid: it must be an int"),
        (
            lambda: formats.fp8_ds_mla().segment("nope"),
            ValueError,
            r"segment='nope' is invalid: format 'fp8_ds_mla' has segments",
        ),
    ],
)
def test_format_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
