"""Cache groups: one kind of cache data with one page geometry and one lifetime.

A group owns one flat pool. It knows only generic properties — retention (full history or a
sliding window), the window in tokens, rows per page, tokens per row (the compression
ratio), the layers that keep a copy, the owner (target or draft model) and its fields. Every
block span and window-derived count is computed here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from flatkv_jax.errors import check_nonnegative_int, check_positive_int, fail
from flatkv_jax.formats import RowFormat


class Retention(enum.Enum):
    """How long a group keeps a block."""

    #: Every block stays for the request's life (compressed chains, full attention KV).
    HISTORY = "history"
    #: Only the blocks covering the last ``window`` tokens are kept; older slots become holes.
    WINDOW = "window"


class Owner(enum.Enum):
    """Which model reads and writes a group."""

    TARGET = "target"
    DRAFT = "draft"


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """One byte plane of a group: every layer of the group keeps one pool array per field.

    Attributes:
      name: field name, unique within its group (e.g. ``"kv"``, ``"index_key"``).
      format: the row format.
    """

    name: str
    format: RowFormat

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            fail(
                "field name", self.name, "a field name must be a Python identifier", "use e.g. 'kv'"
            )
        if not isinstance(self.format, RowFormat):
            fail(
                "format",
                self.format,
                "a field needs a RowFormat",
                "build it with flatkv_jax.formats",
                exc=TypeError,
            )


def blocks_for_span(span_tokens: int, block_tokens: int) -> int:
    """Most blocks that ``span_tokens`` consecutive tokens can touch, at any alignment.

    A span of L >= 1 tokens starting anywhere touches at most ``ceil((L - 1) / B) + 1`` blocks of
    B tokens; 0 tokens touch none.
    """
    if span_tokens <= 0:
        return 0
    return -(-(span_tokens - 1) // block_tokens) + 1


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """Geometry and lifetime of one cache group.

    Attributes:
      name: unique group name (a Python identifier; used as the pool's key).
      retention: :class:`Retention`.
      rows_per_page: rows in one page (one block).
      tokens_per_row: raw tokens one row summarises (the compression ratio; 1 for raw rows).
        A row is written when the token at position ``p`` completes it,
        ``(p + 1) % tokens_per_row == 0``, at row ``p // tokens_per_row``.
      layers: the model layers that keep a copy of this group (one pool array per layer and
        field; every layer uses the same page ids).
      fields: the group's fields.
      window: for ``WINDOW`` groups, tokens the consumer reads behind (and including) the current
        token; must be covered by whole blocks. ``None`` for history groups.
      owner: :class:`Owner`.
      verify_width: the speculative verify width the recipe sized this group for (e.g. a
        compressor state's window), or ``None`` if the group does not depend on it. A
        :class:`~flatkv_jax.plan.CachePlan` refuses limits with another ``verify_width``.
      period: for ``WINDOW`` groups whose consumer restarts at fixed boundaries (a
        compressor's state: a new compressed row begins at every multiple of its ratio), the
        boundary spacing in tokens; ``None`` for a plain sliding window. Only prefix hits use
        it: they land on multiples of ``period`` (the plan's granularity is a multiple of it),
        where the tokens after the boundary read no further back than ``carry``.
      carry: with ``period``, the tokens before a boundary still read after it (an overlapping
        compressor's previous window: ``ratio``; ``0`` without overlap). ``period + carry``
        must fit the window.
    """

    name: str
    retention: Retention
    rows_per_page: int
    tokens_per_row: int
    layers: tuple[int, ...]
    fields: tuple[FieldSpec, ...]
    window: int | None = None
    owner: Owner = Owner.TARGET
    verify_width: int | None = None
    period: int | None = None
    carry: int = 0

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            fail(
                "group name",
                self.name,
                "a group name must be a Python identifier",
                "use e.g. 'swa_kv'",
            )
        if not isinstance(self.retention, Retention):
            fail(
                "retention",
                self.retention,
                "it must be a Retention",
                "pass Retention.HISTORY or Retention.WINDOW",
                exc=TypeError,
            )
        if not isinstance(self.owner, Owner):
            fail(
                "owner",
                self.owner,
                "it must be an Owner",
                "pass Owner.TARGET or Owner.DRAFT",
                exc=TypeError,
            )
        if self.verify_width is not None:
            object.__setattr__(
                self, "verify_width", check_nonnegative_int("verify_width", self.verify_width)
            )
        check_positive_int("rows_per_page", self.rows_per_page)
        check_positive_int("tokens_per_row", self.tokens_per_row)
        if not isinstance(self.layers, tuple) or not self.layers:
            fail(
                "layers",
                self.layers,
                f"group {self.name!r} must be used by at least one layer",
                "pass a non-empty tuple of layer indices",
            )
        if len(set(self.layers)) != len(self.layers) or any(
            not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in self.layers
        ):
            fail(
                "layers",
                self.layers,
                "layer indices must be distinct non-negative ints",
                "list each layer once",
            )
        if not isinstance(self.fields, tuple) or not self.fields:
            fail(
                "fields",
                self.fields,
                f"group {self.name!r} needs at least one field",
                "pass a tuple of FieldSpec",
            )
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            fail(
                "fields",
                names,
                "field names must be unique within a group",
                "rename the duplicate field",
            )
        if self.retention is Retention.WINDOW:
            if self.window is None:
                fail(
                    "window",
                    None,
                    f"window group {self.name!r} needs a window in tokens",
                    "pass window=...",
                )
            check_positive_int("window", self.window)
            if self.window % self.block_tokens:
                fail(
                    "window",
                    self.window,
                    f"group {self.name!r}: a window must be covered by whole pages of {self.block_tokens} tokens "
                    f"({self.rows_per_page} rows x {self.tokens_per_row} tokens)",
                    f"use a window that is a multiple of {self.block_tokens}, or change rows_per_page",
                )
        elif self.window is not None:
            fail(
                "window",
                self.window,
                f"history group {self.name!r} keeps everything and takes no window",
                "pass window=None",
            )
        if self.period is None and self.carry != 0:
            fail(
                "carry",
                self.carry,
                f"group {self.name!r}: carry is the reach behind a period boundary and needs a period",
                "pass period=... or leave carry at 0",
            )
        if self.period is not None:
            self._check_period()

    def _check_period(self) -> None:
        if not self.is_window:
            fail(
                "period",
                self.period,
                f"history group {self.name!r} keeps everything: a period only narrows what a window group's prefix hit needs",
                "pass period=None",
            )
        check_positive_int("period", self.period)
        check_nonnegative_int("carry", self.carry)
        if self.period + self.carry > self.window:
            fail(
                "period",
                self.period,
                f"group {self.name!r}: the token that ends a period reads the period and the carry "
                f"({self.period} + {self.carry} tokens), more than its window of {self.window}",
                f"use a window of at least {self.period + self.carry}, or a smaller period or carry",
            )

    @property
    def block_tokens(self) -> int:
        """Raw tokens one block (one table slot, one page) spans."""
        return self.rows_per_page * self.tokens_per_row

    @property
    def is_window(self) -> bool:
        return self.retention is Retention.WINDOW

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row across all fields, one layer."""
        return sum(f.format.nbytes for f in self.fields)

    @property
    def page_bytes(self) -> int:
        """Bytes one page costs across all fields and layers (stride == payload)."""
        return self.rows_per_page * self.row_bytes * self.num_layers

    def field(self, name: str) -> FieldSpec:
        """Returns the field called ``name``."""
        for f in self.fields:
            if f.name == name:
                return f
        fail(
            "field",
            name,
            f"group {self.name!r} has fields {[f.name for f in self.fields]}",
            "ask for one of those",
        )

    def rows_for_tokens(self, tokens: int) -> int:
        """Complete rows that ``tokens`` raw tokens produce."""
        return tokens // self.tokens_per_row

    def blocks_for_tokens(self, tokens: int) -> int:
        """Table slots needed to hold positions ``[0, tokens)``."""
        return -(-tokens // self.block_tokens)

    def live_blocks(self, step_tokens: int) -> int:
        """Most blocks a request keeps live in a window group while a step writes ``step_tokens``.

        The first new token reads ``window - 1`` tokens behind it, so the live span is
        ``window - 1 + step_tokens`` tokens at arbitrary alignment.
        """
        if not self.is_window:
            fail(
                "group",
                self.name,
                "live_blocks is defined for window groups only",
                "use blocks_for_tokens",
            )
        return blocks_for_span(self.window - 1 + step_tokens, self.block_tokens)

    def first_read(self, c: int) -> int:
        """The oldest position that the tokens from ``c`` on still read (window groups; may be
        negative near the start): ``c - window + 1`` for a sliding window; a group with a
        ``period`` restarts at every multiple of it and reads back only ``carry`` tokens
        across the restart, so ``max(c - window + 1, c // period * period - carry)``.

        Reclaim drops every column wholly before ``max(0, first_read(committed))``; the
        coordinator, the oracle and the audit share this rule. It never decreases as ``c``
        grows, so a step in flight (whose tokens lie at or after ``committed``) never reads a
        dropped column.
        """
        if not self.is_window:
            fail(
                "group",
                self.name,
                "first_read is defined for window groups only",
                "history groups keep every block: read from 0",
            )
        start = c - self.window + 1
        if self.period is not None:
            start = max(start, c // self.period * self.period - self.carry)
        return start

    @property
    def hit_reach(self) -> int:
        """Tokens behind a prefix-hit boundary that the tokens after it still read (window
        groups): ``window - 1`` for a sliding window, ``min(carry, window - 1)`` for a group
        with a ``period`` (hits land on its multiples). A hit at ``h`` needs the blocks holding
        positions ``[h - hit_reach, h)``. ``0`` for history groups (they need every block)."""
        if not self.is_window:
            return 0
        if self.period is None:
            return self.window - 1
        return min(self.carry, self.window - 1)

    def bytes_per_token(self) -> float:
        """History bytes one raw token costs (0 for window groups, whose cost is per request)."""
        return 0.0 if self.is_window else self.page_bytes / self.block_tokens

    def describe(self) -> str:
        ratio = f"x{self.tokens_per_row}" if self.tokens_per_row > 1 else ""
        ret = f"window {self.window}" if self.is_window else "history"
        return f"{self.name}: {ret}, {self.rows_per_page} rows{ratio}/page, {self.num_layers} layers, {self.owner.value}"


def lcm_block_tokens(groups: tuple[GroupSpec, ...]) -> int:
    """The least common multiple of the groups' block spans and periods (the prefix
    granularity: a hit shares whole pages and lands on every group's period boundaries)."""
    return math.lcm(*(g.block_tokens for g in groups), *(g.period or 1 for g in groups))
