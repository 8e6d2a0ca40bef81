"""The memory report: what every pool and table of a plan costs, and what it buys."""

from __future__ import annotations

import dataclasses
import json

from flatkv_jax.plan import CachePlan


@dataclasses.dataclass(frozen=True)
class GroupReport:
    """One group's line of the report (all sizes in bytes)."""

    name: str
    owner: str
    retention: str
    window: int | None
    period: int | None
    carry: int
    layers: int
    fields: str
    row_bytes: int
    rows_per_page: int
    block_tokens: int
    page_bytes: int
    pages: int
    pool_bytes: int
    payload_bytes: int
    bytes_per_token: float
    fixed_bytes_per_request: int
    table_width: int
    table_bytes: int


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """The plan's memory report. ``str(report)`` is the table ``flatkv plan`` prints."""

    name: str
    groups: tuple[GroupReport, ...]
    total_pool_bytes: int
    total_table_bytes: int
    total_bytes: int
    token_capacity: int
    largest_request_tokens: int
    history_bytes_per_token: float
    fixed_bytes_per_request: int
    prefix_granularity: int
    max_requests: int
    max_context: int
    chunk_tokens: int
    verify_width: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        cols = [
            ("group", lambda r: r.name),
            ("owner", lambda r: r.owner),
            ("kept", _kept),
            ("layers", lambda r: str(r.layers)),
            ("fields", lambda r: r.fields),
            ("row B", lambda r: f"{r.row_bytes:,}"),
            ("rows x tok", lambda r: f"{r.rows_per_page}x{r.block_tokens // r.rows_per_page}"),
            ("page B", lambda r: f"{r.page_bytes:,}"),
            ("pages", lambda r: f"{r.pages:,}"),
            ("pool", lambda r: human_bytes(r.pool_bytes)),
            ("B/token", lambda r: f"{r.bytes_per_token:,.1f}" if r.bytes_per_token else "-"),
            (
                "B/request",
                lambda r: f"{r.fixed_bytes_per_request:,}" if r.fixed_bytes_per_request else "-",
            ),
            ("table", lambda r: f"{self.max_requests}x{r.table_width}"),
        ]
        rows = [[h for h, _ in cols]] + [[f(r) for _, f in cols] for r in self.groups]
        widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
        lines = [f"cache plan {self.name}".rstrip()]
        for k, row in enumerate(rows):
            lines.append(
                "  ".join(
                    c.rjust(w) if i >= 3 else c.ljust(w)
                    for i, (c, w) in enumerate(zip(row, widths, strict=True))
                )
            )
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines += [
            "",
            f"limits: {self.max_requests} requests, context {self.max_context:,}, chunk {self.chunk_tokens:,}, verify {self.verify_width}",
            f"pools {human_bytes(self.total_pool_bytes)} + tables {human_bytes(self.total_table_bytes)} = {human_bytes(self.total_bytes)}",
            f"history cost {self.history_bytes_per_token:,.2f} B/token; fixed window/state cost {human_bytes(self.fixed_bytes_per_request)} per running request",
            f"token capacity {self.token_capacity:,} tokens; largest single request {self.largest_request_tokens:,} tokens; prefix granularity {self.prefix_granularity} tokens",
        ]
        return "\n".join(lines)


def _kept(r: GroupReport) -> str:
    """``history``, ``win W`` or, with a period, ``win W/P+K`` (restarts every ``P`` tokens,
    reads back ``K`` across a restart: docs/plan.md, "Periods")."""
    if not r.window:
        return "history"
    return f"win {r.window}" + (f"/{r.period}+{r.carry}" if r.period else "")


def human_bytes(n: float) -> str:
    """``1536 -> '1.50 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def memory_report(plan: CachePlan) -> MemoryReport:
    """Builds the memory report of ``plan``."""
    groups = tuple(
        GroupReport(
            name=g.name,
            owner=g.owner.value,
            retention=g.retention.value,
            window=g.window,
            period=g.period,
            carry=g.carry,
            layers=g.num_layers,
            fields="+".join(f"{f.name}:{f.format.name}" for f in g.fields),
            row_bytes=g.row_bytes,
            rows_per_page=g.rows_per_page,
            block_tokens=g.block_tokens,
            page_bytes=g.page_bytes,
            pages=plan.pages(g),
            pool_bytes=plan.pool_bytes(g),
            payload_bytes=plan.payload_bytes(g),
            bytes_per_token=g.bytes_per_token(),
            fixed_bytes_per_request=plan.fixed_bytes_per_request(g),
            table_width=plan.table_width(g),
            table_bytes=plan.table_bytes(g),
        )
        for g in plan.groups
    )
    lim = plan.limits
    return MemoryReport(
        name=plan.name,
        groups=groups,
        total_pool_bytes=plan.total_pool_bytes,
        total_table_bytes=plan.total_table_bytes,
        total_bytes=plan.total_bytes,
        token_capacity=plan.token_capacity,
        largest_request_tokens=plan.largest_request_tokens,
        history_bytes_per_token=plan.history_bytes_per_token,
        fixed_bytes_per_request=plan.fixed_bytes_per_request(),
        prefix_granularity=plan.prefix_granularity,
        max_requests=lim.max_requests,
        max_context=lim.max_context,
        chunk_tokens=lim.chunk_tokens,
        verify_width=lim.verify_width,
    )
