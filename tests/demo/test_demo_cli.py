"""`flatkv demo` parsing, error messages, --json shape, report text and the figure (no engine
run: run_demo is replaced by a fabricated report where a run would be needed)."""

import builtins
import json
import re

import pytest
from demo_cases import JSON_KEYS

from flatkv_jax import cli
from flatkv_jax.demo import plot as plot_module
from flatkv_jax.demo import runner
from flatkv_jax.demo.report import DemoReport, GroupOccupancy, Parity, StepSeries, format_report


def fake_report(**kw) -> DemoReport:
    base = dict(
        model="tiny",
        seed=0,
        options={"prefix_cache": True, "overlap": True, "mtp": True},
        plan={
            "name": "tiny",
            "groups": 2,
            "max_requests": 8,
            "max_context": 448,
            "chunk_tokens": 32,
            "verify_width": 2,
            "step_tokens": 32,
            "pool_bytes": 2 << 20,
        },
        sessions=5,
        tenants=3,
        submitted=12,
        served=12,
        aborted=0,
        steps=300,
        wall_s=30.0,
        warmup_s=10.0,
        check_s=2.0,
        prefill_tokens=2000,
        decode_tokens=900,
        prompt_tokens=3000,
        hit_tokens=1000,
        oracle_prompt_tokens=3000,
        oracle_hit_tokens=1000,
        oracle_mismatches=0,
        oracle_notes=(),
        occupancy=(GroupOccupancy("swa_kv", 71, 60, 30.5), GroupOccupancy("c4_kv", 165, 165, 99.0)),
        pages_zeroed=400,
        retractions=2,
        compilations=2,
        compilations_after_warmup=0,
        draft_proposed=800,
        draft_accepted=300,
        parity=Parity((1, 5, 11), 60, 2.5e-6, 1e-5, 0),
    )
    base.update(kw)
    return DemoReport(**base)


def fake_series() -> StepSeries:
    n = 20
    return StepSeries(
        group_names=("swa_kv", "c4_kv"),
        usable=(71, 165),
        in_use=tuple((i, 2 * i) for i in range(n)),
        prefill_tokens=tuple(32 * (i % 3 == 0) for i in range(n)),
        decode_tokens=tuple(6 for _ in range(n)),
        prompt_tokens=tuple(48 * (i % 3 == 0) for i in range(n)),
        hit_tokens=tuple(16 * (i % 3 == 0) for i in range(n)),
    )


def run_cli(capsys, *argv):
    code = cli.main(["demo", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--hbm", "2MiB", "--pages", "64"], "argument --pages: not allowed with argument --hbm"),
        (["--requests", "0"], "--requests=0 is invalid"),
        (["--requests", "ten"], "--requests='ten' is invalid"),
        (["--seed", "-1"], "--seed='-1' is invalid"),
        (["--pages", "0"], "--pages=0 is invalid"),
        (["--hbm", "12XB"], "--hbm='12XB' is invalid"),
        (["--model", "huge"], "argument --model: invalid choice: 'huge'"),
    ],
)
def test_parse_errors_name_the_flag(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", *argv])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--pages", "1"], "flatkv: error: --pages 1: "),
        (["--hbm", "64KiB"], "flatkv: error: --hbm 64KiB: "),
    ],
)
def test_pools_too_small_for_one_request_name_the_flag(capsys, argv, needle):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert needle in err and "Fix" in err


def test_defaults_and_switches():
    args = cli.build_parser().parse_args(["demo"])
    assert (args.requests, args.seed, args.model, args.hbm, args.pages) == (
        40,
        0,
        "tiny",
        None,
        None,
    )
    assert args.prefix_cache and args.overlap and args.mtp and not args.json and args.plot is None
    args = cli.build_parser().parse_args(
        ["demo", "--no-prefix-cache", "--no-overlap", "--no-mtp", "--pages", "99"]
    )
    assert not (args.prefix_cache or args.overlap or args.mtp) and args.pages == 99


def test_json_prints_one_object_with_every_key(capsys, monkeypatch):
    seen = {}

    def fake_run(options, **kw):
        seen["options"] = options
        return fake_report(), fake_series()

    monkeypatch.setattr(runner, "run_demo", fake_run)
    code, out, _ = run_cli(capsys, "--json", "--requests", "12", "--seed", "3", "--no-mtp")
    assert code == 0
    data = json.loads(out)
    assert set(data) == JSON_KEYS
    assert data["prefix"]["oracle_agrees"] is True and data["ok"] is True
    assert data["drafts"]["accepted_rate"] == pytest.approx(0.375)
    assert data["occupancy"]["c4_kv"] == {"usable": 165, "peak": 165, "mean": 99.0}
    o = seen["options"]
    assert (o.requests, o.seed, o.mtp, o.prefix_cache) == (12, 3, False, True)


def test_failed_checks_give_exit_status_1(capsys, monkeypatch):
    bad = fake_report(compilations_after_warmup=2, oracle_hit_tokens=990)
    monkeypatch.setattr(runner, "run_demo", lambda *a, **k: (bad, fake_series()))
    code, out, _ = run_cli(capsys)
    assert code == 1
    assert "compilations after warm-up 2  (must be 0)" in out
    assert "agrees: NO" in out and "SOME CHECKS FAILED" in out


def test_text_report_lines():
    text = format_report(fake_report())
    for line in (
        "requests served            12 / 12",
        "prefix hit rate            0.333  (1,000 of 3,000 prompt tokens)",
        "radix oracle, same trace 0.333  (1,000 of 3,000); agrees: yes",
        "accepted drafts            0.375  (300 of 800 proposed)",
        "retractions                2",
        "pages zeroed               400",
        "compilations after warm-up 0",
        "max |logit error| 2.5e-06 (tolerance 1e-05) over 60 tokens of 3 requests",
        "prefill                    2,000 tokens, 100 tokens/s of serving time",
        "wall time                  30.0 s = warm-up 10.0 s (compiling 2 step functions) + "
        "serving 20.0 s; checks 2.0 s",
        "all checks passed",
    ):
        assert line in text, line
    assert "c4_kv" in text and "165  100%" in text


def test_plot_writes_a_png(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(runner, "run_demo", lambda *a, **k: (fake_report(), fake_series()))
    path = tmp_path / "demo.png"
    code, out, _ = run_cli(capsys, "--plot", str(path))
    assert code == 0 and f"figure written to {path}" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "path, message",
    [
        ("{tmp}/missing/x.png", r"--plot {tmp}/missing/x.png is invalid: its folder '{tmp}/missing' does not exist or cannot be written"),
        ("{tmp}/x.notaformat", r"--plot {tmp}/x.notaformat is invalid: the figure's format comes from the suffix, one of .*Fix: pass e.g. --plot demo.png"),
    ],
)  # fmt: skip
def test_plot_path_is_checked_before_the_run(tmp_path, capsys, monkeypatch, path, message):
    """A path the figure cannot be written to fails in a second, not after the whole run
    (which then lost its report to a traceback)."""

    def must_not_run(*a, **k):
        raise AssertionError("the demo ran although --plot cannot be written")

    monkeypatch.setattr(runner, "run_demo", must_not_run)
    code, out, err = run_cli(capsys, "--plot", path.format(tmp=tmp_path))
    assert code == 2 and out == ""
    assert re.search(message.format(tmp=re.escape(str(tmp_path))), err), err


def test_a_figure_that_fails_after_the_run_keeps_the_report(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(runner, "run_demo", lambda *a, **k: (fake_report(), fake_series()))

    def gone(*a, **k):
        raise FileNotFoundError("the folder went away")

    monkeypatch.setattr(plot_module, "plot_series", gone)
    code, out, err = run_cli(capsys, "--plot", str(tmp_path / "x.png"))
    assert code == 2 and "c4_kv" in out  # the report was printed first
    assert f"--plot {tmp_path / 'x.png'} could not be written: the folder went away" in err


def test_plot_without_matplotlib_names_the_extra(capsys, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    def must_not_run(*a, **k):
        raise AssertionError("the demo ran although --plot cannot be written")

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    monkeypatch.setattr(runner, "run_demo", must_not_run)
    code, out, err = run_cli(capsys, "--plot", "x.png")
    assert code == 2 and out == ""
    assert 'pip install ".[plot]"' in err and "--plot needs matplotlib" in err


def test_progress_bar_renders_on_a_terminal():
    import io

    from rich.console import Console

    from flatkv_jax.demo.cli import Progress

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)

    class Rec:
        index, prefill_tokens, decode_tokens = 4, 32, 6

    with Progress(console) as progress:
        progress.start(12)
        progress.step(Rec(), 5)
        progress.bar.refresh()
    text = buf.getvalue()
    assert "flatkv demo" in text and "5/12" in text and "5 steps, 38 tokens" in text

    quiet = io.StringIO()  # not a terminal (a pipe, CI): no bar, nothing written
    with Progress(Console(file=quiet)) as progress:
        progress.start(12)
        progress.step(Rec(), 5)
    assert progress.bar is None and quiet.getvalue() == ""
