"""The on-device prefix index: content keys, per-group hash tables, LRU of cached-only pages,
and prefix matching. See ``docs/prefix.md``.

Modules:

- :mod:`~flatkv_jax.prefix.keys`: chained 128-bit block keys from token ids, keyed by a secret seed (+ namespace).
- :mod:`~flatkv_jax.prefix.index`: :class:`PrefixIndex`, key -> page, first publisher wins;
  :class:`PrefixIndexSet`, every group's index in one set of arrays.
- :mod:`~flatkv_jax.prefix.lru`: :class:`CachedLRU`, eviction order of cached-only pages;
  :class:`CachedLRUSet`, every pool's LRU in one set of arrays.
- :mod:`~flatkv_jax.prefix.match`: :func:`match_prompts`, the common hit across groups.
"""

from flatkv_jax.prefix import index, keys, lru, match
from flatkv_jax.prefix.index import (
    PrefixIndex,
    PrefixIndexSet,
    create_index,
    create_index_set,
    create_indexes,
)
from flatkv_jax.prefix.keys import (
    CHAIN_TOKENS,
    CHAIN_WORDS,
    KEY_WORDS,
    LANES,
    SEED_WORDS,
    PromptHash,
    block_keys,
    chain_lanes,
    chain_state,
    extend_chain,
    keys_at,
    keys_from_lanes,
    namespace_words,
    new_seed,
    seed_words,
)
from flatkv_jax.prefix.lru import CachedLRU, CachedLRUSet, create_lru, create_lru_set, create_lrus
from flatkv_jax.prefix.match import MatchLayout, PrefixMatch, match_prompts

__all__ = [
    "CHAIN_TOKENS",
    "CHAIN_WORDS",
    "KEY_WORDS",
    "LANES",
    "SEED_WORDS",
    "CachedLRU",
    "CachedLRUSet",
    "MatchLayout",
    "PrefixIndex",
    "PrefixIndexSet",
    "PrefixMatch",
    "PromptHash",
    "block_keys",
    "chain_lanes",
    "chain_state",
    "create_index",
    "create_index_set",
    "create_indexes",
    "create_lru",
    "create_lru_set",
    "create_lrus",
    "extend_chain",
    "index",
    "keys",
    "keys_at",
    "keys_from_lanes",
    "lru",
    "match",
    "match_prompts",
    "namespace_words",
    "new_seed",
    "seed_words",
]
