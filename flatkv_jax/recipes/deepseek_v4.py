"""DeepSeek V4 recipe: turn a V4 model config into cache groups.

This is the only place that knows what CSA (ratio 4), HCA (ratio 128), the lightning indexer
and the MTP draft layer need; the core sees generic groups only.

Groups (created only when some layer needs them):

========================  =========  ===============================  =====================
group                     retention  rows/page x tokens/row            layers
========================  =========  ===============================  =====================
``swa_kv``                window W   ``swa_rows`` x 1                  every target layer
``mtp_swa_kv`` (draft)    window W   ``swa_rows`` x 1                  the MTP layer(s)
``c4_kv`` (+index_key)    history    ``c4_rows`` x 4                   ratio-4 layers
``c128_kv``               history    ``c128_rows`` x 128               ratio-128 layers
``c4_state``              window     ``state4_rows`` x 1               ratio-4 layers
``c4_index_state``        window     ``state4_rows`` x 1               ratio-4 layers
``c128_state``            window     ``state128_rows`` x 1             ratio-128 layers
========================  =========  ===============================  =====================

The ratio-4 compressor state window is ``max(2 * 4, 4 + verify_width)`` (overlap keeps two
windows, and a verify block must fit), rounded up to whole pages; the ratio-r state window
for r > 4 is ``r``, also covering the verify block. A compressed row begins at every multiple
of its ratio, so the state groups have ``period = ratio`` and ``carry`` = the overlap (4 for
CSA, 0 for HCA): a prefix hit (a multiple of 128) needs one 4-token block of ratio-4 state and
no ratio-128 state (``GroupSpec.hit_reach``).
"""

from __future__ import annotations

import dataclasses

from flatkv_jax import formats
from flatkv_jax.errors import check_nonnegative_int, check_positive_int, fail
from flatkv_jax.groups import FieldSpec, GroupSpec, Owner, Retention

KV_FORMATS = ("fp8_ds_mla", "bf16", "fp32")
INDEXER_FORMATS = ("mxfp4", "fp8", "bf16", "fp32")


@dataclasses.dataclass(frozen=True)
class DeepSeekV4Config:
    """The config values the cache depends on (names follow the released ``config.json``).

    Attributes:
      compress_ratios: per target layer, 0 (window only), the CSA ratio or the HCA ratio.
      num_mtp_layers: MTP (draft) layers; each is window-only and owned by the draft model.
      head_dim: latent KV head dim (shared K=V), ``nope + rope``.
      rope_dim: RoPE part of ``head_dim``.
      window: sliding window in tokens (every layer, MTP included).
      index_head_dim: lightning-indexer key dim.
      index_topk: compressed rows each query selects on CSA layers.
      csa_ratio: the ratio whose compressor overlaps windows and feeds the indexer (4).
      kv_format: ``"fp8_ds_mla"``, ``"bf16"`` or ``"fp32"``.
      indexer_format: ``"mxfp4"``, ``"fp8"``, ``"bf16"`` or ``"fp32"``.
      swa_rows, c4_rows, c128_rows, state4_rows, state128_rows: rows per page of each group
        (``c4_rows`` applies to every CSA ratio, ``c128_rows`` to every other ratio). The
        defaults make every block span at most 128 tokens (``c4_rows=32`` x 4,
        ``c128_rows=1`` x 128), so prefix hits come in 128-token steps
        (``plan.prefix_granularity``); ``c4_rows=64, c128_rows=2`` gives 256-token pages and
        256-token hits (vLLM's DeepSeek-V4 layout).
    """

    compress_ratios: tuple[int, ...]
    num_mtp_layers: int = 1
    head_dim: int = 512
    rope_dim: int = 64
    window: int = 128
    index_head_dim: int = 128
    index_topk: int = 512
    csa_ratio: int = 4
    kv_format: str = "fp8_ds_mla"
    indexer_format: str = "mxfp4"
    swa_rows: int = 64
    c4_rows: int = 32
    c128_rows: int = 1
    state4_rows: int = 4
    state128_rows: int = 8

    def __post_init__(self):
        if not isinstance(self.compress_ratios, tuple) or not self.compress_ratios:
            fail(
                "compress_ratios",
                self.compress_ratios,
                "a non-empty tuple of per-layer ratios",
                "pass e.g. (0, 0, 4, 128)",
            )
        for r in self.compress_ratios:
            check_nonnegative_int("compress_ratios entry", r)
        check_nonnegative_int("num_mtp_layers", self.num_mtp_layers)
        for name in ("head_dim", "rope_dim", "window", "index_head_dim", "index_topk", "csa_ratio",
                     "swa_rows", "c4_rows", "c128_rows", "state4_rows", "state128_rows"):  # fmt: skip
            check_positive_int(name, getattr(self, name))
        if self.rope_dim >= self.head_dim:
            fail(
                "rope_dim",
                self.rope_dim,
                f"must be smaller than head_dim={self.head_dim}",
                "use rope_dim=64, head_dim=512",
            )
        if self.kv_format not in KV_FORMATS:
            fail("kv_format", self.kv_format, f"one of {KV_FORMATS}", "pick a listed format")
        if self.indexer_format not in INDEXER_FORMATS:
            fail(
                "indexer_format",
                self.indexer_format,
                f"one of {INDEXER_FORMATS}",
                "pick a listed format",
            )

    @property
    def num_layers(self) -> int:
        """Target layers (MTP excluded)."""
        return len(self.compress_ratios)

    @property
    def mtp_layers(self) -> tuple[int, ...]:
        """Layer indices of the MTP layers (numbered after the target layers)."""
        return tuple(range(self.num_layers, self.num_layers + self.num_mtp_layers))

    def layers_with_ratio(self, ratio: int) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.compress_ratios) if r == ratio)

    @property
    def ratios(self) -> tuple[int, ...]:
        """Distinct non-zero compression ratios, ascending."""
        return tuple(sorted({r for r in self.compress_ratios if r}))


def v4_flash(**overrides) -> DeepSeekV4Config:
    """DeepSeek-V4-Flash: 43 layers ``[0, 0] + [4, 128] * 20 + [4]`` + 1 MTP, index top-512."""
    kw = dict(compress_ratios=(0, 0, *((4, 128) * 20), 4), num_mtp_layers=1, index_topk=512)
    return DeepSeekV4Config(**{**kw, **overrides})


def v4_pro(**overrides) -> DeepSeekV4Config:
    """DeepSeek-V4-Pro: 61 layers ``[128, 128] + [4, 128] * 29 + [4]`` + 1 MTP, index top-1024."""
    kw = dict(compress_ratios=(128, 128, *((4, 128) * 29), 4), num_mtp_layers=1, index_topk=1024)
    return DeepSeekV4Config(**{**kw, **overrides})


def tiny_v4(
    *,
    num_layers: int = 4,
    window: int = 8,
    ratios: tuple[int, int] = (4, 16),
    head_dim: int = 64,
    rope_dim: int = 16,
    index_head_dim: int = 32,
    index_topk: int = 8,
    num_mtp_layers: int = 1,
    kv_format: str = "fp32",
    indexer_format: str = "fp32",
    rows_per_page: int = 4,
) -> DeepSeekV4Config:
    """A small V4 for tests: layer 0 window-only, then CSA/HCA alternating.

    Args:
      num_layers: target layers (>= 1).
      window: sliding window in tokens.
      ratios: (CSA ratio, HCA ratio).
      head_dim, rope_dim, index_head_dim, index_topk: small model dims.
      num_mtp_layers: draft layers.
      kv_format, indexer_format: row formats (fp32 rows give exact parity).
      rows_per_page: rows per page of every group (windows must stay whole pages).
    """
    check_positive_int("num_layers", num_layers)
    csa, hca = ratios
    layer_ratios = tuple(0 if i == 0 else (csa if i % 2 else hca) for i in range(num_layers))
    return DeepSeekV4Config(
        compress_ratios=layer_ratios,
        num_mtp_layers=num_mtp_layers,
        head_dim=head_dim,
        rope_dim=rope_dim,
        window=window,
        index_head_dim=index_head_dim,
        index_topk=index_topk,
        csa_ratio=csa,
        kv_format=kv_format,
        indexer_format=indexer_format,
        swa_rows=rows_per_page,
        c4_rows=rows_per_page,
        c128_rows=max(1, rows_per_page // 4),
        state4_rows=rows_per_page,
        state128_rows=rows_per_page,
    )


PRESETS = {"v4-flash": v4_flash, "v4-pro": v4_pro, "tiny-v4": tiny_v4}


def kv_row_format(cfg: DeepSeekV4Config) -> formats.RowFormat:
    if cfg.kv_format == "fp8_ds_mla":
        return formats.fp8_ds_mla(nope_dim=cfg.head_dim - cfg.rope_dim, rope_dim=cfg.rope_dim)
    return formats.plain(cfg.head_dim, "bfloat16" if cfg.kv_format == "bf16" else "float32")


def indexer_row_format(cfg: DeepSeekV4Config) -> formats.RowFormat:
    if cfg.indexer_format == "mxfp4":
        return formats.indexer_mxfp4(cfg.index_head_dim)
    if cfg.indexer_format == "fp8":
        return formats.indexer_fp8(cfg.index_head_dim)
    return formats.plain(
        cfg.index_head_dim, "bfloat16" if cfg.indexer_format == "bf16" else "float32"
    )


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def state_window(cfg: DeepSeekV4Config, ratio: int, verify_width: int, rows_per_page: int) -> int:
    """Raw-token window of a ratio's compressor state, in whole pages.

    Overlapping compressors (the CSA ratio) keep two windows, ``2 * ratio``; any compressor must
    also hold a verify block on top of the window it is filling: ``ratio + verify_width``.
    """
    overlap = ratio == cfg.csa_ratio
    need = max(2 * ratio if overlap else ratio, ratio + verify_width)
    return _round_up(need, rows_per_page)


def deepseek_v4_groups(cfg: DeepSeekV4Config, *, verify_width: int = 0) -> tuple[GroupSpec, ...]:
    """The cache groups of a DeepSeek-V4 model.

    Args:
      cfg: the model config (see :func:`v4_flash`, :func:`v4_pro`, :func:`tiny_v4`).
      verify_width: speculative tokens verified per step; sizes the compressor-state windows
        (recorded on those groups: a plan must use the same ``ServingLimits.verify_width``).

    Returns:
      Groups in a fixed order: swa_kv, mtp_swa_kv, then per ratio (ascending) its compressed KV
      group and its compressor-state group(s).
    """
    check_nonnegative_int("verify_width", verify_width)
    kv = FieldSpec("kv", kv_row_format(cfg))
    groups: list[GroupSpec] = []
    swa_window = _round_up(cfg.window, cfg.swa_rows)
    if swa_window != cfg.window:
        fail(
            "window",
            cfg.window,
            f"the sliding window must be covered by whole SWA pages of {cfg.swa_rows} tokens",
            f"use swa_rows that divides {cfg.window}",
        )
    groups.append(
        GroupSpec(
            "swa_kv",
            Retention.WINDOW,
            cfg.swa_rows,
            1,
            tuple(range(cfg.num_layers)),
            (kv,),
            window=cfg.window,
        )
    )
    if cfg.num_mtp_layers:
        groups.append(
            GroupSpec(
                "mtp_swa_kv",
                Retention.WINDOW,
                cfg.swa_rows,
                1,
                cfg.mtp_layers,
                (kv,),
                window=cfg.window,
                owner=Owner.DRAFT,
            )
        )
    for ratio in cfg.ratios:
        layers = cfg.layers_with_ratio(ratio)
        csa = ratio == cfg.csa_ratio
        tag = f"c{ratio}"
        if csa:
            fields = (kv, FieldSpec("index_key", indexer_row_format(cfg)))
            rows, state_rows = cfg.c4_rows, cfg.state4_rows
        else:
            fields = (kv,)
            rows, state_rows = cfg.c128_rows, cfg.state128_rows
        groups.append(GroupSpec(f"{tag}_kv", Retention.HISTORY, rows, ratio, layers, fields))
        win = state_window(cfg, ratio, verify_width, state_rows)
        # A compressed row begins at every multiple of the ratio: after such a boundary the
        # state is read back only as far as the overlap (the CSA compressor's previous
        # window), so a prefix hit there needs only that much state (period / carry).
        carry = ratio if csa else 0
        groups.append(
            GroupSpec(
                f"{tag}_state", Retention.WINDOW, state_rows, 1, layers,
                (FieldSpec("state", formats.compressor_state(cfg.head_dim, overlap=csa)),), window=win,
                verify_width=verify_width, period=ratio, carry=carry,
            )
        )  # fmt: skip
        if csa:
            groups.append(
                GroupSpec(
                    f"{tag}_index_state", Retention.WINDOW, state_rows, 1, layers,
                    (FieldSpec("state", formats.compressor_state(cfg.index_head_dim, overlap=True)),), window=win,
                    verify_width=verify_width, period=ratio, carry=carry,
                )
            )  # fmt: skip
    return tuple(groups)
