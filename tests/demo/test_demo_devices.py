"""`flatkv demo --devices N`: virtual host devices, per-rank report, error messages.

The end-to-end test runs the command in a fresh Python process without XLA_FLAGS: that
process starts with one CPU device, so serving on 2 ranks proves the command line split the
host platform before JAX started its backend.
"""

import json
import os
import subprocess
import sys

import jax
import pytest
from demo_cases import JSON_KEYS
from test_demo_cli import fake_report, run_cli

from flatkv_jax.demo import cli as demo_cli
from flatkv_jax.demo.report import GroupOccupancy, RankSummary, format_report
from flatkv_jax.demo.runner import TOL_FP32, DemoOptions


def test_demo_devices_2_subprocess_end_to_end():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    argv = ["-m", "flatkv_jax", "demo", "--devices", "2", "--requests", "3", "--no-mtp", "--json"]
    proc = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=env, timeout=1200
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert set(data) == JSON_KEYS
    assert data["devices"] == 2 and data["routing"]["jax_device_count"] == 2
    assert data["requests"] == {"submitted": 3, "served": 3, "aborted": 0}
    ranks = data["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert sum(r["requests"] for r in ranks) == 3 == sum(data["routing"]["requests_per_rank"])
    # One session's three turns share their prefix: affinity keeps them on one rank, and
    # the later turns hit there.
    assert sorted(r["requests"] for r in ranks) == [0, 3]
    assert data["routing"]["routing_misses"] == 0
    assert sum(r["hit_tokens"] for r in ranks) == data["prefix"]["hit_tokens"] > 0
    assert set(ranks[0]["occupancy"]) == set(data["occupancy"])
    assert data["plan"]["total_pool_bytes"] == 2 * data["plan"]["pool_bytes"]
    # The per-rank oracle replays agree; greedy tokens equal dense recompute, hence the
    # one-device run's tokens (which equal it too: tests/demo/test_demo_e2e.py).
    assert data["prefix"]["oracle_agrees"], data["prefix"]["oracle_notes"]
    assert data["parity"]["greedy_mismatches"] == 0
    assert data["parity"]["max_abs_logit_error"] <= TOL_FP32
    assert data["compilations"] == 1 and data["compilations_after_warmup"] == 0
    assert data["ok"] is True


def test_devices_beyond_the_backend_name_the_flag_and_the_fix(capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    n = jax.device_count() + 1
    code, out, err = run_cli(capsys, "--devices", str(n), "--requests", "2")
    assert code == 2 and out == ""
    assert f"--devices {n} is invalid" in err and "jax.device_count()" in err
    assert f"XLA_FLAGS=--xla_force_host_platform_device_count={n}" in err


def test_flag_is_appended_before_the_backend_starts(monkeypatch):
    from jax._src import xla_bridge

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=somewhere")
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    assert demo_cli.request_host_devices(2) == jax.device_count()
    assert os.environ["XLA_FLAGS"] == (
        "--xla_dump_to=somewhere --xla_force_host_platform_device_count=2"
    )


def test_bad_devices_and_routing_flags(capsys):
    for argv, needle in (
        (["--devices", "0"], "--devices=0 is invalid"),
        (["--routing", "nearest"], "argument --routing: invalid choice: 'nearest'"),
    ):
        with pytest.raises(SystemExit) as e:
            run_cli(capsys, *argv)
        assert e.value.code == 2
        assert needle in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--routing='x' is invalid"):
        DemoOptions(routing="x")


def test_report_prints_ranks_and_routing():
    occ = (GroupOccupancy("swa_kv", 71, 30, 10.0), GroupOccupancy("c4_kv", 165, 40, 20.0))
    ranks = (RankSummary(0, 7, 300, 120, occ), RankSummary(1, 5, 200, 0, occ))
    routing = {
        "policy": "affinity",
        "requests_per_rank": [7, 5],
        "balance": 5 / 7,
        "keyed_requests": 11,
        "routing_misses": 1,
        "routing_miss_tokens": 16,
        "jax_device_count": 2,
    }
    report = fake_report(devices=2, ranks=ranks, routing=routing)
    text = format_report(report)
    assert "data-parallel ranks        2; routing affinity: requests per rank 7 / 5" in text
    assert "prefix misses by routing 1 of 11 keyed requests" in text
    assert "rank 0                    7 requests, hit rate 0.400  (120 of 300" in text
    assert "pool occupancy per rank" in text
    data = report.to_dict()
    assert data["ranks"][0]["hit_rate"] == 0.4 and data["routing"]["routing_misses"] == 1
    one = format_report(fake_report())
    assert "data-parallel ranks" not in one and "per rank" not in one


def test_routing_comparison_table():
    from flatkv_jax.demo.routing import format_rows

    row = {
        "policy": "affinity",
        "hit_rate": 0.7024,
        "hit_tokens": 2752,
        "prompt_tokens": 3918,
        "rank_hit_rates": [0.7004, 0.7049],
        "requests_per_rank": [22, 18],
        "balance": 0.8182,
        "routing_misses": 0,
        "keyed_requests": 40,
        "steps": 134,
    }
    text = format_rows([row])
    assert text.splitlines()[0].startswith("| policy | hit rate |")
    assert (
        "| affinity | 0.702 (2,752 of 3,918) | 0.700 / 0.705 | 22 / 18 | 0.82 | 0 of 40 | 134 |"
        in text
    )
