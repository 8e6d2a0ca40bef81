"""Content keys of prefix blocks, computed on device from token ids under a secret seed.

A prefix key names the exact token prefix ``tokens[0:end]`` of one prompt in one namespace.
It is ``KEY_WORDS = 7`` uint32 words:

======  =====================================================================================
words   meaning
======  =====================================================================================
0..3    four 32-bit hash lanes (128 bits) of the prefix, keyed by the state's secret seed
4..5    the namespace (tenant / LoRA adapter / model version salt), stored verbatim
6       ``end``, the prefix length in tokens (the block's end position), stored verbatim
======  =====================================================================================

The index compares all seven words, so two keys of different namespaces or different lengths
never match, whatever the hash lanes say; only same-namespace, same-length prefixes rely on
the 128 hash bits (threat model and collision bound: ``docs/prefix.md``).

The hash. Everything is keyed by a 128-bit **secret seed** (``create_state`` draws one from
the operating system's entropy; tests pass one explicitly) mixed with the namespace into three
128-bit subkeys ``tk, gk, fk``. ``E_k(x) = P(x ^ k) ^ k`` is an Even-Mansour cipher over four
uint32 words, ``P`` a fixed ARX permutation (rounds of ChaCha's quarter-round). Tokens are
grouped into **chain blocks** of ``CHAIN_TOKENS = 128`` positions:

- each token ``t`` at position ``k`` gives a term ``E_tk(t, k, 0, 0)`` (128 bits; distinct
  ``(t, k)`` give distinct terms) — all tokens in parallel;
- ``A_j(e)``: the lane-wise sum (mod 2**32) of the terms of block ``j``'s tokens before ``e``;
- the chain: ``S_0 = 0`` and ``S_{j+1} = F(S_j, A_j((j + 1) * C), (j + 1) * C)``, where
  ``F(S, A, e) = E_fk((E_gk(S) + A) ^ (0, 0, 0, e))`` — a sequential, non-linear step per
  chain block only (``lax.scan`` over blocks, vectorised over prompts);
- the lanes of the prefix ending at ``e`` are ``F(S_j, A_j(e), e)`` with ``j`` the block of
  token ``e - 1`` (so at a block boundary they equal ``S_{j+1}``): every key depends
  non-linearly on the chain key of the previous block boundary and on every token since.

For a fixed chain key ``S_j``, ``F`` is a bijection of ``A``, and ``A`` changes whenever one
token of the block changes, so two prefixes that differ in exactly one token of their last
block never share a key. Without the seed the terms and ``F`` cannot be computed, so nobody
can construct two prompts with equal keys (the sums are of keyed pseudo-random values, not
of public ones).

Incremental: the coordinator keeps a request's **chain state** ``(S_j, A_j(c))``
(``CHAIN_WORDS = 8`` words; all zeros at ``c = 0``) and continues it over newly accepted
tokens with :func:`extend_chain`, which returns the lanes at every new end; it never needs the
old tokens again. :func:`chain_lanes` hashes whole prompts in one pass (terms, per-unit sums,
a cumulative sum within blocks, the scan over blocks, then the lanes at every unit end).

Keys are the same for every group: group ``g``'s block ``i`` is named by the key of the
prefix that ends at the block's end, ``(i + 1) * block_tokens``; each group has its own index.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import secrets

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
#: uint32 words of the secret seed (128 bits).
SEED_WORDS = 4
#: uint32 words of a chain state: the chain key ``S_j`` and the block's partial sum ``A_j``.
CHAIN_WORDS = 2 * LANES
#: Tokens per chain block: the non-linear chain step runs once per block.
CHAIN_TOKENS = 128

#: Quarter-rounds of ``P`` per use: token terms, and the chain / subkey mixes.
TERM_ROUNDS = 6
CHAIN_ROUNDS = 8

_U32 = jnp.uint32
# Round constants (break the symmetry between rounds; any distinct odd values do).
_RC = np.array(
    [0x9E3779B9, 0x7F4A7C15, 0xF39CC060, 0x5CEDC834, 0xB7E15163, 0x2B7E1516, 0x243F6A89,
     0x13198A2F, 0xA4093823, 0x299F31D1],
    np.uint32,
)  # fmt: skip
# Domain tags of the three subkeys.
_TAG_TERM, _TAG_CHAIN, _TAG_FINAL = 0x746B656E, 0x67636861, 0x666B6579


def new_seed() -> np.ndarray:
    """A fresh secret seed, ``uint32[SEED_WORDS]``, from the operating system's entropy."""
    return np.frombuffer(secrets.token_bytes(4 * SEED_WORDS), np.uint32).copy()


def seed_words(seed) -> np.ndarray:
    """Host helper: a seed as ``uint32[SEED_WORDS]``.

    Args:
      seed: an int in ``[0, 2**128)`` (low word first) or ``SEED_WORDS`` uint32 words
        (a sequence of ints or a NumPy array).

    Raises:
      TypeError/ValueError: another type, a negative or too large int, a wrong length.
    """
    if isinstance(seed, int) and not isinstance(seed, bool):
        if not 0 <= seed < 2 ** (32 * SEED_WORDS):
            fail(
                "seed",
                seed,
                "a seed int must lie in [0, 2**128)",
                "pass a smaller int, or None to draw a secret one",
            )
        return np.array([(seed >> (32 * i)) & 0xFFFFFFFF for i in range(SEED_WORDS)], np.uint32)
    if isinstance(seed, np.ndarray | list | tuple):
        arr = np.asarray(seed)
        if arr.shape != (SEED_WORDS,) or not np.issubdtype(arr.dtype, np.integer):
            fail(
                "seed",
                f"{arr.dtype}{list(arr.shape)}",
                f"a seed array holds {SEED_WORDS} uint32 words",
                "pass an int or uint32[4] (e.g. from new_seed())",
            )
        if arr.min() < 0 or arr.max() >= 2**32:
            fail("seed", seed, "seed words lie in [0, 2**32)", "pass uint32 words")
        return arr.astype(np.uint32)
    fail(
        "seed",
        seed,
        "a seed is an int or uint32[4] words",
        "pass e.g. seed=0 in tests, or leave it None to draw a secret one",
        exc=TypeError,
    )


def _as_seed(seed) -> jax.Array:
    """uint32[SEED_WORDS] on device (a traced array passes through with a shape check)."""
    if isinstance(seed, int | list | tuple | np.ndarray) and not isinstance(seed, bool):
        return jnp.asarray(seed_words(seed))
    s = jnp.asarray(seed)
    if s.shape == () and s.dtype in (jnp.int32, jnp.uint32):
        # A Python int passed through jax.jit arrives as a traced scalar: the low word.
        return jnp.stack([s.astype(_U32)] + [jnp.zeros((), _U32)] * (SEED_WORDS - 1))
    if s.shape != (SEED_WORDS,) or s.dtype != jnp.uint32:
        fail(
            "seed",
            f"{s.dtype}{list(s.shape)}",
            f"the key seed is uint32[{SEED_WORDS}]",
            "pass state.key_seed, seed_words(int) or new_seed()",
            exc=TypeError if s.dtype != jnp.uint32 else ValueError,
        )
    return s


def _rotl(x: jax.Array, r: int) -> jax.Array:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


#: Arrays of at least this many words run the rounds of ``P`` in a loop (see
#: _permute_lanes; a one-row admission's 65 finishing mixes, 260 words: 46 -> 15 us).
_LOOP_MIN_WORDS = 128
#: Rounds per loop iteration.
_LOOP_ROUNDS = 2
#: Chains of at least this many rows run one scan per row (see _chain_run) ...
_ROW_SCAN_ROWS = 4
#: ... and from this many on one scan on the four words as separate arrays.
_PLANAR_CHAIN_ROWS = 9


def _round(a, b, c, d, rc):
    """One round of ``P``: a ChaCha quarter-round, roles rotated, the round constant ``rc``."""
    a = a + b
    d = _rotl(d ^ a, 16)
    c = c + d
    b = _rotl(b ^ c, 12)
    a = a + b
    d = _rotl(d ^ a, 8)
    c = c + d
    b = _rotl(b ^ c, 7)
    return b, c, d, a ^ rc


def _permute(x: jax.Array, rounds: int) -> jax.Array:
    """``P``: a fixed permutation of ``uint32[..., 4]`` (ChaCha quarter-rounds, roles rotated
    and a constant injected between rounds). Public; the keys make it secret."""
    return jnp.stack(_permute_lanes(tuple(x[..., i] for i in range(4)), rounds), axis=-1)


def _permute_lanes(lanes: tuple, rounds: int) -> tuple:
    """:func:`_permute` on the four words as separate arrays (``lanes``: four ``uint32[...]``
    of one shape): a prompt's token terms are computed so, each word then summed over
    contiguous terms (:func:`_block_sums`; a word of ``[..., 4]`` is every fourth one), and
    the chain scan of four rows or more steps so (:func:`_chain_run`).

    Large arrays (a prompt's lanes) run the rounds in a ``fori_loop`` of ``_LOOP_ROUNDS``
    rounds per iteration: XLA:CPU compiles seven or more unrolled rounds over a large array
    into code 15-35x slower than six (measured: 8 rounds over ``[2, 4096, 4]`` words, 8.4 ms
    unrolled, 0.22 ms looped; a B = 256 decode step's publish hash, 1.1 ms -> 0.3 ms), and the
    loop is a smaller program. The words are the same either way; tiny arrays stay unrolled.
    """
    a, b, c, d = lanes
    n_loop = rounds // _LOOP_ROUNDS if rounds > 6 and 4 * a.size >= _LOOP_MIN_WORDS else 0
    if n_loop:
        rc = jnp.asarray(_RC)

        def body(i, lanes):
            for j in range(_LOOP_ROUNDS):
                lanes = _round(*lanes, rc[(i * _LOOP_ROUNDS + j) % len(_RC)])
            return lanes

        a, b, c, d = jax.lax.fori_loop(0, n_loop, body, (a, b, c, d))
    for r in range(n_loop * _LOOP_ROUNDS, rounds):
        a, b, c, d = _round(a, b, c, d, _RC[r % len(_RC)])
    return a, b, c, d


def _cipher(k: jax.Array, x: jax.Array, rounds: int) -> jax.Array:
    """``E_k(x) = P(x ^ k) ^ k`` (Even-Mansour): a keyed bijection of 128-bit words."""
    return _permute(x ^ k, rounds) ^ k


def _cipher_lanes(k: tuple, x: tuple, rounds: int) -> tuple:
    """:func:`_cipher` on the four words as separate arrays (``k``, ``x``: four each)."""
    y = _permute_lanes(tuple(a ^ b for a, b in zip(x, k, strict=True)), rounds)
    return tuple(a ^ b for a, b in zip(y, k, strict=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Subkeys:
    """Per-prompt keys derived from the seed and the namespace: ``uint32[B, 4]`` each."""

    term: jax.Array
    chain: jax.Array
    final: jax.Array

    def words(self) -> jax.Array:
        """The three subkeys as one ``uint32[B, 3, LANES]`` array (``term, chain, final``):
        how a coordinator state keeps each request's (``CacheState.subkeys``)."""
        return jnp.stack([self.term, self.chain, self.final], axis=1)

    @classmethod
    def from_words(cls, words: jax.Array) -> Subkeys:
        """The inverse of :meth:`words`."""
        return cls(words[:, 0], words[:, 1], words[:, 2])


def subkeys(seed, namespace, batch: int) -> Subkeys:
    """The three per-prompt subkeys of ``seed`` and each prompt's namespace."""
    k = _as_seed(seed)[None, :]
    ns = _as_namespace(namespace, batch)

    # The three tags in one cipher pass over [3, B, 4] words: on XLA:CPU a pass costs about
    # the same at B = 1 or B = 256 (loop and thunk overhead), so three passes cost 3x one.
    tags = jnp.asarray([_TAG_TERM, _TAG_CHAIN, _TAG_FINAL], _U32)[:, None]
    x = jnp.stack(
        [
            jnp.broadcast_to(ns[None, :, 0], (3, batch)),
            jnp.broadcast_to(ns[None, :, 1], (3, batch)),
            jnp.broadcast_to(tags, (3, batch)),
            jnp.ones((3, batch), _U32),
        ],
        -1,
    )
    term, chain, final = _cipher(k[None], x, CHAIN_ROUNDS)
    return Subkeys(term, chain, final)


def token_terms(tokens: jax.Array, positions: jax.Array, sub: Subkeys, mask: jax.Array):
    """Per-token terms ``E_tk(t, k, 0, 0)``: ``uint32[B, T, LANES]`` (0 where ``mask`` is False).

    Args:
      tokens: int32[B, T] token ids.
      positions: int32[B, T] absolute positions.
      sub: :func:`subkeys` of the prompts.
      mask: bool[B, T].
    """
    return _terms(sub.term, tokens, positions, mask)


def _terms(term_key: jax.Array, tokens: jax.Array, positions: jax.Array, mask: jax.Array):
    # Stacked words: a decode step's few terms per row (its publish hash, add_terms); made
    # from `_term_lanes` they cost the decode step x1.01-1.03 (ab_compiled, both orders).
    z = jnp.zeros(tokens.shape, _U32)
    x = jnp.stack([tokens.astype(_U32), positions.astype(_U32), z, z], axis=-1)
    terms = _cipher(term_key[:, None, :], x, TERM_ROUNDS)
    return jnp.where(mask[:, :, None], terms, _U32(0))


def _term_lanes(
    term_key: jax.Array, tokens: jax.Array, positions: jax.Array, mask: jax.Array
) -> tuple:
    """The token terms ``E_tk(t, k, 0, 0)`` as four ``uint32[B, T]`` word arrays (0 where
    ``mask`` is False): :func:`_cipher` with the words kept apart (:func:`_permute_lanes`)."""
    k = tuple(term_key[:, i, None] for i in range(LANES))  # [B, 1] each
    x = (
        tokens.astype(_U32) ^ k[0],
        positions.astype(_U32) ^ k[1],
        jnp.broadcast_to(k[2], tokens.shape),
        jnp.broadcast_to(k[3], tokens.shape),
    )
    y = _permute_lanes(x, TERM_ROUNDS)
    return tuple(jnp.where(mask, w ^ kw, _U32(0)) for w, kw in zip(y, k, strict=True))


def _chain_key(sub: Subkeys, s: jax.Array) -> jax.Array:
    """``E_gk(S)``: the non-linear image of a chain key (``s``: ``[B, ..., 4]``)."""
    k = sub.chain.reshape(sub.chain.shape[:1] + (1,) * (s.ndim - 2) + (LANES,))
    return _cipher(k, s, CHAIN_ROUNDS)


def _finish(sub: Subkeys, g: jax.Array, acc: jax.Array, ends: jax.Array) -> jax.Array:
    """``F``: lanes of the prefix ending at ``ends`` from ``g = E_gk(S_j)`` and ``A_j(end)``."""
    x = g + acc
    x = x.at[..., 3].set(x[..., 3] ^ ends.astype(_U32))
    k = sub.final.reshape(sub.final.shape[:1] + (1,) * (x.ndim - 2) + (LANES,))
    return _cipher(k, x, CHAIN_ROUNDS)


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
    an int32/uint32 scalar or an int32[B] vector (a 32-bit namespace: the low word, high word 0
    — what a Python int becomes when it is passed through ``jax.jit`` as a traced argument).
    A uint32[B] vector is refused: at B = 2 it would read as one namespace's two words, so its
    meaning would change with the batch size (one tenant's two prompts keyed as two
    namespaces, and two tenants sharing a low word keyed alike).
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
    if ns.shape == (2,) and ns.dtype == jnp.uint32:
        return jnp.broadcast_to(ns[None, :], (batch, 2))
    if ns.shape == (batch,) and ns.dtype == jnp.uint32:
        fail(
            "namespace",
            f"uint32[{batch}]",
            "uint32 namespaces are words: uint32[2] (one namespace) or uint32[B, 2] (one per "
            "prompt); per-prompt low words are int32[B] (a uint32[2] pair and two prompts' "
            "low words would look alike)",
            "pass namespace.astype(jnp.int32) for low words, or stack (low, high) pairs into "
            "uint32[B, 2]",
            exc=TypeError,
        )
    if ns.shape == () or (ns.shape == (batch,) and ns.dtype == jnp.int32):
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


def _chain_run(
    sub: Subkeys, s0: jax.Array, tot: jax.Array, bounds: jax.Array, done: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """Runs the chain over ``n`` blocks: ``S_{r+1} = F(S_r, tot_r, bounds_r)`` where ``done``.

    Args:
      s0: uint32[B, 4] the chain key before the first block.
      tot: uint32[B, n, 4] each block's complete sum.
      bounds: int32[B, n] each block's end position.
      done: bool[B, n] or None (all): whether the block completes (else ``S`` is kept).

    Returns:
      ``(heads, g)``: uint32[B, n + 1, 4] the chain keys at the block starts (and after the
      last), and uint32[B, n, 4] their images ``E_gk(S_r)``.
    """
    n = tot.shape[1]

    def step(s, x):
        t, e, ok = x
        g = _chain_key(sub, s)
        nxt = _finish(sub, g, t, e)
        return (nxt if ok is None else jnp.where(ok[:, None], nxt, s)), (s, g)

    if n <= 8:  # short chains (the publish path): unrolled, no loop
        s, heads, gs = s0, [], []
        for r in range(n):
            s, (h, g) = step(s, (tot[:, r], bounds[:, r], None if done is None else done[:, r]))
            heads.append(h)
            gs.append(g)
        heads.append(s)
        return jnp.stack(heads, 1), (jnp.stack(gs, 1) if gs else tot)
    b = tot.shape[0]
    if _ROW_SCAN_ROWS <= b < _PLANAR_CHAIN_ROWS:
        # XLA:CPU compiles a loop this small (up to 3 rows) into one kernel (its small-while-
        # loop hoisting) but runs a 4-row one op by op: one scan per row, each one kernel
        # (chain_lanes alone, 32 blocks: B = 4 106 -> 66 us, B = 8 200 -> 130).
        parts = [
            _chain_run(
                jax.tree_util.tree_map(lambda x, i=i: x[i : i + 1], sub),
                s0[i : i + 1],
                tot[i : i + 1],
                bounds[i : i + 1],
                None if done is None else done[i : i + 1],
            )
            for i in range(b)
        ]
        return tuple(jnp.concatenate(p, axis=0) for p in zip(*parts, strict=True))
    xs = (
        jnp.swapaxes(tot, 0, 1),
        jnp.swapaxes(bounds, 0, 1),
        None if done is None else jnp.swapaxes(done, 0, 1),
    )
    if b < _PLANAR_CHAIN_ROWS:
        s, (heads, gs) = jax.lax.scan(step, s0, xs)
    else:
        # The words as four [B] arrays, the outputs one [B, 8] slice per block: one loop
        # op by op, as fast from 9 rows as a scan per row (chain_lanes alone, 32 blocks,
        # B = 16: 213 against 209 us) and one loop to compile, not B (the stacked scan:
        # B = 8 265 us against 116).
        ck = tuple(sub.chain[:, i] for i in range(LANES))
        fk = tuple(sub.final[:, i] for i in range(LANES))

        def step_words(w, x):
            t, e, ok = x
            g = _cipher_lanes(ck, w, CHAIN_ROUNDS)
            y = tuple(gi + t[:, i] for i, gi in enumerate(g))
            nxt = _cipher_lanes(fk, (*y[:3], y[3] ^ e.astype(_U32)), CHAIN_ROUNDS)
            if ok is not None:
                nxt = tuple(jnp.where(ok, a, b) for a, b in zip(nxt, w, strict=True))
            return nxt, jnp.stack([*w, *g], axis=-1)

        w, ys = jax.lax.scan(step_words, tuple(s0[:, i] for i in range(LANES)), xs)
        s, heads, gs = jnp.stack(w, axis=-1), ys[..., :LANES], ys[..., LANES:]
    heads = jnp.concatenate([jnp.swapaxes(heads, 0, 1), s[:, None]], axis=1)
    return heads, jnp.swapaxes(gs, 0, 1)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["lanes", "acc", "heads"],
    meta_fields=["unit", "sub_unit"],
)
@dataclasses.dataclass(frozen=True)
class PromptHash:
    """Hashes of every ``unit``-aligned prefix of a batch of prompts (:func:`chain_lanes`).

    Attributes:
      lanes: uint32[B, L // unit, LANES]; entry ``j`` holds the lanes of the prefix of
        ``(j + 1) * unit`` tokens (meaningful while that is ``<= lengths``).
      acc: uint32[B, N, LANES], the block sums ``A_j`` at every ``sub_unit`` end.
      heads: uint32[B, NB + 1, LANES], the chain keys ``S_j`` at every block boundary.
      unit: static, the unit of ``lanes``.
      sub_unit: static, ``gcd(unit, CHAIN_TOKENS)``, the unit of ``acc``.
    """

    lanes: jax.Array
    acc: jax.Array
    heads: jax.Array
    unit: int
    sub_unit: int


def chain_lanes(tokens: jax.Array, lengths: jax.Array, namespace, *, seed, unit: int) -> PromptHash:
    """Lanes of every ``unit``-aligned prefix of a batch of prompts, in one pass.

    Cost: one keyed term per token (parallel), one chain step per ``CHAIN_TOKENS`` tokens
    (a ``lax.scan`` over blocks, vectorised over prompts) and one finishing mix per unit end.

    Args:
      tokens: int32[B, L] token ids, padded arbitrarily beyond ``lengths``.
      lengths: int32[B] prompt lengths; tokens at positions ``>= lengths`` are ignored.
      namespace: uint32[2] or uint32[B, 2] (or an int / pair; see :func:`namespace_words`).
      seed: the secret key seed, uint32[SEED_WORDS] (``state.key_seed``) or an int.
      unit: static; lanes are returned at every multiple of ``unit``.

    Returns:
      :class:`PromptHash`.
    """
    check_positive_int("unit", unit)
    tokens = _check_tokens(tokens)
    b, length = tokens.shape
    lengths = _check_lengths(lengths, b)
    c = CHAIN_TOKENS
    u = math.gcd(unit, c)
    per = c // u
    nb = max(1, -(-length // c))
    padded = jnp.pad(tokens, ((0, 0), (0, nb * c - length)))
    pos = jnp.broadcast_to(jnp.arange(nb * c, dtype=jnp.int32)[None, :], (b, nb * c))
    sub = subkeys(seed, namespace, b)
    acc = _block_sums(sub, padded, pos, pos < lengths[:, None], u)  # [B, nb, per, 4]
    bounds = jnp.broadcast_to(((jnp.arange(nb, dtype=jnp.int32) + 1) * c)[None, :], (b, nb))
    heads, g = _chain_run(sub, jnp.zeros((b, LANES), _U32), acc[:, :, -1], bounds, None)
    ends = ((jnp.arange(nb * per, dtype=jnp.int32) + 1) * u).reshape(1, nb, per)
    lanes = _finish(sub, g[:, :, None, :], acc, ends).reshape(b, nb * per, LANES)
    k = unit // u
    lanes = lanes[:, k - 1 :: k][:, : length // unit]
    return PromptHash(lanes, acc.reshape(b, nb * per, LANES), heads, unit, u)


def _block_sums(sub: Subkeys, tokens: jax.Array, pos: jax.Array, mask: jax.Array, u: int):
    """``A`` at every ``u``-end of chain blocks: ``uint32[B, n, CHAIN_TOKENS // u, LANES]``
    for ``tokens`` ``int32[B, n * CHAIN_TOKENS]`` laid from a chain-block start (``pos``
    their positions, ``mask`` the real ones). Word by word: each word's per-unit sums read
    contiguous terms (:func:`_permute_lanes`), and the only cumulative sum runs over a
    block's units, not its tokens.

    The four words' unit sums are one variadic reduction: XLA:CPU fuses the terms into it
    and computes each token's cipher once for all four words, where four separate sums
    each recomputed the whole cipher for their word (4 x 4,224 tokens: 137 -> 52 us).
    """
    b, length = tokens.shape
    n, per = length // CHAIN_TOKENS, CHAIN_TOKENS // u
    terms = tuple(w.reshape(b, n, per, u) for w in _term_lanes(sub.term, tokens, pos, mask))
    sums = jax.lax.reduce(
        terms,
        (_U32(0),) * LANES,
        lambda x, y: tuple(p + q for p, q in zip(x, y, strict=True)),
        (3,),
    )
    return jnp.cumsum(jnp.stack(sums, axis=-1), axis=2, dtype=_U32)


def chain_state(ph: PromptHash, ends: jax.Array) -> jax.Array:
    """The chain states ``(S_j, A_j(end))`` at ``ends`` (int32[B], ``0 <= end <= L``):
    ``uint32[B, CHAIN_WORDS]``, all zeros at ``end == 0``. Exact where ``end`` is a multiple
    of ``ph.sub_unit`` or the prompt's length (:func:`chain_lanes` masked every token past it,
    so the sum at the next ``sub_unit`` end is the sum at the length); junk elsewhere."""
    b = ph.heads.shape[0]
    j = jnp.clip(ends // CHAIN_TOKENS, 0, ph.heads.shape[1] - 1)
    s = jnp.take_along_axis(ph.heads, j[:, None, None], axis=1)[:, 0]
    i = jnp.clip(-(-ends // ph.sub_unit) - 1, 0, ph.acc.shape[1] - 1)
    a = jnp.take_along_axis(ph.acc, i[:, None, None], axis=1)[:, 0]
    a = jnp.where((ends % CHAIN_TOKENS != 0)[:, None], a, _U32(0))
    del b
    return jnp.concatenate([s, a], axis=1)


def extend_chain(
    chain: jax.Array,
    tokens: jax.Array,
    start: jax.Array,
    count: jax.Array,
    namespace,
    *,
    seed,
    unit: int = 1,
    sub: Subkeys | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Continues chain states over newly accepted tokens (the coordinator's publish path).

    Cost: ``T`` token terms per row (with ``unit > 1`` and ``T > 1``, those of the positions
    from the chain block at or before ``start``, at most ``CHAIN_TOKENS - 1`` more, summed a
    unit at a time), one finishing mix per returned end (``T / unit + 1``), and one chain
    step per block boundary the ``T`` positions can cross (unrolled: ``T <= 7 *
    CHAIN_TOKENS``).

    Args:
      chain: uint32[B, CHAIN_WORDS], the chain state at ``start`` (zeros at ``start == 0``;
        ``PrefixMatch.state`` at admission, this function's second output afterwards).
      tokens: int32[B, T], the tokens at positions ``start .. start + T - 1``.
      start: int32[B] position of ``tokens[:, 0]``.
      count: int32[B] how many of the T tokens are real (the rest are ignored).
      namespace: uint32[2] or uint32[B, 2] (or an int / pair).
      seed: the secret key seed (as for :func:`chain_lanes`).
      unit: static; lanes are returned only at ends that are multiples of ``unit`` (1: at
        every token). Publishing asks for the spacing of the block ends it can publish.
      sub: the rows' :func:`subkeys` of ``seed`` and ``namespace`` if already derived (the
        coordinator keeps each request's from its admission): saves their cipher pass.

    Returns:
      ``(lanes, chain)``: ``lanes`` uint32[B, N, LANES], entry ``j`` the lanes of the prefix
      ending at ``e_j = (start // unit + 1 + j) * unit`` (``N = T`` for ``unit == 1``, where
      ``e_j = start + j + 1``, else ``T // unit + 1``; junk where ``e_j > start + count``),
      and the chain state at ``start + count``.
    """
    check_positive_int("unit", unit)
    tokens = _check_tokens(tokens)
    b, t = tokens.shape
    start = _check_lengths(start, b, "start")
    count = _check_lengths(count, b, "count")
    chain = jnp.asarray(chain)
    if chain.shape != (b, CHAIN_WORDS) or chain.dtype != _U32:
        fail(
            "chain",
            f"{chain.dtype}{list(chain.shape)}",
            f"the chain state is uint32[B, {CHAIN_WORDS}]",
            "pass the state returned with the hit (or zeros)",
        )
    c = CHAIN_TOKENS
    if sub is None:
        sub = subkeys(seed, namespace, b)
    if unit > 1 and t > 1:
        return _extend_by_units(chain, tokens, start, count, sub, unit)
    offs = jnp.arange(t, dtype=jnp.int32)[None, :]
    pos = start[:, None] + offs
    terms = token_terms(tokens, pos, sub, offs < count[:, None])
    s0, a0 = chain[:, :LANES], chain[:, LANES:]
    q0, phase = start // c, start % c
    seg = pos // c - q0[:, None]  # [B, T]: block of each token, relative to start's block
    nseg = (c + t - 2) // c + 1
    rr = jnp.arange(nseg, dtype=jnp.int32)[None, :]
    cs = jnp.cumsum(terms, axis=1, dtype=_U32)
    first = jnp.maximum(rr * c - phase[:, None], 0)  # first token index of each segment
    before = jnp.take_along_axis(cs, jnp.clip(first - 1, 0, t - 1)[:, :, None], axis=1)
    before = jnp.where((first >= 1)[:, :, None], before, _U32(0))
    base = before - jnp.where((rr == 0)[:, :, None], a0[:, None, :], _U32(0))
    acc = cs - jnp.take_along_axis(base, seg[:, :, None], axis=1)  # A_j(pos + 1)
    end = start + count
    if t == 1:
        # One token (a decode step): a block it completes ends at that token, so the chain's
        # next key F(g, A(end), end) is the token's own lanes: one finishing mix, not two.
        # (With unit > 1 entry 0 is e_0 = start + 1 exactly when that is a multiple.)
        lanes = _finish(sub, _chain_key(sub, s0)[:, None, :], acc, pos + 1)
        s_new = jnp.where((end // c != q0)[:, None], lanes[:, 0], s0)
    else:
        last = jnp.clip((rr + 1) * c - phase[:, None] - 1, 0, t - 1)
        tot = jnp.take_along_axis(acc, last[:, :, None], axis=1)
        bounds = (q0[:, None] + rr + 1) * c
        heads, g = _chain_run(sub, s0, tot, bounds, bounds <= end[:, None])
        # unit == 1 here (several tokens at a coarser unit take _extend_by_units): every end.
        g_at = jnp.take_along_axis(g, seg[:, :, None], axis=1)
        lanes = _finish(sub, g_at, acc, pos + 1)
        s_new = jnp.take_along_axis(heads, (end // c - q0)[:, None, None], axis=1)[:, 0]
    a_last = jnp.take_along_axis(acc, jnp.clip(count - 1, 0, t - 1)[:, None, None], axis=1)[:, 0]
    a_new = jnp.where((count > 0)[:, None], a_last, a0)
    a_new = jnp.where((end % c == 0)[:, None], _U32(0), a_new)
    return lanes, jnp.concatenate([s_new, a_new], axis=1)


def _extend_by_units(
    chain: jax.Array, tokens: jax.Array, start: jax.Array, count: jax.Array, sub, unit: int
) -> tuple[jax.Array, jax.Array]:
    """:func:`extend_chain` for ``unit > 1`` and more than one token: the tokens are laid
    from the chain-block start at or before ``start`` (shifted by ``start``'s phase, the
    earlier positions masked), so the block sums are :func:`chain_lanes`' per-unit sums and
    a cumulative sum over a block's units (no cumulative sum over ``T`` tokens, no gathers
    of per-token sums), continued from the chain state: ``A`` of the first block starts at
    the state's partial sum. Same words as the per-token path."""
    b, t = tokens.shape
    c = CHAIN_TOKENS
    u = math.gcd(unit, c)
    per = c // u
    n = (c + t - 2) // c + 1  # chain blocks the T positions can touch, whatever the phase
    s0, a0 = chain[:, :LANES], chain[:, LANES:]
    q0 = start // c
    base, phase = q0 * c, start % c
    i = jnp.arange(n * c, dtype=jnp.int32)[None, :]
    laid = jnp.take_along_axis(tokens, jnp.clip(i - phase[:, None], 0, t - 1), axis=1)
    mask = (i >= phase[:, None]) & (i < (phase + count)[:, None])
    acc = _block_sums(sub, laid, base[:, None] + i, mask, u)  # [B, n, per, 4]
    acc = acc.at[:, 0].add(a0[:, None, :])  # block 0 continues the state's partial sum
    end = start + count
    rr = jnp.arange(n, dtype=jnp.int32)[None, :]
    bounds = (q0[:, None] + rr + 1) * c
    heads, g = _chain_run(sub, s0, acc[:, :, -1], bounds, bounds <= end[:, None])
    flat = acc.reshape(b, n * per, LANES)
    # The ends e_j, their u-end on the laid grid and their chain block (clipped: junk
    # beyond what the row's tokens reach).
    m = t // unit + 1
    ends = (start[:, None] // unit + 1 + jnp.arange(m, dtype=jnp.int32)[None, :]) * unit
    at = jnp.clip((ends - base[:, None]) // u - 1, 0, n * per - 1)
    seg = jnp.clip((ends - 1 - base[:, None]) // c, 0, n - 1)
    g_at = jnp.take_along_axis(g, seg[:, :, None], axis=1)
    a_at = jnp.take_along_axis(flat, at[:, :, None], axis=1)
    lanes = _finish(sub, g_at, a_at, ends)
    s_new = jnp.take_along_axis(heads, (end // c - q0)[:, None, None], axis=1)[:, 0]
    # A at `end`: the u-end at or after it (tokens past `end` are masked out of its sum).
    last = jnp.clip(-(-(end - base) // u) - 1, 0, n * per - 1)
    a_end = jnp.take_along_axis(flat, last[:, None, None], axis=1)[:, 0]
    a_new = jnp.where((count > 0)[:, None], a_end, a0)
    a_new = jnp.where((end % c == 0)[:, None], _U32(0), a_new)
    return lanes, jnp.concatenate([s_new, a_new], axis=1)


def add_terms(
    chain: jax.Array, tokens: jax.Array, start: jax.Array, count: jax.Array, term_key: jax.Array
) -> jax.Array:
    """:func:`extend_chain`'s new chain state for rows whose tokens complete no chain block
    (``(start + count) // CHAIN_TOKENS == start // CHAIN_TOKENS``): ``A`` gains their terms,
    ``S`` is unchanged. One term per token and nothing else: no chain step, no finishing mix,
    no lanes (such a row completes no publishable block unless a unit end falls inside).

    Args:
      chain: uint32[B, CHAIN_WORDS], the chain states at ``start``.
      tokens: int32[B, T], the tokens at positions ``start .. start + T - 1``.
      start: int32[B].
      count: int32[B], how many of the T tokens are real.
      term_key: uint32[B, LANES], the rows' term subkeys (``Subkeys.term``).

    Returns:
      uint32[B, CHAIN_WORDS], the chain states at ``start + count`` (wrong for a row whose
      tokens reach a chain-block end: use :func:`extend_chain` for those).
    """
    t = tokens.shape[1]
    offs = jnp.arange(t, dtype=jnp.int32)[None, :]
    terms = _terms(term_key, tokens, start[:, None] + offs, offs < count[:, None])
    acc = chain[:, LANES:] + jnp.sum(terms, axis=1, dtype=_U32)
    return jnp.concatenate([chain[:, :LANES], acc], axis=1)


def keys_from_lanes(lanes: jax.Array, ends: jax.Array, namespace) -> jax.Array:
    """Assembles keys from hash lanes.

    Args:
      lanes: uint32[B, K, LANES] the lanes of the prefixes ending at ``ends``.
      ends: int32[B, K] the prefix lengths.
      namespace: uint32[2] or uint32[B, 2] (or an int / pair).

    Returns:
      uint32[B, K, KEY_WORDS].
    """
    b, k = ends.shape
    ns = _as_namespace(namespace, b)
    ns = jnp.broadcast_to(ns[:, None, :], (b, k, 2))
    return jnp.concatenate([lanes, ns, ends.astype(_U32)[:, :, None]], axis=-1)


def keys_at(
    lanes: jax.Array, unit: int, lengths: jax.Array, namespace, ends: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Keys of the prefixes ending at ``ends``, gathered from ``chain_lanes(...).lanes``.

    Args:
      lanes: uint32[B, N, LANES] from ``chain_lanes(..., unit=unit).lanes``.
      unit: static, the unit ``lanes`` was computed with.
      lengths: int32[B] prompt lengths.
      namespace: as for :func:`chain_lanes`.
      ends: int32[B, K] or int32[K] (shared by every prompt) prefix lengths.

    Returns:
      ``(keys, valid)``: uint32[B, K, KEY_WORDS] and bool[B, K]; ``valid`` is False where the
      prefix is empty, not a multiple of ``unit``, or longer than the prompt (its key is junk).
    """
    check_positive_int("unit", unit)
    b, n, _ = lanes.shape
    ends = jnp.asarray(ends, jnp.int32)
    if ends.ndim == 1:
        ends = jnp.broadcast_to(ends[None, :], (b, ends.shape[0]))
    j = ends // unit - 1
    valid = (ends > 0) & (ends % unit == 0) & (j < n) & (ends <= lengths[:, None])
    at = jnp.take_along_axis(lanes, jnp.clip(j, 0, max(n - 1, 0))[:, :, None], axis=1)
    return keys_from_lanes(at, ends, namespace), valid


def block_keys(
    tokens: jax.Array, lengths: jax.Array, namespace, *, seed, block_tokens: int
) -> tuple[jax.Array, jax.Array]:
    """Keys of every complete block of ``block_tokens`` tokens of each prompt.

    Args:
      tokens: int32[B, L] token ids, padded beyond ``lengths``.
      lengths: int32[B] prompt lengths.
      namespace: uint32[2] or uint32[B, 2] (or an int / pair).
      seed: the secret key seed (as for :func:`chain_lanes`).
      block_tokens: static block span.

    Returns:
      ``(keys, valid)``: uint32[B, L // block_tokens, KEY_WORDS] and bool[B, L // block_tokens];
      block ``i`` (tokens ``[i*B, (i+1)*B)``) is valid iff it lies wholly inside the prompt.
    """
    check_positive_int("block_tokens", block_tokens)
    ph = chain_lanes(tokens, lengths, namespace, seed=seed, unit=block_tokens)
    n = ph.lanes.shape[1]
    ends = (jnp.arange(n, dtype=jnp.int32) + 1) * block_tokens
    return keys_at(ph.lanes, block_tokens, lengths, namespace, ends)
