"""Measures the routing policies of a sharded engine on the demo workload.

``python -m flatkv_jax.demo.routing --devices 2 --requests 40`` serves the demo workload
once per policy (``affinity``, then ``least_loaded``) in one process, so the sharded step is
compiled once, and prints per policy: the prefix hit rate (total and per rank), the balance
(requests per rank, least / most), the routing misses (requests sent away from the rank
that served their prefix key) and the steps. docs/routing.md quotes its output.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["compare", "format_rows", "main"]


def compare(devices: int, requests: int, seed: int = 0, mtp: bool = True) -> list[dict]:
    """Runs the demo with each routing policy; returns one summary dict per policy."""
    from flatkv_jax.demo.runner import DemoOptions, run_demo

    rows = []
    for policy in ("affinity", "least_loaded"):
        options = DemoOptions(
            requests=requests, seed=seed, devices=devices, routing=policy, mtp=mtp
        )
        report, _ = run_demo(options)
        rt = report.routing or {}
        rows.append(
            {
                "policy": policy,
                "devices": report.devices,
                "requests": report.submitted,
                "served": report.served,
                "steps": report.steps,
                "hit_rate": round(report.hit_rate, 4),
                "hit_tokens": report.hit_tokens,
                "prompt_tokens": report.prompt_tokens,
                "rank_hit_rates": [round(x.hit_rate, 4) for x in report.ranks],
                "requests_per_rank": rt.get("requests_per_rank"),
                "balance": rt.get("balance"),
                "routing_misses": rt.get("routing_misses"),
                "routing_miss_tokens": rt.get("routing_miss_tokens"),
                "keyed_requests": rt.get("keyed_requests"),
                "oracle_agrees": report.oracle_agrees,
                "ok": report.ok,
            }
        )
    return rows


def format_rows(rows: list[dict]) -> str:
    """The comparison as a Markdown table."""
    head = (
        "| policy | hit rate | hit rate per rank | requests per rank | balance "
        "| routing misses | steps |"
    )
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['hit_rate']:.3f} ({r['hit_tokens']:,} of "
            f"{r['prompt_tokens']:,}) | {' / '.join(f'{x:.3f}' for x in r['rank_hit_rates'])} "
            f"| {' / '.join(str(x) for x in r['requests_per_rank'])} | {r['balance']:.2f} "
            f"| {r['routing_misses']} of {r['keyed_requests']} | {r['steps']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-mtp", dest="mtp", action="store_false")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from flatkv_jax.demo.cli import request_host_devices

    try:
        request_host_devices(args.devices)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = compare(args.devices, args.requests, args.seed, args.mtp)
    print(json.dumps(rows, indent=2) if args.json else format_rows(rows))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
