"""The ``flatkv plan`` command."""

import json
import subprocess
import sys

from flatkv_jax.cli import main


def test_plan_prints_the_report(capsys):
    assert (
        main(
            [
                "plan",
                "--model",
                "v4-flash",
                "--hbm",
                "80GiB",
                "--max-requests",
                "64",
                "--max-context",
                "80k",
                "--chunk",
                "8192",
                "--verify",
                "4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for name in (
        "swa_kv",
        "mtp_swa_kv",
        "c4_kv",
        "c128_kv",
        "c4_state",
        "c4_index_state",
        "c128_state",
    ):
        assert name in out
    assert "token capacity 22," in out


def test_plan_json(capsys):
    assert main(["plan", "--model", "v4-pro", "--hbm", "120GiB", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["name"] == "v4-pro" and d["token_capacity"] > 20_000_000


def test_plan_explicit_pages(capsys):
    assert (
        main(
            [
                "plan",
                "--model",
                "tiny-v4",
                "--pages",
                "100",
                "--max-requests",
                "4",
                "--max-context",
                "64",
                "--chunk",
                "16",
                "--verify",
                "2",
                "--json",
            ]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    assert all(g["pages"] == 102 for g in d["groups"])


def test_plan_error_is_a_message_not_a_traceback(capsys):
    assert main(["plan", "--hbm", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flatkv: error: hbm_bytes=1073741824 is invalid: the budget is too small")


def test_console_script_runs():
    r = subprocess.run([sys.executable, "-m", "flatkv_jax.cli", "plan", "--model", "tiny-v4", "--pages", "64",
                        "--max-requests", "2", "--max-context", "32", "--chunk", "8", "--verify", "1"],
                       capture_output=True, text=True, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "prefix granularity 16 tokens" in r.stdout
