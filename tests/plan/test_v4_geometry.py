"""Golden V4-Flash / V4-Pro geometry, computed from the published config values."""

import pytest

from flatkv_jax import Owner, Retention, ServingLimits, plan_for_budget
from flatkv_jax.recipes import deepseek_v4_groups, v4_flash, v4_pro

FLASH_RATIOS = (0, 0, *((4, 128) * 20), 4)


def test_flash_config_matches_published_layers():
    cfg = v4_flash()
    assert cfg.compress_ratios == FLASH_RATIOS
    assert cfg.num_layers == 43 and cfg.mtp_layers == (43,)
    assert len(cfg.layers_with_ratio(0)) == 2
    assert len(cfg.layers_with_ratio(4)) == 21
    assert len(cfg.layers_with_ratio(128)) == 20


def test_pro_config_matches_published_layers():
    cfg = v4_pro()
    assert cfg.num_layers == 61 and cfg.compress_ratios[:3] == (128, 128, 4)
    assert len(cfg.layers_with_ratio(4)) == 30
    assert len(cfg.layers_with_ratio(128)) == 31
    assert cfg.index_topk == 1024


def test_flash_groups_golden():
    groups = deepseek_v4_groups(v4_flash(), verify_width=4)
    got = {
        g.name: (
            g.retention,
            g.window,
            g.rows_per_page,
            g.tokens_per_row,
            g.block_tokens,
            g.row_bytes,
            g.num_layers,
            g.owner,
        )
        for g in groups
    }
    H, W = Retention.HISTORY, Retention.WINDOW
    T, D = Owner.TARGET, Owner.DRAFT
    assert got == {
        "swa_kv": (W, 128, 64, 1, 64, 584, 43, T),
        "mtp_swa_kv": (W, 128, 64, 1, 64, 584, 1, D),
        "c4_kv": (H, None, 32, 4, 128, 584 + 68, 21, T),
        "c4_state": (W, 8, 4, 1, 4, 8192, 21, T),
        "c4_index_state": (W, 8, 4, 1, 4, 2048, 21, T),
        "c128_kv": (H, None, 1, 128, 128, 584, 20, T),
        "c128_state": (W, 136, 8, 1, 8, 4096, 20, T),
    }
    by = {g.name: g for g in groups}
    assert by["swa_kv"].layers == tuple(range(43))
    assert by["mtp_swa_kv"].layers == (43,)
    assert by["c4_kv"].layers == tuple(range(2, 43, 2))
    assert by["c128_kv"].layers == tuple(range(3, 43, 2))
    assert [f.name for f in by["c4_kv"].fields] == ["kv", "index_key"]


def test_flash_history_cost_per_token():
    groups = deepseek_v4_groups(v4_flash(), verify_width=4)
    # 21 x (584 + 68) / 4 + 20 x 584 / 128 = 3423 + 91.25
    assert sum(g.bytes_per_token() for g in groups) == pytest.approx(3514.25)


@pytest.mark.parametrize(("verify", "window"), [(0, 8), (4, 8), (5, 12), (12, 16)])
def test_ratio4_state_window_covers_verify(verify, window):
    groups = {g.name: g for g in deepseek_v4_groups(v4_flash(), verify_width=verify)}
    assert groups["c4_state"].window == window == groups["c4_index_state"].window
    assert window >= max(8, 4 + verify)


def test_flash_table_widths():
    groups = deepseek_v4_groups(v4_flash(), verify_width=4)
    plan = plan_for_budget(groups, ServingLimits(64, 80_000, 8192, 4), "80GiB")
    widths = {g.name: plan.table_width(g) for g in groups}
    assert widths == {
        "swa_kv": 1251,  # ceil(80004 / 64)
        "mtp_swa_kv": 1251,
        "c4_kv": 626,  # ceil(80004 / 128)
        "c4_state": 20001,  # ceil(80004 / 4)
        "c4_index_state": 20001,
        "c128_kv": 626,
        "c128_state": 10001,  # ceil(80004 / 8)
    }
    assert plan.table_shape("c4_state") == (64, 20001)
