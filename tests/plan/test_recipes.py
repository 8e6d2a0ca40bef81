"""Generic recipes and the tiny V4: the same core expresses MHA, MLA and full+SWA models."""

import pytest

from flatkv_jax import (
    FieldSpec,
    GroupSpec,
    Owner,
    Retention,
    ServingLimits,
    formats,
    memory_report,
    plan_with_pages,
)
from flatkv_jax.recipes import (
    deepseek_v4_groups,
    full_attention_groups,
    hybrid_swa_groups,
    mla_groups,
    tiny_v4,
    v4_flash,
)

LIMITS = ServingLimits(max_requests=4, max_context=256, chunk_tokens=32)


def test_small_mha_plan():
    groups = full_attention_groups(
        num_layers=2, num_kv_heads=4, head_dim=16, dtype="float32", rows_per_page=8
    )
    (g,) = groups
    assert g.retention is Retention.HISTORY and g.block_tokens == 8
    assert [f.name for f in g.fields] == ["k", "v"] and g.row_bytes == 2 * 4 * 16 * 4
    plan = plan_with_pages(groups, LIMITS, 200)
    assert plan.table_width("kv") == 32 and plan.pool_shape("kv", "k") == (202, 8, 4, 16)
    assert plan.token_capacity == (200 - 4) * 8
    assert plan.fixed_bytes_per_request() == 0


def test_small_mla_plan():
    groups = mla_groups(num_layers=3, kv_lora_rank=32, rope_dim=8, rows_per_page=16)
    (g,) = groups
    assert g.fields[0].format.shape == (40,) and g.row_bytes == 80 and g.num_layers == 3
    plan = plan_with_pages(groups, LIMITS, 64)
    assert plan.pool_bytes(g) == 66 * 16 * 80 * 3
    assert memory_report(plan).history_bytes_per_token == 80 * 3


def test_full_plus_swa_hybrid_plan():
    groups = hybrid_swa_groups("SSSF" * 2, num_kv_heads=2, head_dim=8, window=32, rows_per_page=8)
    full, swa = groups
    assert full.layers == (3, 7) and swa.layers == (0, 1, 2, 4, 5, 6)
    assert swa.is_window and swa.window == 32
    plan = plan_with_pages(groups, LIMITS, {"full_kv": 150, "swa_kv": 40})
    # a window group needs only the live blocks of each request, not its whole history
    assert plan.min_usable_pages(swa) == swa.live_blocks(32) < plan.min_usable_pages(full)
    assert plan.fixed_bytes_per_request() == swa.live_blocks(1) * swa.page_bytes


def test_tiny_v4_has_every_group_kind():
    groups = deepseek_v4_groups(tiny_v4(), verify_width=2)
    names = [g.name for g in groups]
    assert names == [
        "swa_kv",
        "mtp_swa_kv",
        "c4_kv",
        "c4_state",
        "c4_index_state",
        "c16_kv",
        "c16_state",
    ]
    by = {g.name: g for g in groups}
    assert by["mtp_swa_kv"].owner is Owner.DRAFT
    assert by["c4_kv"].tokens_per_row == 4 and by["c16_kv"].tokens_per_row == 16
    assert (
        by["c4_state"].window == 8 and by["c16_state"].window == 20
    )  # max(16, 16 + 2) -> whole pages of 4


def test_tiny_v4_verify_too_wide_for_state_window_grows_the_window():
    groups = {g.name: g for g in deepseek_v4_groups(tiny_v4(), verify_width=7)}
    assert groups["c4_state"].window == 12  # 4 + 7 -> whole pages of 4


def test_recipes_do_not_share_core_branches():
    # the core knows no model names: a hand-built group works the same as a recipe's
    g = GroupSpec(
        "anything",
        Retention.WINDOW,
        4,
        1,
        (0,),
        (FieldSpec("x", formats.plain(8, "float32")),),
        window=8,
    )
    plan = plan_with_pages((g,), LIMITS, 64)
    assert plan.prefix_granularity == 4
    assert g.hit_reach == 7  # a sliding window: the first computed token reads 7 back


def test_a_period_narrows_the_hit_reach_and_joins_the_granularity():
    """A window group with a period (a compressor's state) needs only its carry behind a hit
    boundary, and hits land on its period boundaries: the granularity is a multiple of it."""
    field = (FieldSpec("x", formats.plain(8, "float32")),)
    st = GroupSpec("st", Retention.WINDOW, 4, 1, (0,), field, window=12, period=8, carry=4)
    bare = GroupSpec("st", Retention.WINDOW, 4, 1, (0,), field, window=12, period=8)
    assert (st.hit_reach, bare.hit_reach) == (4, 0)
    assert plan_with_pages((st,), LIMITS, 64).prefix_granularity == 8  # 4-token pages, period 8
    groups = deepseek_v4_groups(v4_flash(), verify_width=0)
    reach = {g.name: (g.period, g.carry, g.hit_reach) for g in groups if g.is_window}
    assert reach == {
        "swa_kv": (None, 0, 127),
        "mtp_swa_kv": (None, 0, 127),
        "c4_state": (4, 4, 4),
        "c4_index_state": (4, 4, 4),
        "c128_state": (128, 0, 0),
    }


@pytest.mark.parametrize(
    ("make", "exc", "match"),
    [
        (lambda: GroupSpec("swa", Retention.WINDOW, 64, 1, (0,), (FieldSpec("kv", formats.plain(8)),), window=100), ValueError,
         r"window=100 is invalid: group 'swa': a window must be covered by whole pages of 64 tokens"),
        (lambda: GroupSpec("swa", Retention.WINDOW, 4, 1, (0,), (FieldSpec("kv", formats.plain(8)),)), ValueError,
         r"window=None is invalid: window group 'swa' needs a window in tokens"),
        (lambda: GroupSpec("h", Retention.HISTORY, 4, 1, (0,), (FieldSpec("kv", formats.plain(8)),), window=8), ValueError,
         r"window=8 is invalid: history group 'h' keeps everything and takes no window"),
        (lambda: GroupSpec("h", Retention.HISTORY, 0, 1, (0,), (FieldSpec("kv", formats.plain(8)),)), ValueError,
         r"rows_per_page=0 is invalid: it must be positive"),
        (lambda: GroupSpec("h", Retention.HISTORY, 4, 1, (), (FieldSpec("kv", formats.plain(8)),)), ValueError,
         r"layers=\(\) is invalid: group 'h' must be used by at least one layer"),
        (lambda: GroupSpec("h", Retention.HISTORY, 4, 1, (0, 0), (FieldSpec("kv", formats.plain(8)),)), ValueError,
         r"layers=\(0, 0\) is invalid: layer indices must be distinct"),
        (lambda: GroupSpec("h", Retention.HISTORY, 4, 1, (0,), (FieldSpec("kv", formats.plain(8)), FieldSpec("kv", formats.plain(8)))), ValueError,
         r"fields=\['kv', 'kv'\] is invalid: field names must be unique"),
        (lambda: GroupSpec("h", "history", 4, 1, (0,), (FieldSpec("kv", formats.plain(8)),)), TypeError,
         r"retention='history' is invalid: it must be a Retention"),
        (lambda: GroupSpec("my-group", Retention.HISTORY, 4, 1, (0,), (FieldSpec("kv", formats.plain(8)),)), ValueError,
         r"group name='my-group' is invalid: a group name must be a Python identifier"),
        (lambda: GroupSpec("st", Retention.WINDOW, 4, 1, (0,), (FieldSpec("kv", formats.plain(8)),), window=8, carry=4), ValueError,
         r"carry=4 is invalid: group 'st': carry is the reach behind a period boundary and needs a period. Fix: pass period="),
        (lambda: GroupSpec("h", Retention.HISTORY, 4, 1, (0,), (FieldSpec("kv", formats.plain(8)),), period=4), ValueError,
         r"period=4 is invalid: history group 'h' keeps everything: a period only narrows what a window group's prefix hit needs"),
        (lambda: GroupSpec("st", Retention.WINDOW, 4, 1, (0,), (FieldSpec("kv", formats.plain(8)),), window=8, period=0), ValueError,
         r"period=0 is invalid: it must be positive"),
        (lambda: GroupSpec("st", Retention.WINDOW, 4, 1, (0,), (FieldSpec("kv", formats.plain(8)),), window=8, period=4, carry=-1), ValueError,
         r"carry=-1 is invalid: it must be >= 0"),
        (lambda: GroupSpec("st", Retention.WINDOW, 4, 1, (0,), (FieldSpec("kv", formats.plain(8)),), window=8, period=8, carry=4), ValueError,
         r"period=8 is invalid: group 'st': the token that ends a period reads the period and the carry \(8 \+ 4 tokens\), more than its window of 8. Fix: use a window of at least 12"),
        (lambda: FieldSpec("kv", "fp8"), TypeError, r"format='fp8' is invalid: a field needs a RowFormat"),
        (lambda: tiny_v4(window=6, rows_per_page=4) and deepseek_v4_groups(tiny_v4(window=6, rows_per_page=4)), ValueError,
         r"window=6 is invalid: the sliding window must be covered by whole SWA pages of 4 tokens"),
        (lambda: tiny_v4(kv_format="int4"), ValueError, r"kv_format='int4' is invalid: one of"),
        (lambda: hybrid_swa_groups("FXS", 1, 8, 8), ValueError, r"layer_kinds='FXS' is invalid"),
        (lambda: deepseek_v4_groups(tiny_v4(), verify_width=-2), ValueError, r"verify_width=-2 is invalid: it must be >= 0"),
    ],
)  # fmt: skip
def test_group_and_recipe_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_plan_errors():
    g = full_attention_groups(1, 1, 8)
    with pytest.raises(
        ValueError, match=r"groups=\['kv', 'kv'\] is invalid: group names must be unique"
    ):
        plan_with_pages(g + g, LIMITS, 64)
    plan = plan_with_pages(g, LIMITS, 64)
    with pytest.raises(ValueError, match=r"group='swa' is invalid: this plan has groups \['kv'\]"):
        plan.group("swa")
