"""The dense, cache-free reference over a :class:`~flatkv_jax.model.params.Params` pytree.

A thin function over :meth:`flatkv_jax.model.DeepSeekV4.dense`: the layers' math lives once,
in :mod:`flatkv_jax.model.modules`, and every row the cached path stores goes through the same
quantize/dequantize round trip here (:func:`flatkv_jax.model.quant.roundtrip`), so cached and
dense execution see the same values whatever the row format, and parity is a test of the cache
addressing.
"""

from __future__ import annotations

import jax

from flatkv_jax.model.cache_io import check_token_ids
from flatkv_jax.model.config import ModelConfig
from flatkv_jax.model.modules import DeepSeekV4
from flatkv_jax.model.params import Params


def dense_forward(params: Params, tokens: jax.Array, cfg: ModelConfig):
    """Cache-free forward of one whole sequence (the parity reference).

    Args:
      params: model parameters.
      tokens: int32 ``[T]``, positions ``0 .. T-1``.
      cfg: the model config.

    Returns:
      ``(logits [T, vocab], hidden [T, hidden], draft_logits [T, vocab] or None)``, as
      :meth:`DeepSeekV4.dense <flatkv_jax.model.DeepSeekV4.dense>` (which it calls, sharing its
      compilation cache: one compilation per (cfg, T)).
    """
    tokens = check_token_ids(tokens)
    return DeepSeekV4.from_params(cfg, params).dense(tokens)
