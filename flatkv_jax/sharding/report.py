"""Per-rank and total capacity of a plan served by ``n_ranks`` data-parallel ranks."""

from __future__ import annotations

import dataclasses
import json

from flatkv_jax.errors import fail, is_int
from flatkv_jax.plan import CachePlan, check_plan
from flatkv_jax.report import human_bytes


@dataclasses.dataclass(frozen=True)
class RankReport:
    """Capacity of ``n_ranks`` ranks of one per-rank plan (sizes in bytes, per rank unless
    named ``total_*``). ``str(report)`` is what ``flatkv plan --ranks N`` prints."""

    n_ranks: int
    max_requests: int
    token_capacity: int
    largest_request_tokens: int
    pages: dict[str, int]
    pool_bytes: int
    table_bytes: int
    state_bytes: int
    total_requests: int
    total_token_capacity: int
    total_pages: dict[str, int]
    total_bytes: int

    @property
    def bytes_per_rank(self) -> int:
        return self.pool_bytes + self.table_bytes + self.state_bytes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        n = self.n_ranks
        w = max(len(k) for k in (*self.pages, "device bytes"))
        lines = [
            f"data-parallel ranks: {n} (one device each; page ids rank-local; no traffic "
            "between ranks)",
            f"{'':{w}}  {'per rank':>14}  {'total':>16}",
            f"{'requests':{w}}  {self.max_requests:>14,}  {self.total_requests:>16,}",
            f"{'tokens':{w}}  {self.token_capacity:>14,}  {self.total_token_capacity:>16,}",
        ]
        lines += [
            f"{g:{w}}  {p:>8,} pages  {self.total_pages[g]:>10,} pages"
            for g, p in self.pages.items()
        ]
        lines += [
            f"{'pools':{w}}  {human_bytes(self.pool_bytes):>14}  "
            f"{human_bytes(n * self.pool_bytes):>16}",
            f"{'tables':{w}}  {human_bytes(self.table_bytes):>14}  "
            f"{human_bytes(n * self.table_bytes):>16}",
            f"{'state':{w}}  {human_bytes(self.state_bytes):>14}  "
            f"{human_bytes(n * self.state_bytes):>16}",
            f"{'device bytes':{w}}  {human_bytes(self.bytes_per_rank):>14}  "
            f"{human_bytes(self.total_bytes):>16}",
            f"largest single request {self.largest_request_tokens:,} tokens (a request lives "
            "on one rank)",
        ]
        return "\n".join(lines)


def rank_capacity(plan: CachePlan, n_ranks: int, *, prefix: bool = True) -> RankReport:
    """Per-rank and total capacity of ``plan`` (the per-rank plan) on ``n_ranks`` ranks.

    ``state_bytes`` is the coordinator state of one rank (``create_state(plan, prefix=prefix)``,
    measured abstractly: nothing is allocated); ``table_bytes`` is counted once, in
    ``table_bytes`` (the state's table buffer is excluded from ``state_bytes``).

    Raises:
      TypeError/ValueError: a bad plan or ``n_ranks``.
    """
    import jax

    from flatkv_jax.coordinator import create_state

    plan = check_plan(plan)
    if not is_int(n_ranks):
        fail("n_ranks", n_ranks, "it must be an int", "pass the number of ranks", exc=TypeError)
    if n_ranks < 1:
        fail("n_ranks", n_ranks, "it must be positive", "pass n_ranks >= 1")
    shapes = jax.eval_shape(lambda: create_state(plan, prefix=prefix, seed=0))
    state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    state -= shapes.table_buffer.size * shapes.table_buffer.dtype.itemsize
    pages = {g.name: plan.pages(g) for g in plan.groups}
    per_rank_bytes = plan.total_pool_bytes + plan.total_table_bytes + state
    return RankReport(
        n_ranks=n_ranks,
        max_requests=plan.limits.max_requests,
        token_capacity=plan.token_capacity,
        largest_request_tokens=memory_largest(plan),
        pages=pages,
        pool_bytes=plan.total_pool_bytes,
        table_bytes=plan.total_table_bytes,
        state_bytes=int(state),
        total_requests=n_ranks * plan.limits.max_requests,
        total_token_capacity=n_ranks * plan.token_capacity,
        total_pages={k: n_ranks * v for k, v in pages.items()},
        total_bytes=n_ranks * per_rank_bytes,
    )


def memory_largest(plan: CachePlan) -> int:
    from flatkv_jax.report import memory_report

    return memory_report(plan).largest_request_tokens


def rank_report(plan: CachePlan, n_ranks: int, *, prefix: bool = True) -> str:
    """The text of :func:`rank_capacity`: per-rank and total requests, tokens, pages per
    group and device bytes (pools, tables, coordinator state)."""
    return str(rank_capacity(plan, n_ranks, prefix=prefix))
