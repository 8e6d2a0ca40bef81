"""The model's math, shared by the dense reference and the cached step.

Both paths call these functions on the same fp32 values; they differ only in where the rows
come from (computed for the whole sequence vs gathered from the pools). All arrays are fp32;
``N`` is a batch of query tokens, ``E``/``K``/``M`` a per-query axis of cached entries.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from flatkv_jax.model.config import ModelConfig
from flatkv_jax.model.params import CompressorParams, IndexerParams, LayerParams, MTPParams


def lead(a: jax.Array, ndim: int) -> jax.Array:
    """``a`` with leading unit axes up to ``ndim`` (explicit broadcasting: rank promotion is off)."""
    return a.reshape((1,) * (ndim - a.ndim) + a.shape)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMS norm over the last axis, times ``w`` (``[..., dim]``)."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * lead(w, x.ndim)


def rope(x: jax.Array, pos: jax.Array, theta: float) -> jax.Array:
    """Rotates consecutive pairs of the last axis of ``x`` by ``pos * theta**(-2i/dim)``.

    Args:
      x: ``[..., dim]`` (dim even).
      pos: int32 with shape ``x.shape[:-1]``.
    """
    dim = x.shape[-1]
    inv = theta ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    ang = pos.astype(jnp.float32)[..., None] * lead(inv, pos.ndim + 1)
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)


def rope_tail(x: jax.Array, pos: jax.Array, rope_dim: int, theta: float) -> jax.Array:
    """RoPE on the last ``rope_dim`` dims of ``x`` (the no-RoPE head stays as it is)."""
    nope = x.shape[-1] - rope_dim
    return jnp.concatenate([x[..., :nope], rope(x[..., nope:], pos, theta)], axis=-1)


def masked_softmax(s: jax.Array, valid: jax.Array, axis: int) -> jax.Array:
    """Softmax of ``s`` over ``axis`` restricted to ``valid`` entries (all-invalid -> zeros)."""
    m = jnp.max(jnp.where(valid, s, -jnp.inf), axis=axis, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(valid, jnp.exp(s - m), 0.0)
    return e / jnp.maximum(jnp.sum(e, axis=axis, keepdims=True), jnp.finfo(jnp.float32).tiny)


# --- attention ------------------------------------------------------------------------------
def project_qkv(lp: LayerParams, x: jax.Array, pos: jax.Array, cfg: ModelConfig):
    """Queries and the shared K=V latent of tokens ``x`` at positions ``pos``.

    Returns:
      ``(x_norm [N, hidden], q [N, heads, head_dim], kv [N, head_dim])``; RoPE is applied to
      the last ``rope_dim`` dims of ``q`` and ``kv`` at the token's position. ``kv`` is the
      row the cache stores (before quantization).
    """
    xn = rms_norm(x, lp.attn_norm, cfg.eps)
    n = x.shape[0]
    q = (xn @ lp.wq).reshape(n, cfg.num_heads, cfg.head_dim)
    q = rope_tail(q, jnp.broadcast_to(pos[:, None], q.shape[:-1]), cfg.rope_dim, cfg.rope_theta)
    kv = rms_norm(xn @ lp.wkv, lp.kv_norm, cfg.eps)
    kv = rope_tail(kv, pos, cfg.rope_dim, cfg.rope_theta)
    return xn, q, kv


def attend(q: jax.Array, keys: jax.Array, mask: jax.Array, sink: jax.Array) -> jax.Array:
    """Shared K=V attention with an attention sink.

    Args:
      q: ``[N, heads, d]``.
      keys: ``[N, K, d]`` per-query keys, which are also the values.
      mask: bool ``[N, K]``.
      sink: ``[heads]`` sink logits (a key whose value is 0: it only adds to the denominator).

    Returns:
      ``[N, heads, d]``.
    """
    s = jnp.einsum("nhd,nkd->nhk", q, keys) / math.sqrt(q.shape[-1])
    valid = jnp.broadcast_to(mask[:, None, :], s.shape)
    sink_b = jnp.broadcast_to(sink[None, :, None], (s.shape[0], s.shape[1], 1))
    m = jnp.maximum(jnp.max(jnp.where(valid, s, -jnp.inf), axis=-1, keepdims=True), sink_b)
    p = jnp.where(valid, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sink_b - m)
    return jnp.einsum("nhk,nkd->nhd", p, keys) / denom


def finish_layer(lp: LayerParams, x: jax.Array, attn: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Output projection + residual, then the SwiGLU MLP + residual."""
    x = x + attn.reshape(x.shape[0], -1) @ lp.wo
    h = rms_norm(x, lp.mlp_norm, cfg.eps)
    return x + (jax.nn.silu(h @ lp.w_gate) * (h @ lp.w_up)) @ lp.w_down


# --- compressor -----------------------------------------------------------------------------
def compressor_state(cp: CompressorParams, xn: jax.Array, pos: jax.Array) -> jax.Array:
    """Per-token compressor state: ``float32[N, series, 2, dim]`` (axis 2 = kv, score).

    The score already includes the positional bias ``ape[series, pos % ratio]``, so a state
    row is self-contained (what the ``c*_state`` pools store).
    """
    series, ratio, dim = cp.ape.shape
    n = xn.shape[0]
    kv = (xn @ cp.wkv).reshape(n, series, dim)
    bias = jnp.swapaxes(cp.ape[:, pos % ratio], 0, 1)
    score = (xn @ cp.wgate).reshape(n, series, dim) + bias
    return jnp.stack([kv, score], axis=2)


def compress_window(
    cp: CompressorParams,
    window: jax.Array,
    valid: jax.Array,
    row_index: jax.Array,
    rope_dim: int,
    cfg: ModelConfig,
) -> jax.Array:
    """Compressed rows from the state rows of their windows.

    Args:
      cp: the compressor.
      window: ``[N, E, series, 2, dim]`` state rows of the raw positions
        ``(j+1)*ratio - E .. (j+1)*ratio - 1``, oldest first; ``E = 2 * ratio`` with overlap
        (the previous window contributes series 0, the row's own window the last series),
        else ``E = ratio``.
      valid: bool ``[N, E]`` (positions before 0 are invalid).
      row_index: int32 ``[N]``, the compressed index ``j``.
      rope_dim: RoPE dims of the row.
      cfg: model config (eps, rope base).

    Returns:
      ``[N, dim]``: softmax(score)-weighted sum of ``kv`` per channel, RMS-normed, RoPE'd at
      position ``j * ratio``.
    """
    series, ratio, _ = cp.ape.shape
    e = window.shape[1]
    older = (jnp.arange(e) < e - ratio)[None, :, None, None]
    picked = jnp.where(older, window[:, :, 0], window[:, :, series - 1])
    kv, score = picked[:, :, 0], picked[:, :, 1]
    w = masked_softmax(score, valid[:, :, None], axis=1)
    row = rms_norm(jnp.sum(w * kv, axis=1), cp.norm, cfg.eps)
    return rope_tail(row, row_index * ratio, rope_dim, cfg.rope_theta)


def window_span(cp: CompressorParams) -> int:
    """Raw tokens one compressed row reads: ``2 * ratio`` with overlap, else ``ratio``."""
    series, ratio, _ = cp.ape.shape
    return series * ratio


# --- lightning indexer ----------------------------------------------------------------------
def index_queries(ip: IndexerParams, xn: jax.Array, pos: jax.Array, cfg: ModelConfig):
    """Indexer queries ``[N, index_heads, index_head_dim]`` (RoPE'd) and head weights ``[N, heads]``."""
    n = xn.shape[0]
    q = (xn @ ip.wq).reshape(n, cfg.index_heads, cfg.index_head_dim)
    q = rope_tail(
        q, jnp.broadcast_to(pos[:, None], q.shape[:-1]), cfg.index_rope_dim, cfg.rope_theta
    )
    return q, xn @ ip.wweights


def index_scores(q: jax.Array, w: jax.Array, keys: jax.Array) -> jax.Array:
    """``score[n, m] = sum_h w[n, h] * relu(q[n, h] . keys[n, m]) / sqrt(d)`` -> ``[N, M]``."""
    s = jax.nn.relu(jnp.einsum("nhd,nmd->nhm", q, keys)) / math.sqrt(q.shape[-1])
    return jnp.einsum("nhm,nh->nm", s, w)


def top_k_rows(scores: jax.Array, visible: jax.Array, k: int):
    """The ``k`` best visible rows per query: ``(index int32[N, k'], ok bool[N, k'])``, ``k' = min(k, M)``.

    When fewer than ``k`` rows are visible, the extra picks are invalid (``ok`` False).
    """
    kk = min(k, scores.shape[1])
    _, idx = jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), kk)
    return idx.astype(jnp.int32), jnp.take_along_axis(visible, idx, axis=1)


# --- heads ----------------------------------------------------------------------------------
def logits_of(params_head: jax.Array, norm: jax.Array, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """``rms_norm(x) @ head`` -> ``[N, vocab]``."""
    return rms_norm(x, norm, cfg.eps) @ params_head


def mtp_input(
    mp: MTPParams, tok_emb: jax.Array, prev_hidden: jax.Array, cfg: ModelConfig
) -> jax.Array:
    """The MTP layer's input at position ``q``: mixes ``embed(t_q)`` and the hidden of ``q - 1``."""
    e = rms_norm(tok_emb, mp.enorm, cfg.eps)
    h = rms_norm(prev_hidden, mp.hnorm, cfg.eps)
    return jnp.concatenate([e, h], axis=-1) @ mp.proj
