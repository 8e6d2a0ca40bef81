"""The ``flatkv`` command line.

``flatkv plan --model v4-flash --hbm 80GiB --max-requests 64 --max-context 80k --chunk 8192
--verify 4`` prints the memory report of the plan; ``--json`` prints it as JSON.
"""

from __future__ import annotations

import argparse
import sys

from flatkv_jax.capacity import parse_size, plan_for_budget, plan_with_pages
from flatkv_jax.demo.cli import add_demo_parser
from flatkv_jax.plan import ServingLimits
from flatkv_jax.recipes import PRESETS, deepseek_v4_groups
from flatkv_jax.recipes.deepseek_v4 import INDEXER_FORMATS, KV_FORMATS
from flatkv_jax.report import memory_report


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
            parse_size(args.hbm, "--hbm"),
            cached_window_requests=args.cached_window_requests,
            name=args.model,
        )
    report = memory_report(plan)
    print(report.to_json() if args.json else report)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flatkv", description="flatkv_jax: flat per-group KV-cache pools for JAX."
    )
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
    p.add_argument(
        "--hbm", default="80GiB", help="device budget for pools and tables, e.g. 80GiB (default)"
    )
    p.add_argument(
        "--pages", type=int, default=None, help="explicit usable pages per pool instead of --hbm"
    )
    p.add_argument("--max-requests", type=int, default=64, help="concurrent requests (default 64)")
    p.add_argument(
        "--max-context", default="80k", help="longest request in tokens, e.g. 80k (default)"
    )
    p.add_argument(
        "--chunk", default="8192", help="prefill chunk tokens per request per step (default 8192)"
    )
    p.add_argument("--verify", type=int, default=4, help="speculative verify width (default 4)")
    p.add_argument(
        "--cached-window-requests",
        type=int,
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
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_plan_command)
    add_demo_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``flatkv`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"flatkv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
