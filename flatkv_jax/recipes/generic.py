"""Generic recipes on the same core: full attention (MHA/GQA), MLA, and full + sliding window."""

from __future__ import annotations

from flatkv_jax import formats
from flatkv_jax.errors import check_positive_int, fail
from flatkv_jax.groups import FieldSpec, GroupSpec, Retention


def full_attention_groups(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: str = "bfloat16",
    rows_per_page: int = 16,
) -> tuple[GroupSpec, ...]:
    """MHA/GQA: one history group with a ``k`` and a ``v`` field of ``[num_kv_heads, head_dim]``."""
    check_positive_int("num_layers", num_layers)
    check_positive_int("num_kv_heads", num_kv_heads)
    check_positive_int("head_dim", head_dim)
    row = formats.plain((num_kv_heads, head_dim), dtype)
    return (
        GroupSpec(
            "kv",
            Retention.HISTORY,
            rows_per_page,
            1,
            tuple(range(num_layers)),
            (FieldSpec("k", row), FieldSpec("v", row)),
        ),
    )


def mla_groups(
    num_layers: int,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    *,
    dtype: str = "bfloat16",
    rows_per_page: int = 64,
) -> tuple[GroupSpec, ...]:
    """MLA (DeepSeek V2/V3 style): one history group with one shared latent row per token."""
    check_positive_int("num_layers", num_layers)
    check_positive_int("kv_lora_rank", kv_lora_rank)
    check_positive_int("rope_dim", rope_dim)
    row = formats.plain(kv_lora_rank + rope_dim, dtype)
    return (
        GroupSpec(
            "latent",
            Retention.HISTORY,
            rows_per_page,
            1,
            tuple(range(num_layers)),
            (FieldSpec("kv", row),),
        ),
    )


def hybrid_swa_groups(
    layer_kinds: str,
    num_kv_heads: int,
    head_dim: int,
    window: int,
    *,
    dtype: str = "bfloat16",
    rows_per_page: int = 16,
) -> tuple[GroupSpec, ...]:
    """Full + sliding-window hybrid: ``layer_kinds`` is a string of ``F`` (full) and ``S`` (window).

    Example: ``"SSSF" * 6`` for a model with one full layer in four.
    """
    if not layer_kinds or set(layer_kinds) - {"F", "S"}:
        fail(
            "layer_kinds",
            layer_kinds,
            "a non-empty string of 'F' (full) and 'S' (sliding window)",
            "pass e.g. 'SSSF'",
        )
    row = formats.plain((num_kv_heads, head_dim), dtype)
    fields = (FieldSpec("k", row), FieldSpec("v", row))
    full = tuple(i for i, k in enumerate(layer_kinds) if k == "F")
    swa = tuple(i for i, k in enumerate(layer_kinds) if k == "S")
    groups = []
    if full:
        groups.append(GroupSpec("full_kv", Retention.HISTORY, rows_per_page, 1, full, fields))
    if swa:
        groups.append(
            GroupSpec("swa_kv", Retention.WINDOW, rows_per_page, 1, swa, fields, window=window)
        )
    return tuple(groups)
