"""The model's math primitives, shared by the dense reference and the cached step.

The flax modules (:mod:`flatkv_jax.model.modules`) hold the weights and wire these functions
together once per layer kind; the dense and cached paths call the same module methods and
differ only in where the cached rows come from (computed for the whole sequence vs gathered
from the pools). Everything here takes plain arrays, all fp32; ``N`` is a batch of query
tokens, ``E``/``K``/``M`` a per-query axis of cached entries.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


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
      theta: the RoPE base.
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


def rope_heads(x: jax.Array, pos: jax.Array, rope_dim: int, theta: float) -> jax.Array:
    """:func:`rope_tail` of per-head vectors ``x [N, heads, dim]`` at token positions ``pos [N]``."""
    return rope_tail(x, jnp.broadcast_to(pos[:, None], x.shape[:-1]), rope_dim, theta)


def masked_softmax(s: jax.Array, valid: jax.Array, axis: int) -> jax.Array:
    """Softmax of ``s`` over ``axis`` restricted to ``valid`` entries (all-invalid -> zeros)."""
    m = jnp.max(jnp.where(valid, s, -jnp.inf), axis=axis, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(valid, jnp.exp(s - m), 0.0)
    return e / jnp.maximum(jnp.sum(e, axis=axis, keepdims=True), jnp.finfo(jnp.float32).tiny)


# --- attention ------------------------------------------------------------------------------
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


def swiglu(h: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """``(silu(h @ w_gate) * (h @ w_up)) @ w_down``."""
    return (jax.nn.silu(h @ w_gate) * (h @ w_up)) @ w_down


# --- compressor -----------------------------------------------------------------------------
def compressor_state(
    wkv: jax.Array, wgate: jax.Array, ape: jax.Array, xn: jax.Array, pos: jax.Array
) -> jax.Array:
    """Per-token compressor state: ``float32[N, series, 2, dim]`` (axis 2 = kv, score).

    The score already includes the positional bias ``ape[series, pos % ratio]``, so a state
    row is self-contained (what the ``c*_state`` pools store).

    Args:
      wkv, wgate: ``[hidden, series * dim]`` projections.
      ape: ``[series, ratio, dim]`` positional bias.
      xn: ``[N, hidden]`` normed inputs.
      pos: int32 ``[N]`` positions.
    """
    series, ratio, dim = ape.shape
    n = xn.shape[0]
    kv = (xn @ wkv).reshape(n, series, dim)
    bias = jnp.swapaxes(ape[:, pos % ratio], 0, 1)
    score = (xn @ wgate).reshape(n, series, dim) + bias
    return jnp.stack([kv, score], axis=2)


def compress_window(window: jax.Array, valid: jax.Array, ratio: int) -> jax.Array:
    """Pooled compressed rows (before the row's norm and RoPE) from their windows' state rows.

    Args:
      window: ``[N, E, series, 2, dim]`` state rows of the raw positions
        ``(j+1)*ratio - E .. (j+1)*ratio - 1``, oldest first; ``E = 2 * ratio`` with overlap
        (the previous window contributes series 0, the row's own window the last series),
        else ``E = ratio``.
      valid: bool ``[N, E]`` (positions before 0 are invalid).
      ratio: the compression ratio.

    Returns:
      ``[N, dim]``: the per-channel softmax(score)-weighted sum of ``kv``.
    """
    series = window.shape[2]
    e = window.shape[1]
    older = (jnp.arange(e) < e - ratio)[None, :, None, None]
    picked = jnp.where(older, window[:, :, 0], window[:, :, series - 1])
    kv, score = picked[:, :, 0], picked[:, :, 1]
    w = masked_softmax(score, valid[:, :, None], axis=1)
    return jnp.sum(w * kv, axis=1)


# --- lightning indexer ----------------------------------------------------------------------
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
