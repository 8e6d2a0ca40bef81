"""Token-derived row contents: what the harness writes so a gather proves the mapping.

Row ``j`` of group ``g`` of a request is completed by the token at position
``p = (j + 1) * tokens_per_row - 1``; its content is a function of ``(namespace, tokens[0..p],
group, field, layer)`` only. A prefix hit is correct iff every hit row reads exactly the
values the request would have written itself, so comparing a gather with :func:`row_values`
checks hits absolutely (not only oracle against device). Values are never all zero, so a
hole (the null page) or an unzeroed recycled page is told apart from written content.
"""

from __future__ import annotations

import numpy as np

from flatkv_jax.formats import RowFormat

_FNV_PRIME = 0x01000193
_FNV_BASIS = 0x811C9DC5
_MASK = 0xFFFFFFFF

# Largest modulus whose values the dtype holds exactly.
_MODULUS = {
    "float32": 1 << 20,
    "float16": 1 << 11,
    "bfloat16": 1 << 8,
    "uint8": 1 << 8,
    "int8": 1 << 7,
    "int32": 1 << 30,
}


def prefix_hashes(
    namespace: int, tokens: list[int], start: int = 0, seed: int | None = None
) -> list[int]:
    """32-bit FNV-1a hashes of ``namespace`` + ``tokens[:p + 1]`` for ``p in [start, len)``.

    Args:
      namespace: the request's namespace.
      tokens: the request's tokens.
      start: first position to hash; ``seed`` must then be the hash at ``start - 1``.
      seed: the hash of the prefix before ``start`` (``None``: start from the namespace).
    """
    h = seed if seed is not None else ((_FNV_BASIS ^ (namespace & _MASK)) * _FNV_PRIME) & _MASK
    out = []
    for t in tokens[start:]:
        h = ((h ^ (t & _MASK)) * _FNV_PRIME) & _MASK
        out.append(h)
    return out


def row_values(hashes: np.ndarray, salt: int, fmt: RowFormat) -> np.ndarray:
    """Contents of rows whose completing-token hashes are ``hashes``.

    Args:
      hashes: ``uint32``-valued ints ``[K]``.
      salt: distinguishes (group, field, layer), e.g. ``(g * 64 + f) * 1024 + layer``.
      fmt: the field's row format.

    Returns:
      ``[K, *fmt.shape]`` in ``fmt``'s dtype; every element in ``[1, modulus)``, exact.
    """
    m = _MODULUS[fmt.dtype]
    h = (
        np.asarray(hashes, np.uint64) * np.uint64(2 * salt + 1) + np.uint64(salt * 0x9E3779B1)
    ) & np.uint64(_MASK)
    h ^= h >> np.uint64(13)
    size = int(np.prod(fmt.shape))
    ramp = np.arange(size, dtype=np.uint64) * np.uint64(7)
    vals = (h[:, None] + ramp[None, :]) % np.uint64(m - 1) + np.uint64(1)
    return vals.astype(np.float64).astype(fmt.np_dtype).reshape(len(h), *fmt.shape)


def salt(group: int, field: int, layer: int) -> int:
    """The salt of one (group, field, layer) pool array."""
    return (group * 64 + field) * 1024 + layer
