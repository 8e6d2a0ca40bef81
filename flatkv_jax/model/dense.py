"""The dense, cache-free reference: the whole sequence at once, written plainly.

Every row that the cached path stores in a pool goes through the same quantize/dequantize
round trip here (:func:`flatkv_jax.model.quant.roundtrip`), so cached and dense execution see
the same values whatever the row format, and parity is a test of the cache addressing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flatkv_jax.errors import fail
from flatkv_jax.model import layers as L
from flatkv_jax.model import quant
from flatkv_jax.model.config import ModelConfig
from flatkv_jax.model.params import CompressorParams, LayerParams, Params
from flatkv_jax.recipes.deepseek_v4 import indexer_row_format, kv_row_format


def _compressed_rows(
    cp: CompressorParams, xn: jax.Array, pos: jax.Array, rope_dim: int, cfg: ModelConfig
):
    """All complete compressed rows of the sequence: ``[T // ratio, dim]``."""
    ratio = cp.ape.shape[1]
    span = L.window_span(cp)
    state = L.compressor_state(cp, xn, pos)
    j = jnp.arange(xn.shape[0] // ratio, dtype=jnp.int32)
    win_pos = (j[:, None] + 1) * ratio - span + jnp.arange(span, dtype=jnp.int32)[None, :]
    valid = win_pos >= 0
    return L.compress_window(cp, state[jnp.maximum(win_pos, 0)], valid, j, rope_dim, cfg)


def dense_layer(lp: LayerParams, x: jax.Array, ratio: int, cfg: ModelConfig) -> jax.Array:
    """One layer over the whole sequence ``x [T, hidden]`` (positions ``0 .. T-1``)."""
    t = x.shape[0]
    pos = jnp.arange(t, dtype=jnp.int32)
    kv_fmt = kv_row_format(cfg.cache)
    xn, q, kv = L.project_qkv(lp, x, pos, cfg)
    keys = quant.roundtrip(kv_fmt, kv)
    # Sliding window: query p sees raw rows p - window + 1 .. p.
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - cfg.window)
    rows = t // ratio if ratio else 0
    if rows:
        crow = quant.roundtrip(kv_fmt, _compressed_rows(lp.compressor, xn, pos, cfg.rope_dim, cfg))
        # Row j is complete once token (j+1)*ratio - 1 is seen: visible to queries p >= that.
        visible = jnp.arange(rows)[None, :] < ((pos + 1) // ratio)[:, None]
        if ratio == cfg.cache.csa_ratio:
            ip = lp.indexer
            ikeys = _compressed_rows(ip.compressor, xn, pos, cfg.index_rope_dim, cfg)
            ikeys = quant.roundtrip(indexer_row_format(cfg.cache), ikeys)
            iq, iw = L.index_queries(ip, xn, pos, cfg)
            scores = L.index_scores(iq, iw, jnp.broadcast_to(ikeys[None], (t, *ikeys.shape)))
            idx, ok = L.top_k_rows(scores, visible, cfg.cache.index_topk)
            chosen = jnp.zeros((t, rows), bool).at[jnp.arange(t)[:, None], idx].set(ok)
        else:
            chosen = visible
        keys = jnp.concatenate([keys, crow], axis=0)
        mask = jnp.concatenate([mask, chosen], axis=1)
    attn = L.attend(q, jnp.broadcast_to(keys[None], (t, *keys.shape)), mask, lp.sink)
    return L.finish_layer(lp, x, attn, cfg)


@functools.partial(jax.jit, static_argnums=0)
def _dense(cfg: ModelConfig, params: Params, tokens: jax.Array):
    x = params.embed[tokens]
    for i, lp in enumerate(params.layers):
        x = dense_layer(lp, x, cfg.ratio(i), cfg)
    logits = L.logits_of(params.head, params.final_norm, x, cfg)
    if params.mtp is None:
        return logits, x, None
    mp = params.mtp
    # The draft at position q reads the target hidden of q - 1 (zeros before position 0).
    prev = jnp.concatenate([jnp.zeros_like(x[:1]), x[:-1]], axis=0)
    g = dense_layer(mp.layer, L.mtp_input(mp, params.embed[tokens], prev, cfg), 0, cfg)
    return logits, x, L.logits_of(params.head, mp.final_norm, g, cfg)


def dense_forward(params: Params, tokens: jax.Array, cfg: ModelConfig):
    """Cache-free forward of one whole sequence (the parity reference).

    Args:
      params: model parameters.
      tokens: int32 ``[T]``, positions ``0 .. T-1``.
      cfg: the model config.

    Returns:
      ``(logits [T, vocab], hidden [T, hidden], draft_logits [T, vocab] or None)``: target
      logits (predicting token ``p + 1``), the final residual stream (what the MTP layer reads)
      and the MTP layer's logits at each position ``q`` from ``(hidden[q-1], tokens[q])``.
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 1 or tokens.dtype != jnp.int32:
        fail(
            "tokens",
            (tokens.shape, str(tokens.dtype)),
            "one sequence of int32 token ids",
            "pass jnp.asarray(ids, jnp.int32)",
        )
    return _dense(cfg, params, tokens)
