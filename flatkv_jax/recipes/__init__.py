"""Recipes: model configs turned into cache groups. The core never imports these."""

from flatkv_jax.recipes.deepseek_v4 import (
    PRESETS,
    DeepSeekV4Config,
    deepseek_v4_groups,
    tiny_v4,
    v4_flash,
    v4_pro,
)
from flatkv_jax.recipes.generic import full_attention_groups, hybrid_swa_groups, mla_groups

__all__ = [
    "PRESETS",
    "DeepSeekV4Config",
    "deepseek_v4_groups",
    "full_attention_groups",
    "hybrid_swa_groups",
    "mla_groups",
    "tiny_v4",
    "v4_flash",
    "v4_pro",
]
