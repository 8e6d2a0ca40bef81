"""Content keys of prefix blocks, computed on device from token ids.

A prefix key names the exact token prefix ``tokens[0:end]`` of one prompt in one namespace.
It is ``KEY_WORDS = 7`` uint32 words:

======  =====================================================================================
words   meaning
======  =====================================================================================
0..3    four independent 32-bit hash lanes (128 bits) of the prefix: the **chain state**
4..5    the namespace (tenant / LoRA adapter / model version salt), stored verbatim
6       ``end``, the prefix length in tokens (the block's end position), stored verbatim
======  =====================================================================================

The index compares all seven words, so two keys of different namespaces or different lengths
never match, whatever the hash lanes say; only same-namespace, same-length prefixes rely on
the 128 hash bits (collision analysis: ``docs/prefix.md``).

The chain. Each token ``t`` at position ``k`` contributes a term per lane,
``term_l(t, k) = fmix(fmix(fmix(t * C + a) ^ s_l) ^ (k * D + c_l))`` (``fmix`` is the murmur3
finaliser, a bijection of uint32; ``C`` is odd; ``a``, ``s_l``, ``c_l`` are namespace seeds), and the chain state after ``end`` tokens is the lane-wise
sum of the terms modulo 2**32::

    S(end) = S(end - B) + sum(term(t_k, k) for k in [end - B, end))   # key_i = H(key_{i-1}, block_i, ns)

Because the terms are position-tagged, the sum identifies the ordered prefix, and because
addition is associative the whole prompt is hashed in one vectorised pass (a cumulative sum,
no scan over blocks). For a fixed position and namespace ``term_l`` is a bijection of the token
id, so two prefixes that differ in exactly one token never share a key. The coordinator can
keep ``S`` per request (4 words) and extend it with :func:`extend_sums` as tokens are accepted,
without keeping the tokens.

Keys are the same for every group: group ``g``'s block ``i`` is named by the key of the
prefix that ends at the block's end, ``(i + 1) * block_tokens``; each group has its own index.
Bulk hashing (:func:`chain_sums`) sums tokens per ``unit`` (the gcd of the groups' block spans)
and accumulates across units, so a key exists at every end position any group needs.

These are not cryptographic hashes. See ``docs/prefix.md`` for the collision analysis and for
why a namespace should carry a secret salt when prompts come from untrusted users.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flatkv_jax.errors import check_positive_int, fail

#: Hash lanes (uint32 each) in a key: 128 bits.
LANES = 4
#: uint32 words in a key: the hash lanes, two namespace words, the end position.
KEY_WORDS = LANES + 3
#: Word offsets inside a key.
NS_WORD = LANES
END_WORD = LANES + 2

_M1 = np.uint32(0x85EBCA6B)
_M2 = np.uint32(0xC2B2AE35)
_TOKEN_MUL = np.uint32(0x9E3779B1)  # odd: token -> token * C is a bijection
_POS_MUL = np.uint32(0x632BE5AB)
_NS_SEED = np.uint32(0x27D4EB2F)
_LANE_SEEDS = np.array([0x165667B1, 0xD3A2646C, 0xFD7046C5, 0xB55A4F09], np.uint32)
_POS_SEEDS = np.array([0x68E31DA4, 0xB5297A4D, 0x1B56C4E9, 0x7FEB352D], np.uint32)


def _fmix(x: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: a bijection of uint32 with full avalanche."""
    x = x ^ (x >> np.uint32(16))
    x = x * _M1
    x = x ^ (x >> np.uint32(13))
    x = x * _M2
    return x ^ (x >> np.uint32(16))


def namespace_words(namespace: int | tuple[int, int]) -> np.ndarray:
    """Host helper: a namespace as the ``uint32[2]`` the device functions take.

    Args:
      namespace: an int in ``[0, 2**64)`` (low word first) or a pair of ints in ``[0, 2**32)``.

    Returns:
      ``np.ndarray`` uint32[2].

    Raises:
      TypeError/ValueError: not an int or a pair, or out of range.
    """
    if isinstance(namespace, int) and not isinstance(namespace, bool):
        if not 0 <= namespace < 2**64:
            fail(
                "namespace",
                namespace,
                "a namespace int must lie in [0, 2**64)",
                "hash longer salts to 64 bits first",
            )
        return np.array([namespace & 0xFFFFFFFF, namespace >> 32], np.uint32)
    if isinstance(namespace, tuple) and len(namespace) == 2:
        for w in namespace:
            if not isinstance(w, int) or isinstance(w, bool) or not 0 <= w < 2**32:
                fail(
                    "namespace",
                    namespace,
                    "a namespace pair holds two ints in [0, 2**32)",
                    "pass (low, high) words",
                )
        return np.array(namespace, np.uint32)
    fail(
        "namespace",
        namespace,
        "a namespace is an int or a pair of uint32 words",
        "pass e.g. 0 or (tenant_id, adapter_id)",
        exc=TypeError,
    )


def _as_namespace(namespace, batch: int) -> jax.Array:
    """Normalises a namespace argument to uint32[batch, 2] (static shape/dtype checks only).

    Accepted: a Python int or pair (:func:`namespace_words`); uint32[2] or uint32[B, 2] words;
    an int32/uint32 scalar or [B] vector (a 32-bit namespace: the low word, high word 0 — what a
    Python int becomes when it is passed through ``jax.jit`` as a traced argument).
    """
    if isinstance(namespace, int | tuple):
        namespace = namespace_words(namespace)
    ns = jnp.asarray(namespace)
    if ns.dtype not in (jnp.uint32, jnp.int32):
        fail(
            "namespace.dtype",
            ns.dtype,
            "namespace words are uint32 (or one int32/uint32 low word)",
            "build them with namespace_words() or .astype(jnp.uint32)",
            exc=TypeError,
        )
    if ns.shape in ((), (batch,)):
        low = jnp.broadcast_to(ns.astype(jnp.uint32), (batch,))
        return jnp.stack([low, jnp.zeros_like(low)], axis=1)
    if ns.dtype != jnp.uint32:
        fail(
            "namespace.dtype",
            ns.dtype,
            "namespace words are uint32 (or one int32/uint32 low word)",
            "build them with namespace_words() or .astype(jnp.uint32)",
            exc=TypeError,
        )
    if ns.shape == (2,):
        return jnp.broadcast_to(ns[None, :], (batch, 2))
    if ns.shape != (batch, 2):
        fail(
            "namespace.shape",
            ns.shape,
            f"one namespace (2,) or one per prompt ({batch}, 2)",
            "pass uint32[2] or uint32[B, 2]",
        )
    return ns


def _check_tokens(tokens) -> jax.Array:
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2:
        fail(
            "tokens.shape",
            tokens.shape,
            "token ids are a [B, L] batch",
            "add a batch axis (tokens[None])",
        )
    if tokens.dtype != jnp.int32:
        fail(
            "tokens.dtype",
            tokens.dtype,
            "token ids are int32",
            "cast with .astype(jnp.int32)",
            exc=TypeError,
        )
    return tokens


def _check_lengths(lengths, batch: int, what: str = "lengths") -> jax.Array:
    lengths = jnp.asarray(lengths)
    if lengths.shape != (batch,) or lengths.dtype != jnp.int32:
        fail(
            f"{what}",
            f"{lengths.dtype}{list(lengths.shape)}",
            f"one int32 per prompt, shape ({batch},)",
            f"pass {what} as int32[B]",
        )
    return lengths


def _seeds(ns: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-prompt seeds from uint32[B, 2] namespaces: token seed [B], lane seeds [B, LANES],
    position seeds [B, LANES]."""
    base = _fmix(ns[:, 0] ^ _fmix(ns[:, 1] + _NS_SEED))  # [B]
    lane = _fmix(base[:, None] ^ jnp.asarray(_LANE_SEEDS)[None, :])  # [B, LANES]
    pos = _fmix(base[:, None] + jnp.asarray(_POS_SEEDS)[None, :])  # [B, LANES]
    return base, lane, pos


def token_terms(tokens: jax.Array, positions: jax.Array, namespace, mask: jax.Array) -> jax.Array:
    """Per-token, per-lane hash terms (0 where ``mask`` is False).

    Args:
      tokens: int32[B, T] token ids.
      positions: int32[B, T] absolute positions of the tokens (>= 0).
      namespace: uint32[2] or uint32[B, 2] words, an int32/uint32 scalar or [B] low word, or a
        Python int / pair (see :func:`namespace_words`).
      mask: bool[B, T]; masked tokens contribute nothing.

    Returns:
      uint32[B, T, LANES].
    """
    tokens = _check_tokens(tokens)
    ns = _as_namespace(namespace, tokens.shape[0])
    base, lane, pos_seed = _seeds(ns)
    inner = _fmix(tokens.astype(jnp.uint32) * _TOKEN_MUL + base[:, None])  # [B, T], bijective in t
    tag = (
        positions.astype(jnp.uint32)[:, :, None] * _POS_MUL + pos_seed[:, None, :]
    )  # [B, T, LANES]
    terms = _fmix(_fmix(inner[:, :, None] ^ lane[:, None, :]) ^ tag)
    return jnp.where(mask[:, :, None], terms, jnp.uint32(0))


def chain_sums(tokens: jax.Array, lengths: jax.Array, namespace, *, unit: int) -> jax.Array:
    """Chain states of every ``unit``-aligned prefix of a batch of prompts, in one pass.

    Args:
      tokens: int32[B, L] token ids, padded arbitrarily beyond ``lengths``.
      lengths: int32[B] prompt lengths; tokens at positions ``>= lengths`` are ignored.
      namespace: uint32[2] or uint32[B, 2] (or an int / pair).
      unit: static; the state is returned at every multiple of ``unit``.

    Returns:
      uint32[B, L // unit, LANES]: entry ``j`` is the chain state ``S((j + 1) * unit)``
      (meaningful only while ``(j + 1) * unit <= lengths``; a trailing partial unit is dropped).
    """
    check_positive_int("unit", unit)
    tokens = _check_tokens(tokens)
    b, length = tokens.shape
    lengths = _check_lengths(lengths, b)
    n = length // unit
    tokens = tokens[:, : n * unit]
    pos = jnp.broadcast_to(jnp.arange(n * unit, dtype=jnp.int32)[None, :], (b, n * unit))
    terms = token_terms(tokens, pos, namespace, pos < lengths[:, None])
    per_unit = jnp.sum(terms.reshape(b, n, unit, LANES), axis=2, dtype=jnp.uint32)
    return jnp.cumsum(per_unit, axis=1, dtype=jnp.uint32)


def extend_sums(
    base: jax.Array, tokens: jax.Array, start: jax.Array, count: jax.Array, namespace
) -> jax.Array:
    """Continues chain states over newly accepted tokens (the coordinator's publish path).

    Args:
      base: uint32[B, LANES], the chain state ``S(start)`` (zeros for ``start == 0``).
      tokens: int32[B, T], the tokens at positions ``start .. start + T - 1``.
      start: int32[B] position of ``tokens[:, 0]``.
      count: int32[B] how many of the T tokens are real (the rest are ignored).

    Returns:
      uint32[B, T, LANES]: entry ``t`` is ``S(start + t + 1)`` (equal to ``S(start + count)``
      for ``t >= count``).
    """
    tokens = _check_tokens(tokens)
    b, t = tokens.shape
    start = _check_lengths(start, b, "start")
    count = _check_lengths(count, b, "count")
    if base.shape != (b, LANES) or base.dtype != jnp.uint32:
        fail(
            "base",
            f"{base.dtype}{list(base.shape)}",
            f"the chain state is uint32[B, {LANES}]",
            "pass the state returned with the hit (or zeros)",
        )
    offs = jnp.arange(t, dtype=jnp.int32)[None, :]
    terms = token_terms(tokens, start[:, None] + offs, namespace, offs < count[:, None])
    return base[:, None, :] + jnp.cumsum(terms, axis=1, dtype=jnp.uint32)


def keys_from_sums(sums: jax.Array, ends: jax.Array, namespace) -> jax.Array:
    """Assembles keys from chain states.

    Args:
      sums: uint32[B, K, LANES] chain states ``S(ends)``.
      ends: int32[B, K] the prefix lengths the states belong to.
      namespace: uint32[2] or uint32[B, 2] (or an int / pair).

    Returns:
      uint32[B, K, KEY_WORDS].
    """
    b, k = ends.shape
    ns = _as_namespace(namespace, b)
    ns = jnp.broadcast_to(ns[:, None, :], (b, k, 2))
    return jnp.concatenate([sums, ns, ends.astype(jnp.uint32)[:, :, None]], axis=-1)


def keys_at(
    sums: jax.Array, unit: int, lengths: jax.Array, namespace, ends: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Keys of the prefixes ending at ``ends``, gathered from :func:`chain_sums` output.

    Args:
      sums: uint32[B, N, LANES] from ``chain_sums(..., unit=unit)``.
      unit: static, the unit ``sums`` was computed with.
      lengths: int32[B] prompt lengths.
      namespace: as for :func:`chain_sums`.
      ends: int32[B, K] or int32[K] (shared by every prompt) prefix lengths.

    Returns:
      ``(keys, valid)``: uint32[B, K, KEY_WORDS] and bool[B, K]; ``valid`` is False where the
      prefix is empty, not a multiple of ``unit``, or longer than the prompt (its key is junk).
    """
    check_positive_int("unit", unit)
    b, n, _ = sums.shape
    ends = jnp.asarray(ends, jnp.int32)
    if ends.ndim == 1:
        ends = jnp.broadcast_to(ends[None, :], (b, ends.shape[0]))
    j = ends // unit - 1
    valid = (ends > 0) & (ends % unit == 0) & (j < n) & (ends <= lengths[:, None])
    at = jnp.take_along_axis(sums, jnp.clip(j, 0, max(n - 1, 0))[:, :, None], axis=1)
    return keys_from_sums(at, ends, namespace), valid


def block_keys(
    tokens: jax.Array, lengths: jax.Array, namespace, *, block_tokens: int
) -> tuple[jax.Array, jax.Array]:
    """Keys of every complete block of ``block_tokens`` tokens of each prompt.

    Args:
      tokens: int32[B, L] token ids, padded beyond ``lengths``.
      lengths: int32[B] prompt lengths.
      namespace: uint32[2] or uint32[B, 2] (or an int / pair).
      block_tokens: static block span.

    Returns:
      ``(keys, valid)``: uint32[B, L // block_tokens, KEY_WORDS] and bool[B, L // block_tokens];
      block ``i`` (tokens ``[i*B, (i+1)*B)``) is valid iff it lies wholly inside the prompt.
    """
    check_positive_int("block_tokens", block_tokens)
    sums = chain_sums(tokens, lengths, namespace, unit=block_tokens)
    n = sums.shape[1]
    ends = (jnp.arange(n, dtype=jnp.int32) + 1) * block_tokens
    return keys_at(sums, block_tokens, lengths, namespace, ends)
