"""Model config: the cache-facing :class:`DeepSeekV4Config` plus the dims only the model needs.

The cache side (layers, ratios, window, head dims, row formats) comes from the recipe config,
so the model and the cache plan can never disagree about geometry; the model adds hidden
size, heads, vocab and MLP size.
"""

from __future__ import annotations

import dataclasses

from flatkv_jax.errors import check_positive_int, fail
from flatkv_jax.recipes.deepseek_v4 import DeepSeekV4Config, tiny_v4, v4_flash

MATMUL_PRECISIONS = ("highest", "float32", "high", "tensorfloat32", "default", "bfloat16")
"""The names :attr:`ModelConfig.matmul_precision` takes (``jax.default_matmul_precision``'s)."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A DeepSeek-V4-shaped model (frozen, hashable: usable as a jit static argument).

    Attributes:
      cache: the recipe config (layers and their compression ratios, window, head dims,
        indexer dims and top-k, row formats).
      hidden: residual stream width.
      num_heads: query heads; every head attends to the one shared K=V latent.
      vocab: vocabulary size.
      mlp_hidden: SwiGLU inner width.
      index_heads: lightning-indexer query heads.
      rope_theta: RoPE base.
      eps: RMS-norm epsilon.
      matmul_precision: the precision of every matrix product of the model, a name that
        ``jax.default_matmul_precision`` takes (one of :data:`MATMUL_PRECISIONS`). The default
        ``"highest"`` is full fp32 on every backend: the GPU default (``"default"``) rounds
        fp32 operands to TF32 on Ampere and newer, which on the H200 moved the demo's cached
        vs dense logits apart by 1.3e-1, far over the 1e-5 parity bound, because the cached and
        dense paths multiply in different orders. Lower it only for speed, never in parity
        checks.
    """

    cache: DeepSeekV4Config
    hidden: int = 64
    num_heads: int = 2
    vocab: int = 64
    mlp_hidden: int = 128
    index_heads: int = 2
    rope_theta: float = 10000.0
    eps: float = 1e-6
    matmul_precision: str = "highest"

    def __post_init__(self):
        if not isinstance(self.cache, DeepSeekV4Config):
            fail(
                "cache",
                self.cache,
                "it must be a DeepSeekV4Config",
                "build it with tiny_v4() or v4_flash()",
                exc=TypeError,
            )
        for name in ("hidden", "num_heads", "vocab", "mlp_hidden", "index_heads"):
            check_positive_int(name, getattr(self, name))
        if self.cache.num_mtp_layers > 1:
            fail(
                "num_mtp_layers",
                self.cache.num_mtp_layers,
                "the reference model has at most one MTP draft layer (as V4 does)",
                "use num_mtp_layers=0 or 1",
            )
        if self.cache.rope_dim % 2 or self.index_rope_dim % 2:
            fail(
                "rope_dim",
                self.cache.rope_dim,
                "RoPE rotates pairs, so it must be even",
                "use an even rope_dim",
            )
        if not isinstance(self.eps, float) or not self.eps > 0:
            fail("eps", self.eps, "it must be a positive float", "use eps=1e-6")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            fail(
                "matmul_precision",
                self.matmul_precision,
                f"it must be one of {', '.join(MATMUL_PRECISIONS)}",
                'use "highest" (full fp32 on every backend) unless speed matters more than parity',
            )

    # --- derived geometry ------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        """Target layers (the MTP layer excluded)."""
        return self.cache.num_layers

    @property
    def head_dim(self) -> int:
        return self.cache.head_dim

    @property
    def rope_dim(self) -> int:
        return self.cache.rope_dim

    @property
    def nope_dim(self) -> int:
        return self.cache.head_dim - self.cache.rope_dim

    @property
    def index_head_dim(self) -> int:
        return self.cache.index_head_dim

    @property
    def index_rope_dim(self) -> int:
        """RoPE dims of an indexer key/query: ``rope_dim``, at most half the indexer head."""
        return min(self.cache.rope_dim, self.cache.index_head_dim // 2)

    @property
    def window(self) -> int:
        return self.cache.window

    @property
    def has_mtp(self) -> bool:
        return self.cache.num_mtp_layers == 1

    def ratio(self, layer: int) -> int:
        """Compression ratio of target layer ``layer`` (0 = window only)."""
        return self.cache.compress_ratios[layer]

    def is_csa(self, layer: int) -> bool:
        """Whether ``layer`` is a CSA layer (overlapping compressor + indexer + top-k)."""
        return self.ratio(layer) == self.cache.csa_ratio


def tiny_model(
    *,
    num_layers: int = 4,
    window: int = 8,
    ratios: tuple[int, int] = (4, 16),
    head_dim: int = 64,
    rope_dim: int = 16,
    index_head_dim: int = 32,
    index_topk: int = 4,
    kv_format: str = "fp32",
    indexer_format: str = "fp32",
    rows_per_page: int = 4,
    num_mtp_layers: int = 1,
    hidden: int = 64,
    num_heads: int = 2,
    vocab: int = 64,
    mlp_hidden: int = 128,
    index_heads: int = 2,
) -> ModelConfig:
    """A tiny V4 for CPU tests: layer 0 window-only, then CSA / HCA alternating, one MTP layer.

    The quantized formats need ``head_dim - rope_dim`` to be a multiple of 64 (fp8_ds_mla) and
    ``index_head_dim`` a multiple of 32 (MXFP4): e.g. ``head_dim=80, rope_dim=16``.
    """
    cache = tiny_v4(
        num_layers=num_layers,
        window=window,
        ratios=ratios,
        head_dim=head_dim,
        rope_dim=rope_dim,
        index_head_dim=index_head_dim,
        index_topk=index_topk,
        num_mtp_layers=num_mtp_layers,
        kv_format=kv_format,
        indexer_format=indexer_format,
        rows_per_page=rows_per_page,
    )
    return ModelConfig(
        cache=cache,
        hidden=hidden,
        num_heads=num_heads,
        vocab=vocab,
        mlp_hidden=mlp_hidden,
        index_heads=index_heads,
    )


def v4_flash_model(**cache_overrides) -> ModelConfig:
    """DeepSeek-V4-Flash geometry (for shapes, plans and benchmarks; weights are random).

    Hidden 4096, 64 query heads of 512 dims, vocab 129280, indexer 64 heads x 128 dims.
    """
    return ModelConfig(
        cache=v4_flash(**cache_overrides),
        hidden=4096,
        num_heads=64,
        vocab=129280,
        mlp_hidden=2048,
        index_heads=64,
    )
