"""The ``flatkv plan`` command."""

import json
import subprocess
import sys

import pytest

from flatkv_jax.cli import in_flag_terms, main

TINY = ["--model", "tiny-v4", "--max-requests", "2", "--max-context", "32", "--chunk", "8"]


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
    assert err.startswith("flatkv: error: --hbm 1GiB is invalid: the budget is too small")


def test_console_script_runs():
    r = subprocess.run([sys.executable, "-m", "flatkv_jax.cli", "plan", "--model", "tiny-v4", "--pages", "64",
                        "--max-requests", "2", "--max-context", "32", "--chunk", "8", "--verify", "1"],
                       capture_output=True, text=True, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "prefix granularity 16 tokens" in r.stdout


def _usage_error(capsys, argv: list[str]) -> str:
    """Runs ``flatkv`` with bad flags: argparse exits with status 2 and one error line."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_pages_and_hbm_are_exclusive(capsys):
    err = _usage_error(capsys, ["plan", "--hbm", "80GiB", "--pages", "100"])
    assert err == "flatkv plan: error: argument --pages: not allowed with argument --hbm"
    # --cached-window-requests sizes pools from a budget: with --pages it would be ignored.
    err = _usage_error(capsys, ["plan", "--pages", "100", "--cached-window-requests", "4"])
    assert err == (
        "flatkv plan: error: argument --cached-window-requests: not allowed with argument "
        "--pages (it sizes the window pools from the --hbm budget; --pages sets every pool's "
        "pages itself)"
    )


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--hbm", "-5GiB", "argument --hbm: '-5GiB' is invalid: a size must be positive. Fix: pass e.g. --hbm 80GiB"),
        ("--hbm", "0", "argument --hbm: '0' is invalid: a size must be positive. Fix: pass e.g. --hbm 80GiB"),
        ("--max-context", "-5", "argument --max-context: '-5' is invalid: a size must be positive. Fix: pass e.g. --max-context 80k"),
        ("--max-context", "-80k", "argument --max-context: '-80k' is invalid: a size must be positive"),
        ("--chunk", "-8", "argument --chunk: '-8' is invalid: a size must be positive. Fix: pass e.g. --chunk 8192"),
        ("--hbm", "abc", "argument --hbm: 'abc' is invalid: expected a number with an optional unit (k, M, G, KiB, MiB, GiB, TiB). Fix: pass e.g. --hbm 80GiB or 80k."),
        ("--pages", "-3", "argument --pages: -3 is invalid: it must be positive. Fix: pass --pages 1 or more"),
        ("--pages", "0", "argument --pages: 0 is invalid: it must be positive. Fix: pass --pages 1 or more"),
        ("--pages", "x", "argument --pages: 'x' is invalid: it must be a whole number. Fix: pass --pages as an integer, e.g. --pages 1"),
        ("--max-requests", "-1", "argument --max-requests: -1 is invalid: it must be positive. Fix: pass --max-requests 1 or more"),
        ("--verify", "-1", "argument --verify: -1 is invalid: it must be >= 0. Fix: pass --verify 0 or more"),
        ("--cached-window-requests", "-1", "argument --cached-window-requests: -1 is invalid: it must be >= 0. Fix: pass --cached-window-requests 0 or more"),
    ],
)  # fmt: skip
def test_bad_values_name_the_flag_and_the_rule(capsys, flag, value, message):
    """Negative sizes say so (``--hbm -5GiB`` is not mistaken for an option)."""
    assert _usage_error(capsys, ["plan", flag, value]).startswith(f"flatkv plan: error: {message}")


def test_plan_errors_name_the_flags_the_user_typed(capsys):
    assert main(["plan", *TINY, "--pages", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flatkv: error: --pages 3 is invalid (pool swa_kv): one request at")
    assert "num_pages" not in err and "max_context" not in err and "chunk_tokens" not in err
    assert "--max-context=32" in err and "--chunk" in err
    assert main(["plan", "--hbm", "1GiB", "--max-requests", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flatkv: error: --hbm 1GiB is invalid: the budget is too small")
    assert "max_requests" not in err and "--max-requests" in err


def test_library_field_names_become_flags():
    msg = (
        "num_pages[c4_kv]=12 is invalid: needs 14 pages; lower max_context or chunk_tokens or "
        "verify_width. Fix: raise hbm_bytes."
    )
    args = main.__globals__["build_parser"]().parse_args(["plan", "--pages", "10"])
    assert in_flag_terms(msg, args) == (
        "--pages 10 is invalid (pool c4_kv): needs 14 pages; lower --max-context or --chunk or "
        "--verify. Fix: raise --hbm."
    )
    args = main.__globals__["build_parser"]().parse_args(["plan"])
    assert in_flag_terms("hbm_bytes=85899345920 is invalid: too small. Fix: x.", args) == (
        "--hbm 80GiB is invalid: too small. Fix: x."
    )


def test_closed_stdout_ends_quietly():
    """``flatkv plan | head -1``: the reader goes away before the report is written."""
    cmd = [sys.executable, "-m", "flatkv_jax.cli", "plan", *TINY, "--pages", "64", "--verify", "1"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # closed before the child (still importing jax) writes anything
    err = p.stderr.read().decode()
    assert p.wait() == 1
    assert err == "", err


def test_version(capsys):
    from flatkv_jax import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"flatkv {__version__}"
