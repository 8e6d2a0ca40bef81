"""Model parameters: pure pytrees of fp32 arrays, initialised at random from a seed.

Layers differ by kind (window-only, CSA, HCA), so the layer list is a tuple of
:class:`LayerParams` whose optional parts are ``None`` where a layer kind has no such part.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from flatkv_jax.errors import check_nonnegative_int
from flatkv_jax.model.config import ModelConfig


def _dataclass(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_dataclass
class CompressorParams:
    """A compressor: per raw token a ``kv`` and a ``score`` vector per series.

    Attributes:
      wkv: ``[hidden, series * dim]``; series 0 is the token's contribution to the *next*
        window's row (overlap only), the last series to its own window's row.
      wgate: ``[hidden, series * dim]`` score projection.
      ape: ``[series, ratio, dim]`` positional bias added to the score by position in window.
      norm: ``[dim]`` RMS-norm weight of the compressed row.
    """

    wkv: jax.Array
    wgate: jax.Array
    ape: jax.Array
    norm: jax.Array


@_dataclass
class IndexerParams:
    """Lightning indexer of a CSA layer.

    Attributes:
      wq: ``[hidden, index_heads * index_head_dim]`` query projection.
      wweights: ``[hidden, index_heads]`` per-head weights of the index score.
      compressor: the indexer's own ratio-``csa_ratio`` overlapping compressor (index keys).
    """

    wq: jax.Array
    wweights: jax.Array
    compressor: CompressorParams


@_dataclass
class LayerParams:
    """One transformer layer (target or MTP).

    Attributes:
      attn_norm, mlp_norm: ``[hidden]`` RMS-norm weights.
      wq: ``[hidden, heads * head_dim]``.
      wkv: ``[hidden, head_dim]`` the shared K=V latent.
      kv_norm: ``[head_dim]``.
      wo: ``[heads * head_dim, hidden]``.
      sink: ``[heads]`` attention-sink logits (a key with value 0).
      w_gate, w_up: ``[hidden, mlp_hidden]``; w_down: ``[mlp_hidden, hidden]`` (SwiGLU).
      compressor: CSA / HCA layers: the KV compressor; ``None`` on window-only layers.
      indexer: CSA layers: the lightning indexer; else ``None``.
    """

    attn_norm: jax.Array
    wq: jax.Array
    wkv: jax.Array
    kv_norm: jax.Array
    wo: jax.Array
    sink: jax.Array
    mlp_norm: jax.Array
    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array
    compressor: CompressorParams | None
    indexer: IndexerParams | None


@_dataclass
class MTPParams:
    """The MTP draft layer: mixes the previous target hidden state with the token embedding.

    Attributes:
      enorm, hnorm: ``[hidden]`` norms of the embedding and of the incoming hidden state.
      proj: ``[2 * hidden, hidden]``.
      layer: a window-only layer (its KV lives in the draft group ``mtp_swa_kv``).
      final_norm: ``[hidden]``.
    """

    enorm: jax.Array
    hnorm: jax.Array
    proj: jax.Array
    layer: LayerParams
    final_norm: jax.Array


@_dataclass
class Params:
    """All model parameters.

    Attributes:
      embed: ``[vocab, hidden]``.
      layers: one :class:`LayerParams` per target layer.
      final_norm: ``[hidden]``.
      head: ``[hidden, vocab]`` (shared by the MTP layer).
      mtp: the draft layer, or ``None``.
    """

    embed: jax.Array
    layers: tuple[LayerParams, ...]
    final_norm: jax.Array
    head: jax.Array
    mtp: MTPParams | None


class _Normal:
    """Draws ``offset + scale * N(0, 1)`` arrays from one NumPy generator, in a fixed order.

    NumPy keeps init cheap on CPU (``jax.random`` compiles one kernel per parameter shape); with
    ``shapes_only`` it returns ``jax.ShapeDtypeStruct`` leaves, so any geometry (V4-Flash
    included) can be described without allocating it.
    """

    def __init__(self, seed: int, shapes_only: bool = False):
        self.rng = np.random.default_rng(seed)
        self.shapes_only = shapes_only

    def __call__(self, shape: tuple[int, ...], scale: float = 1.0, offset: float = 0.0):
        if self.shapes_only:
            return jax.ShapeDtypeStruct(shape, jnp.float32)
        x = offset + scale * self.rng.standard_normal(shape, dtype=np.float32)
        return jnp.asarray(x, jnp.float32)


def _dense(normal: _Normal, fan_in: int, fan_out: int):
    return normal((fan_in, fan_out), 1.0 / math.sqrt(fan_in))


def _norm(normal: _Normal, dim: int):
    # Not all ones, so a norm applied on the wrong side shows up in the parity tests.
    return normal((dim,), 0.1, 1.0)


def _compressor(
    normal: _Normal, cfg: ModelConfig, ratio: int, dim: int, overlap: bool
) -> CompressorParams:
    series = 2 if overlap else 1
    return CompressorParams(
        wkv=_dense(normal, cfg.hidden, series * dim),
        wgate=_dense(normal, cfg.hidden, series * dim),
        ape=normal((series, ratio, dim), 0.5),
        norm=_norm(normal, dim),
    )


def _layer(normal: _Normal, cfg: ModelConfig, ratio: int) -> LayerParams:
    d, h, hd, f = cfg.hidden, cfg.num_heads, cfg.head_dim, cfg.mlp_hidden
    csa = ratio == cfg.cache.csa_ratio
    compressor = _compressor(normal, cfg, ratio, hd, overlap=csa) if ratio else None
    indexer = None
    if csa:
        indexer = IndexerParams(
            wq=_dense(normal, d, cfg.index_heads * cfg.index_head_dim),
            wweights=_dense(normal, d, cfg.index_heads),
            compressor=_compressor(normal, cfg, ratio, cfg.index_head_dim, overlap=True),
        )
    return LayerParams(
        attn_norm=_norm(normal, d),
        wq=_dense(normal, d, h * hd),
        wkv=_dense(normal, d, hd),
        kv_norm=_norm(normal, hd),
        wo=_dense(normal, h * hd, d),
        sink=normal((h,)),
        mlp_norm=_norm(normal, d),
        w_gate=_dense(normal, d, f),
        w_up=_dense(normal, d, f),
        w_down=_dense(normal, f, d),
        compressor=compressor,
        indexer=indexer,
    )


def _init(cfg: ModelConfig, normal: _Normal) -> Params:
    layers = tuple(_layer(normal, cfg, cfg.ratio(i)) for i in range(cfg.num_layers))
    mtp = None
    if cfg.has_mtp:
        mtp = MTPParams(
            enorm=_norm(normal, cfg.hidden),
            hnorm=_norm(normal, cfg.hidden),
            proj=_dense(normal, 2 * cfg.hidden, cfg.hidden),
            layer=_layer(normal, cfg, 0),
            final_norm=_norm(normal, cfg.hidden),
        )
    return Params(
        embed=normal((cfg.vocab, cfg.hidden)),
        layers=layers,
        final_norm=_norm(normal, cfg.hidden),
        head=_dense(normal, cfg.hidden, cfg.vocab),
        mtp=mtp,
    )


def init_params(cfg: ModelConfig, seed: int) -> Params:
    """Random parameters of ``cfg`` from an integer seed (deterministic).

    Args:
      cfg: the model config.
      seed: a non-negative Python int.

    Returns:
      A :class:`Params` pytree of fp32 arrays.
    """
    check_nonnegative_int("seed", seed)
    return _init(cfg, _Normal(seed))


def param_shapes(cfg: ModelConfig) -> Params:
    """``jax.ShapeDtypeStruct`` leaves of :func:`init_params` (no memory; any geometry)."""
    return _init(cfg, _Normal(0, shapes_only=True))


class _Flat:
    """Hands out ``offset + scale * x`` from consecutive slices of one flat N(0, 1) draw, in
    :func:`_init`'s order (NumPy when the draw is concrete, jnp under a trace)."""

    shapes_only = False

    def __init__(self, flat):
        self.flat = flat
        self.used = 0

    def __call__(self, shape: tuple[int, ...], scale: float = 1.0, offset: float = 0.0):
        n = math.prod(shape)
        x = self.flat[self.used : self.used + n].reshape(shape)
        self.used += n
        if isinstance(x, np.ndarray):
            return jnp.asarray(offset + scale * x, jnp.float32)
        return offset + scale * x


def param_count(cfg: ModelConfig) -> int:
    """Number of fp32 weights of ``cfg``."""
    return sum(math.prod(a.shape) for a in jax.tree.leaves(param_shapes(cfg)))


@functools.partial(jax.jit, static_argnums=0)
def _flat_normal(n: int, key: jax.Array) -> jax.Array:
    return jax.random.normal(key, (n,), jnp.float32)


def random_params(cfg: ModelConfig, key: jax.Array) -> Params:
    """Random parameters of ``cfg`` from a JAX PRNG key (deterministic; the same scales as
    :func:`init_params`, other values).

    One ``jax.random.normal`` draw covers every weight and is sliced in a fixed order, so the
    tiny model initialises with one small compilation on CPU (one draw per weight would
    compile a threefry kernel per shape). Under a trace (``jax.eval_shape``, ``nnx.eval_shape``,
    ``jax.jit``) nothing is materialised on the host.

    Args:
      cfg: the model config.
      key: a PRNG key, e.g. ``nnx.Rngs(0).params()``.
    """
    flat = _flat_normal(param_count(cfg), key)
    if not isinstance(flat, jax.core.Tracer):
        flat = np.asarray(flat)
    return _init(cfg, _Flat(flat))
