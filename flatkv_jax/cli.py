"""The ``flatkv`` command line.

``flatkv plan --model v4-flash --hbm 80GiB --max-requests 64 --max-context 80k --chunk 8192
--verify 4`` prints the memory report of the plan; ``--json`` prints it as JSON. ``--pages N``
sizes every pool explicitly instead of ``--hbm`` (the two are exclusive). ``flatkv --version``
prints the version; ``python -m flatkv_jax`` runs the same command line.

Bad input is one line on stderr naming the flag as typed, the rule and the fix (exit status
2), never a traceback; a closed stdout (``flatkv plan | head -1``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable

from flatkv_jax import __version__
from flatkv_jax.capacity import parse_size, plan_for_budget, plan_with_pages
from flatkv_jax.demo.cli import add_demo_parser
from flatkv_jax.plan import ServingLimits
from flatkv_jax.recipes import PRESETS, deepseek_v4_groups
from flatkv_jax.recipes.deepseek_v4 import INDEXER_FORMATS, KV_FORMATS
from flatkv_jax.report import memory_report

#: The budget when neither ``--hbm`` nor ``--pages`` is given.
DEFAULT_HBM = "80GiB"

#: Library field -> the ``plan`` flag that sets it (error messages name the flag).
FIELD_FLAGS = {
    "hbm_bytes": "--hbm",
    "num_pages": "--pages",
    "pages": "--pages",
    "max_requests": "--max-requests",
    "max_context": "--max-context",
    "chunk_tokens": "--chunk",
    "verify_width": "--verify",
    "cached_window_requests": "--cached-window-requests",
    "kv_format": "--kv-format",
    "indexer_format": "--indexer-format",
}

#: Flags whose value may be written as a negative size such as ``-5GiB``, which argparse would
#: otherwise take for an unknown option ("expected one argument").
_VALUE_FLAGS = (
    "--hbm",
    "--pages",
    "--max-requests",
    "--max-context",
    "--chunk",
    "--verify",
    "--cached-window-requests",
)


def whole_number(flag: str, minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: a decimal integer ``>= minimum``; the message names ``flag``."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip(), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is invalid: it must be a whole number. "
                f"Fix: pass {flag} as an integer, e.g. {flag} {max(minimum, 1)}"
            ) from None
        if value < minimum:
            rule = "positive" if minimum == 1 else f">= {minimum}"
            raise argparse.ArgumentTypeError(
                f"{value} is invalid: it must be {rule}. Fix: pass {flag} {minimum} or more"
            )
        return value

    return parse


def size_text(flag: str, example: str) -> Callable[[str], str]:
    """An argparse ``type``: a positive size (``80GiB``, ``80k``, ``8192``); returns the text as
    typed (the command parses it again, so messages can quote what the user wrote)."""

    def parse(text: str) -> str:
        if text.strip().startswith("-"):
            raise argparse.ArgumentTypeError(
                f"{text!r} is invalid: a size must be positive. Fix: pass e.g. {flag} {example}"
            )
        try:
            value = parse_size(text, flag)
        except ValueError as e:
            # parse_size names the value as "<flag>=<text>"; argparse already names the flag.
            raise argparse.ArgumentTypeError(
                str(e).removeprefix(f"{flag}=").replace("write e.g.", f"pass e.g. {flag}")
            ) from None
        if value <= 0:
            raise argparse.ArgumentTypeError(
                f"{text!r} is invalid: a size must be positive. Fix: pass e.g. {flag} {example}"
            )
        return text

    return parse


def _plan_command(args: argparse.Namespace) -> int:
    overrides = {}
    if args.kv_format:
        overrides["kv_format"] = args.kv_format
    if args.indexer_format:
        overrides["indexer_format"] = args.indexer_format
    cfg = PRESETS[args.model](**overrides)
    limits = ServingLimits(
        max_requests=args.max_requests,
        max_context=parse_size(args.max_context, "--max-context"),
        chunk_tokens=parse_size(args.chunk, "--chunk"),
        verify_width=args.verify,
    )
    groups = deepseek_v4_groups(cfg, verify_width=args.verify)
    if args.pages is not None:
        plan = plan_with_pages(groups, limits, args.pages, name=args.model)
    else:
        plan = plan_for_budget(
            groups,
            limits,
            parse_size(args.hbm or DEFAULT_HBM, "--hbm"),
            cached_window_requests=args.cached_window_requests,
            name=args.model,
        )
    report = memory_report(plan)
    if args.ranks is None:
        print(report.to_json() if args.json else report)
        return 0
    # Data-parallel ranks: the plan above is one rank's (--hbm is a per-device budget).
    from flatkv_jax.sharding import rank_capacity

    ranks = rank_capacity(plan, args.ranks)
    if args.json:
        print(json.dumps({**report.to_dict(), "ranks": ranks.to_dict()}, indent=2))
    else:
        print(f"{report}\n\n{ranks}")
    return 0


def in_flag_terms(message: str, args: argparse.Namespace) -> str:
    """Rewrites a library message for the command line: the offending field at its head
    becomes the flag with the value the user typed, and other field names become flags.

    ``num_pages[swa_kv]=102 is invalid: ... max_context=80000 ...`` with ``--pages 100``
    becomes ``--pages 100 is invalid (pool swa_kv): ... --max-context=80000 ...``.
    """
    head = re.match(r"(\w+)(?:\[([^\]]*)\])?=(.*?) is invalid: ", message)
    if head and head.group(1) in FIELD_FLAGS:
        flag = FIELD_FLAGS[head.group(1)]
        typed = getattr(args, flag[2:].replace("-", "_"), None)
        if flag == "--hbm" and typed is None and args.pages is None:
            typed = DEFAULT_HBM
        shown = f"{flag} {typed}" if typed is not None else f"{flag}={head.group(3)}"
        where = f" (pool {head.group(2)})" if head.group(2) else ""
        message = f"{shown} is invalid{where}: {message[head.end() :]}"
    # "pages" alone is an English word in the rules ("needs 133 pages"): only the head maps it.
    names = "|".join(sorted(set(FIELD_FLAGS) - {"pages"}, key=len, reverse=True))
    return re.sub(rf"\b({names})\b", lambda m: FIELD_FLAGS[m.group(1)], message)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flatkv", description="flatkv_jax: flat per-group KV-cache pools for JAX."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "plan", help="size every pool of a model's cache plan and print the memory report"
    )
    p.add_argument(
        "--model",
        choices=sorted(PRESETS),
        default="v4-flash",
        help="model preset (default v4-flash)",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--hbm",
        type=size_text("--hbm", DEFAULT_HBM),
        default=None,
        help=f"device budget for pools and tables, e.g. 80GiB (default {DEFAULT_HBM})",
    )
    size.add_argument(
        "--pages",
        type=whole_number("--pages", 1),
        default=None,
        help="explicit usable pages per pool instead of --hbm",
    )
    p.add_argument(
        "--max-requests",
        type=whole_number("--max-requests", 1),
        default=64,
        help="concurrent requests (default 64)",
    )
    p.add_argument(
        "--max-context",
        type=size_text("--max-context", "80k"),
        default="80k",
        help="longest request in tokens, e.g. 80k (default)",
    )
    p.add_argument(
        "--chunk",
        type=size_text("--chunk", "8192"),
        default="8192",
        help="prefill chunk tokens per request per step (default 8192)",
    )
    p.add_argument(
        "--verify",
        type=whole_number("--verify", 0),
        default=4,
        help="speculative verify width (default 4)",
    )
    p.add_argument(
        "--cached-window-requests",
        type=whole_number("--cached-window-requests", 0),
        default=None,
        help="extra requests' worth of window pages kept for prefix hits (default: --max-requests)",
    )
    p.add_argument(
        "--kv-format", choices=KV_FORMATS, default=None, help="KV row format (default fp8_ds_mla)"
    )
    p.add_argument(
        "--indexer-format",
        choices=INDEXER_FORMATS,
        default=None,
        help="indexer key format (default mxfp4)",
    )
    p.add_argument(
        "--ranks",
        type=whole_number("--ranks", 1),
        default=None,
        help="data-parallel ranks (one device each): the plan is per rank; also print "
        "per-rank and total capacity",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_plan_command, subparser=p)
    add_demo_parser(sub)  # `flatkv demo` (flatkv_jax/demo/cli.py)
    return parser


def _join_negative_values(argv: list[str]) -> list[str]:
    """``--hbm -5GiB`` -> ``--hbm=-5GiB``, so the value reaches its type check (which says a
    size must be positive) instead of argparse reading it as an unknown option."""
    out: list[str] = []
    it = iter(argv)
    for a in it:
        if a in _VALUE_FLAGS:
            nxt = next(it, None)
            if nxt is not None and re.match(r"-[0-9.]", nxt):
                out.append(f"{a}={nxt}")
                continue
            out.append(a)
            if nxt is not None:
                out.append(nxt)
            continue
        out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``flatkv`` console script (and of ``python -m flatkv_jax``).

    Returns the exit status: 0 on success, 2 on bad input (one line on stderr), 1 when stdout
    was closed early. argparse exits itself (status 2) on unknown or malformed flags.
    """
    parser = build_parser()
    args = parser.parse_args(_join_negative_values(sys.argv[1:] if argv is None else argv))
    if (
        getattr(args, "pages", None) is not None
        and getattr(args, "cached_window_requests", None) is not None
    ):
        # plan_with_pages has no such knob: the flag would be accepted and ignored.
        args.subparser.error(
            "argument --cached-window-requests: not allowed with argument --pages (it sizes "
            "the window pools from the --hbm budget; --pages sets every pool's pages itself)"
        )
    try:
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return status
    except BrokenPipeError:
        # The reader went away (``flatkv plan | head -1``): stop quietly. Point stdout at
        # /dev/null so the interpreter's final flush does not report the pipe again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, TypeError) as e:
        print(f"flatkv: error: {in_flag_terms(str(e), args)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
