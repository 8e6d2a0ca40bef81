"""``flatkv demo``: the command-line front of :func:`flatkv_jax.demo.runner.run_demo`.

``flatkv demo`` serves the built-in agentic workload on the tiny V4 model with a progress bar
and prints the report; ``--json`` prints the report as one JSON object instead; ``--plot
out.png`` also writes the figure. See docs/serving.md ("flatkv demo").
"""

from __future__ import annotations

import argparse
import sys

from flatkv_jax.capacity import parse_size


def _positive_int(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag}={text!r} is invalid: it must be a whole number. Fix: pass e.g. {flag} 8."
            ) from None
        if value < 1:
            raise argparse.ArgumentTypeError(
                f"{flag}={value} is invalid: it must be >= 1. Fix: pass {flag} 1 or more."
            )
        return value

    return parse


def _nonnegative_int(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < 0:
            raise argparse.ArgumentTypeError(
                f"{flag}={text!r} is invalid: it must be a whole number >= 0. Fix: pass e.g. "
                f"{flag} 0."
            )
        return value

    return parse


def _size(flag: str):
    def parse(text: str) -> str:
        try:
            parse_size(text, flag)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text

    return parse


def add_demo_parser(subparsers) -> argparse.ArgumentParser:
    """Registers ``flatkv demo`` on the ``flatkv`` command's subparsers."""
    from flatkv_jax.demo.runner import DEFAULT_HBM, MODELS

    p = subparsers.add_parser(
        "demo",
        help="serve a built-in agentic workload on the tiny V4 model and report (start here)",
        description=(
            "Serve a synthetic multi-tenant, multi-turn workload on the tiny DeepSeek-V4 model "
            "(random weights) through the serving engine, then report throughput, prefix hits "
            "(checked against the radix oracle), pool occupancy, compilations and a parity "
            "check against dense recompute."
        ),
    )
    p.add_argument(
        "--requests",
        type=_positive_int("--requests"),
        default=40,
        help="requests (turns) in the workload (default 40; serving them takes seconds, compiling the step function about a minute on 2 CPU cores)",
    )
    p.add_argument(
        "--seed",
        type=_nonnegative_int("--seed"),
        default=0,
        help="workload and weight seed (default 0)",
    )
    p.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="tiny",
        help="; ".join(f"{k}: {v[2]}" for k, v in sorted(MODELS.items())) + " (default tiny)",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--hbm",
        type=_size("--hbm"),
        default=None,
        help=f"pool budget, e.g. 2MiB (default {DEFAULT_HBM}: small, so pools fill and evict)",
    )
    size.add_argument(
        "--pages",
        type=_positive_int("--pages"),
        default=None,
        help="usable pages of every pool instead of --hbm",
    )
    p.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="never reuse cached prefixes",
    )
    p.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="read each step's results before dispatching the next",
    )
    p.add_argument(
        "--mtp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="speculative decoding with the MTP draft layer (default on)",
    )
    p.add_argument(
        "--impl",
        choices=("reference", "pallas"),
        default="reference",
        help="page kernels: plain jnp reference (default) or Pallas",
    )
    p.add_argument(
        "--devices",
        type=_positive_int("--devices"),
        default=1,
        help="data-parallel ranks, one device each (default 1); on CPU the demo asks XLA for "
        "that many virtual host devices (XLA_FLAGS) before JAX starts",
    )
    p.add_argument(
        "--routing",
        choices=("affinity", "least_loaded"),
        default="affinity",
        help="how requests pick a rank with --devices > 1: prefix affinity (default) or "
        "least loaded (docs/routing.md)",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument(
        "--plot",
        metavar="OUT.png",
        default=None,
        help='write a figure (pool occupancy, hit rate, tokens per step); needs pip install ".[plot]"',
    )
    p.set_defaults(func=demo_command)
    return p


def demo_command(args: argparse.Namespace) -> int:
    """Runs the demo for parsed arguments; returns the exit status (0: every check passed)."""
    from flatkv_jax.demo.plot import (
        MissingExtraError,
        check_plot_path,
        plot_series,
        require_matplotlib,
    )
    from flatkv_jax.demo.report import format_report
    from flatkv_jax.demo.runner import DemoOptions, prepare, run_demo

    if args.plot is not None:
        try:
            check_plot_path(args.plot, require_matplotlib())  # fail now, not after the run
        except (MissingExtraError, ValueError) as e:
            print(f"flatkv: error: {e}", file=sys.stderr)
            return 2
    if args.devices > 1:
        try:
            request_host_devices(args.devices)
        except ValueError as e:
            print(f"flatkv: error: {e}", file=sys.stderr)
            return 2
    try:
        options = DemoOptions(
            model=args.model,
            requests=args.requests,
            seed=args.seed,
            hbm=args.hbm,
            pages=args.pages,
            prefix_cache=args.prefix_cache,
            overlap=args.overlap,
            mtp=args.mtp,
            impl=args.impl,
            devices=args.devices,
            routing=args.routing,
        )
        prepared = prepare(options)
    except ValueError as e:
        # Reported here, in the demo's own flag terms, before anything compiles.
        print(f"flatkv: error: {e}", file=sys.stderr)
        return 2
    with Progress() as progress:
        report, series = run_demo(
            options, prepared=prepared, on_start=progress.start, on_step=progress.step
        )
    # The report first: a figure that still fails to write (the folder went away during
    # the run) must not lose it.
    if args.json:
        print(report.to_json())
    else:
        print(format_report(report))
    if args.plot is not None:
        title = (
            f"flatkv demo: {report.model}, {report.submitted} requests, seed {report.seed}, "
            f"hit rate {report.hit_rate:.2f}"
        )
        try:
            plot_series(series, args.plot, title=title)
        except OSError as e:
            print(f"flatkv: error: --plot {args.plot} could not be written: {e}", file=sys.stderr)
            return 2
        if not args.json:
            print(f"figure written to {args.plot}")
    return 0 if report.ok else 1


FORCE_DEVICES = "--xla_force_host_platform_device_count"


def request_host_devices(n: int) -> int:
    """Makes ``n`` devices available for ``--devices n``; returns ``jax.device_count()``.

    Before JAX initializes its backend, appends ``--xla_force_host_platform_device_count=n``
    to ``XLA_FLAGS`` (kept otherwise; a later copy of the flag wins), so the CPU platform
    is split into ``n`` virtual devices. Importing JAX does not fix the device count, its
    first use does: the flag works as long as nothing has asked JAX for a device yet.

    Raises:
      ValueError: fewer than ``n`` devices exist (the backend was already started with
        fewer, or the platform has fewer); the message names ``--devices`` and the fix.
    """
    import os

    import jax

    try:
        from jax._src import xla_bridge

        started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # a JAX without the probe: set it anyway
        started = False
    if not started:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} {FORCE_DEVICES}={n}".strip()
    have = jax.device_count()
    if have < n:
        raise ValueError(
            f"--devices {n} is invalid: JAX sees {have} {jax.default_backend()} device(s) "
            f"(jax.device_count()). Fix: pass --devices {have} or fewer, or run on the CPU "
            f"with JAX_PLATFORMS=cpu XLA_FLAGS={FORCE_DEVICES}={n} set before JAX starts."
        )
    return have


class Progress:
    """A rich progress bar on stderr (so ``--json`` stdout stays one object); silent when
    stderr is not a terminal."""

    def __init__(self, console=None):
        from rich.console import Console

        self.console = Console(stderr=True) if console is None else console
        self.bar = None
        self.task = None
        self.tokens = 0

    def __enter__(self):
        if self.console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self.bar = Progress(
                TextColumn("[bold]flatkv demo[/] {task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("requests"),
                TextColumn("{task.fields[steps]} steps, {task.fields[tokens]} tokens"),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
            )
            self.bar.__enter__()
        return self

    def start(self, total: int) -> None:
        if self.bar is not None:
            # The first steps compile the engine's step functions: say so until one ran.
            self.task = self.bar.add_task("compiling", total=total, steps=0, tokens=0)

    def step(self, record, finished: int) -> None:
        self.tokens += int(record.prefill_tokens) + int(record.decode_tokens)
        if self.bar is not None and self.task is not None:
            self.bar.update(
                self.task,
                description="serving",
                completed=finished,
                steps=int(record.index) + 1,
                tokens=f"{self.tokens:,}",
            )

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)
        return False
