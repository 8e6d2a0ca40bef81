"""How the model meets the cache: step inputs and outputs, trace-time checks, pool access.

Cache-side inputs are only what the coordinator publishes per step: its
:class:`~flatkv_jax.coordinator.StepMetadata` (flat token layout, write slots, window read
pages, zero lists) and its flat table buffer (``CacheState.table_buffer``, read for the
history groups with the state layout's offsets and strides). Nothing here recomputes an
address the coordinator publishes; :mod:`flatkv_jax.model.addressing` is the consumer-side
reading of the metadata, :class:`CacheContext` hands it to the layers.

Every check runs when the step is traced (shapes, dtypes and the static plan are known then),
so a mismatch raises once, before anything is compiled, instead of retracing or reading the
wrong rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flatkv_jax import plan as plan_lib
from flatkv_jax.coordinator.metadata import StepMetadata, window_columns
from flatkv_jax.coordinator.ops import resolve_max_count
from flatkv_jax.coordinator.state import table_size
from flatkv_jax.errors import fail
from flatkv_jax.groups import GroupSpec
from flatkv_jax.model.addressing import history_address, window_address, window_positions
from flatkv_jax.model.config import ModelConfig
from flatkv_jax.plan import CachePlan
from flatkv_jax.pools import Pools, pool_specs
from flatkv_jax.recipes.deepseek_v4 import deepseek_v4_groups
from kernels_pallas import Impl, zero_pages
from kernels_pallas import write_rows as _write_rows


def _dataclass(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_dataclass
class StepBatch:
    """The model-side inputs of one step.

    Attributes:
      tokens: int32 ``[step_tokens]`` token ids (ignored where the token is idle).
      prev_hidden: float32 ``[max_requests, hidden]``: per request, the target hidden state of
        the position just before its first token in this step (zeros at position 0). The MTP
        layer needs it; the engine keeps it from the previous step's :attr:`StepOutput.hidden`.
    """

    tokens: jax.Array
    prev_hidden: jax.Array


@_dataclass
class StepOutput:
    """Per flat token: ``logits [S, vocab]`` (target, predicting the next token), ``hidden
    [S, hidden]`` (target final residual) and ``draft_logits [S, vocab]`` (the MTP layer at the
    same position, from the previous hidden and this token; ``None`` without MTP). Idle tokens
    hold unspecified values."""

    logits: jax.Array
    hidden: jax.Array
    draft_logits: jax.Array | None


@_dataclass
class DraftBatch:
    """Inputs of ``propose``, indexed by request slot.

    The draft positions come from the step metadata: a proposing request's metadata row
    (``row_start``, ``row_count >= num_draft``) is its verify block, and the draft writes
    positions ``row_start .. row_start + num_draft - 1`` of it.

    Attributes:
      tokens: int32 ``[max_requests]`` the token at ``row_start`` (the one the target just chose).
      prev_hidden: float32 ``[max_requests, hidden]`` target hidden of ``row_start - 1``.
      active: bool ``[max_requests]``: the request proposes in this step.
    """

    tokens: jax.Array
    prev_hidden: jax.Array
    active: jax.Array


@_dataclass
class DraftOutput:
    """Per metadata row (``S = meta.row_slot.shape[0]``): ``tokens int32 [S, k]`` (greedy
    proposals for positions ``row_start + 1 .. row_start + k``) and their ``logits float32
    [S, k, vocab]``; rows that do not propose hold unspecified values."""

    tokens: jax.Array
    logits: jax.Array


class PoolEditor:
    """Trace-time view of the pool arrays that lets layers replace one (group, field, layer).

    ``arrays[g][f][l]`` as in :class:`~flatkv_jax.pools.Pools`; a group may be ``None`` where
    a traced region (the draft loop) carries only some groups.
    """

    def __init__(self, plan: CachePlan, arrays: list):
        self.plan = plan
        self.arrays = arrays

    @classmethod
    def of(cls, plan: CachePlan, pools: Pools) -> PoolEditor:
        return cls(plan, [[list(per_field) for per_field in g] for g in pools.arrays])

    def _where(self, g: GroupSpec, field: str, layer: int) -> tuple[int, int, int]:
        fi = [f.name for f in g.fields].index(field)
        return self.plan.group_index(g.name), fi, g.layers.index(layer)

    def get(self, g: GroupSpec, field: str, layer: int) -> jax.Array:
        gi, fi, li = self._where(g, field, layer)
        return self.arrays[gi][fi][li]

    def set(self, g: GroupSpec, field: str, layer: int, value: jax.Array) -> None:
        gi, fi, li = self._where(g, field, layer)
        self.arrays[gi][fi][li] = value

    def zero(self, gi: int, page_ids: jax.Array, impl: Impl, interpret=False) -> None:
        pools = self.pools()
        if interpret is False:
            zeroed = pools.zero_group(gi, page_ids, impl=impl)
        else:  # Pools.zero_group has no interpret mode: the kernel call it makes, with one
            flat = zero_pages(pools.flat_group(gi), page_ids, impl=impl, interpret=interpret)
            zeroed = pools.with_flat_group(gi, flat)
        self.arrays[gi] = [list(per_field) for per_field in zeroed.arrays[gi]]

    def pools(self) -> Pools:
        return Pools(tuple(tuple(tuple(f) for f in g) for g in self.arrays))


@dataclasses.dataclass(frozen=True)
class CacheContext:
    """Static context of one traced call plus the addressing of ``N`` tokens.

    ``slot``, ``pos`` and ``row`` (metadata row) are ``[N]`` with ``-1`` for idle tokens;
    ``write_slot`` is ``[G, N]``, the coordinator's write slots of those tokens; ``interpret``
    the kernels' interpret mode (resolved, see :func:`resolve_kernels`).
    """

    plan: CachePlan
    impl: Impl
    interpret: object
    meta: StepMetadata
    table_buffer: jax.Array
    columns: tuple[tuple[int, int], ...]
    slot: jax.Array
    pos: jax.Array
    row: jax.Array
    write_slot: jax.Array

    @property
    def live(self) -> jax.Array:
        return self.pos >= 0

    @property
    def safe_pos(self) -> jax.Array:
        """Positions with idle tokens at 0 (so the math stays finite; their rows are skipped)."""
        return jnp.where(self.live, self.pos, 0)

    def read_window(self, g: GroupSpec, span: int):
        """Addresses of each token's positions ``p - span + 1 .. p`` in window group ``g``."""
        gi = self.plan.group_index(g.name)
        q = jnp.where(self.live[:, None], window_positions(self.pos, span), -1)
        return window_address(self.plan, gi, self.columns, self.meta, self.row, q)

    def read_history(self, g: GroupSpec, rows: jax.Array):
        """Addresses of rows ``rows [N, E]`` of history group ``g`` of each token's request."""
        gi = self.plan.group_index(g.name)
        slot = jnp.where(self.live, self.slot, -1)
        return history_address(self.plan, gi, self.table_buffer, slot, rows)

    def write(
        self, ed: PoolEditor, g: GroupSpec, field: str, layer: int, rows: jax.Array
    ) -> jax.Array:
        """Writes each token's row at the coordinator's write slot; returns the new array."""
        slots = self.write_slot[self.plan.group_index(g.name)]
        pool = _write_rows(
            ed.get(g, field, layer), rows, slots, impl=self.impl, interpret=self.interpret
        )
        ed.set(g, field, layer, pool)
        return pool


def resolve_kernels(impl: Impl | str, interpret: object = None) -> tuple[Impl, object]:
    """``(impl, interpret)`` for the page kernels.

    ``interpret=None`` (auto) is ``True`` for the Pallas TPU kernels on a CPU backend (their
    interpret mode, so ``impl="pallas_tpu"`` runs in CPU tests) and ``False`` otherwise;
    anything else is passed to the kernels as given (``True``, ``False`` or
    ``pltpu.InterpretParams()``; the kernels reject an interpret mode for ``Impl.REFERENCE``).
    """
    if isinstance(impl, Impl):
        resolved = impl
    else:
        try:
            resolved = Impl(impl)
        except ValueError:
            fail(
                "impl",
                impl,
                f"it must be one of {[m.value for m in Impl]}",
                "pass impl=Impl.REFERENCE or impl='pallas_tpu'",
            )
    if interpret is None:
        interpret = resolved is Impl.PALLAS_TPU and jax.default_backend() == "cpu"
    return resolved, interpret


def columns(plan: CachePlan, max_count: int | None) -> tuple[tuple[int, int], ...]:
    """The metadata's window columns at the step's (resolved) ``max_count``."""
    return window_columns(plan, resolve_max_count(plan, max_count))


# --- validation (trace time: shapes and dtypes only) -------------------------------------------
def check_model_plan(cfg: ModelConfig, plan: CachePlan) -> None:
    """Raises unless ``plan`` holds exactly the groups of ``cfg`` (at the plan's verify width).

    (Not :func:`flatkv_jax.plan.check_plan`, which checks that a value is a plan.)
    """
    if not isinstance(cfg, ModelConfig):
        fail(
            "cfg",
            cfg,
            "it must be a ModelConfig",
            "build it with tiny_model() or v4_flash_model()",
            exc=TypeError,
        )
    plan_lib.check_plan(plan)
    want = deepseek_v4_groups(cfg.cache, verify_width=plan.limits.verify_width)
    if plan.groups != want:
        fail(
            "plan",
            [g.name for g in plan.groups],
            "the plan's groups must be deepseek_v4_groups(cfg.cache, verify_width=plan.limits.verify_width)",
            "build the plan from the same DeepSeekV4Config as the model",
        )


def _check_array(what: str, a, shape: tuple[int, ...], dtype) -> None:
    if not hasattr(a, "shape") or tuple(a.shape) != shape or a.dtype != jnp.dtype(dtype):
        got = (tuple(a.shape), str(a.dtype)) if hasattr(a, "shape") else type(a).__name__
        fail(
            what,
            got,
            f"expected shape {shape} and dtype {jnp.dtype(dtype).name}",
            "build it from the plan's limits",
        )


def check_pools(plan: CachePlan, pools: Pools) -> None:
    """Raises unless ``pools`` holds exactly the arrays of ``plan`` (shapes and dtypes).

    Pools of another plan (another page count, row format or group list) would otherwise make
    the jitted step retrace for the new shapes and read or write pages the coordinator's state
    never handed out.
    """
    if not isinstance(pools, Pools):
        fail(
            "pools",
            type(pools).__name__,
            "it must be the Pools of the step's plan",
            "create them with flatkv_jax.pools.create_pools(plan)",
            exc=TypeError,
        )
    fix = (
        "create the pools with create_pools(plan) for the plan the step is built with "
        "(or build the step for the plan the pools came from)"
    )
    specs = pool_specs(plan)
    got = pools.arrays
    if not isinstance(got, tuple) or len(got) != len(specs):
        fail("pools", f"{_count(got)} groups", f"the plan has {len(specs)} groups", fix)
    for g, g_spec, g_got in zip(plan.groups, specs, got, strict=True):
        shape_ok = isinstance(g_got, tuple) and len(g_got) == len(g_spec)
        shape_ok = shape_ok and all(
            isinstance(f, tuple) and len(f) == len(s) for f, s in zip(g_got, g_spec, strict=True)
        )
        if not shape_ok:
            fail(
                f"pools[{g.name}]",
                f"{_count(g_got)} fields",
                f"the plan's group {g.name!r} has fields {[f.name for f in g.fields]} "
                f"for layers {list(g.layers)}",
                fix,
            )
        for f, f_spec, f_got in zip(g.fields, g_spec, g_got, strict=True):
            for layer, spec, a in zip(g.layers, f_spec, f_got, strict=True):
                if not hasattr(a, "shape") or tuple(a.shape) != spec.shape or a.dtype != spec.dtype:
                    have = (tuple(a.shape), str(a.dtype)) if hasattr(a, "shape") else type(a)
                    fail(
                        f"pools[{g.name}.{f.name}, layer {layer}]",
                        have,
                        f"the plan's array is shape {spec.shape} of {spec.dtype.name} "
                        f"({plan.pages(g)} pages); these pools were built for "
                        "another plan",
                        fix,
                    )


def _count(x) -> int | str:
    return len(x) if isinstance(x, tuple) else type(x).__name__


def check_step_inputs(
    cfg: ModelConfig,
    plan: CachePlan,
    pools: Pools,
    batch: StepBatch,
    meta: StepMetadata,
    table_buffer: jax.Array,
    max_count: int | None = None,
) -> None:
    """Raises ValueError/TypeError for step inputs whose shapes or dtypes do not fit ``plan``."""
    check_model_plan(cfg, plan)
    check_pools(plan, pools)
    if not isinstance(batch, StepBatch):
        fail(
            "batch",
            type(batch).__name__,
            "the step takes a StepBatch",
            "pass StepBatch(tokens=..., prev_hidden=...)",
            exc=TypeError,
        )
    s, r = plan.limits.step_tokens, plan.limits.max_requests
    _check_array("tokens", batch.tokens, (s,), jnp.int32)
    _check_array("prev_hidden", batch.prev_hidden, (r, cfg.hidden), jnp.float32)
    check_metadata(plan, meta, table_buffer, max_count)


def check_draft_inputs(
    cfg: ModelConfig,
    plan: CachePlan,
    pools: Pools,
    batch: DraftBatch,
    meta: StepMetadata,
    table_buffer: jax.Array,
    num_draft: int,
    max_count: int | None = None,
) -> None:
    """Raises ValueError/TypeError for ``propose`` inputs that do not fit ``cfg`` and ``plan``."""
    check_model_plan(cfg, plan)
    check_draft_config(cfg, num_draft)
    check_pools(plan, pools)
    if not isinstance(batch, DraftBatch):
        fail(
            "batch",
            type(batch).__name__,
            "propose takes a DraftBatch",
            "pass DraftBatch(tokens=..., prev_hidden=..., active=...)",
            exc=TypeError,
        )
    r = plan.limits.max_requests
    _check_array("tokens", batch.tokens, (r,), jnp.int32)
    _check_array("prev_hidden", batch.prev_hidden, (r, cfg.hidden), jnp.float32)
    _check_array("active", batch.active, (r,), jnp.bool_)
    check_metadata(plan, meta, table_buffer, max_count)


def check_metadata(
    plan: CachePlan, meta: StepMetadata, table_buffer: jax.Array, max_count: int | None = None
) -> None:
    """Raises unless ``meta`` is the coordinator's metadata for ``plan`` at ``max_count`` and
    ``table_buffer`` its flat table buffer."""
    if not isinstance(meta, StepMetadata):
        fail(
            "meta",
            type(meta).__name__,
            "it must be the coordinator's StepMetadata",
            "build it with flatkv_jax.coordinator.step_metadata",
            exc=TypeError,
        )
    t, n_g = plan.limits.step_tokens, len(plan.groups)
    for name in ("token_slot", "token_pos", "token_row"):
        _check_array(f"meta.{name}", getattr(meta, name), (t,), jnp.int32)
    _check_array("meta.write_slot", meta.write_slot, (n_g, t), jnp.int32)
    rows = meta.row_slot
    if not hasattr(rows, "shape") or rows.ndim != 1:
        fail(
            "meta.row_slot",
            getattr(rows, "shape", rows),
            "a rank-1 int32 array",
            "use step_metadata",
        )
    s = rows.shape[0]
    for name in ("row_slot", "row_start", "row_count", "row_offset"):
        _check_array(f"meta.{name}", getattr(meta, name), (s,), jnp.int32)
    cols = sum(n for _, n in columns(plan, max_count))
    if tuple(getattr(meta.window_pages, "shape", ())[1:]) != (cols,):
        fail(
            "meta.window_pages",
            _shape_dtype(meta.window_pages),
            f"expected shape {(s, cols)} and dtype int32: the window columns of "
            f"max_count={resolve_max_count(plan, max_count)}",
            "pass the step the same max_count as the step's admit/extend and step_metadata "
            "calls (or build the metadata from this plan)",
        )
    _check_array("meta.window_pages", meta.window_pages, (s, cols), jnp.int32)
    _check_array("meta.window_first_block", meta.window_first_block, (n_g, s), jnp.int32)
    z = meta.zero
    if not hasattr(z, "shape") or z.ndim != 2 or z.shape[0] != n_g or z.dtype != jnp.int32:
        fail(
            "meta.zero",
            getattr(z, "shape", z),
            f"an int32 array [{n_g}, K] (one zero list per group) padded with -1",
            "use step_metadata",
        )
    size = table_size(plan)
    if tuple(getattr(table_buffer, "shape", ())) != (size,):
        fail(
            "table_buffer",
            _shape_dtype(table_buffer),
            f"expected shape {(size,)} and dtype int32: the state's table buffer of this plan",
            "pass CacheState.table_buffer of a state created with create_state(plan) for this plan",
        )
    _check_array("table_buffer", table_buffer, (size,), jnp.int32)


def _shape_dtype(a) -> object:
    return (tuple(a.shape), str(a.dtype)) if hasattr(a, "shape") else type(a).__name__


def check_draft_config(cfg: ModelConfig, num_draft: object) -> None:
    """Raises unless ``cfg`` has the MTP draft layer and ``num_draft`` is an int >= 1."""
    if not cfg.has_mtp:
        fail(
            "cfg",
            "num_mtp_layers=0",
            "propose needs the MTP draft layer",
            "use a config with num_mtp_layers=1",
        )
    if not isinstance(num_draft, int) or isinstance(num_draft, bool) or num_draft < 1:
        fail(
            "num_draft",
            num_draft,
            "it must be an int >= 1",
            "pass e.g. num_draft=plan.limits.verify_width",
        )


def check_token_ids(tokens) -> jax.Array:
    """Returns ``tokens`` as an array; raises unless it is one int32 sequence."""
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 1 or tokens.dtype != jnp.int32:
        fail(
            "tokens",
            (tokens.shape, str(tokens.dtype)),
            "one sequence of int32 token ids",
            "pass jnp.asarray(ids, jnp.int32)",
        )
    return tokens


#: The former name of :func:`check_model_plan`, kept for existing callers.
check_plan = check_model_plan
