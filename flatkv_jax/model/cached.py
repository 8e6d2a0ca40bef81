"""The cached step: the model reading and writing the flat pools as a serving stack would.

Cache-side inputs are only what the coordinator publishes per step: its
:class:`~flatkv_jax.coordinator.StepMetadata` (flat token layout, write slots, window read
pages, zero lists) and its flat table buffer (``CacheState.table_buffer``, read for the
history groups with the state layout's offsets and strides). Nothing here recomputes an
address the coordinator publishes; :mod:`flatkv_jax.model.addressing` is the consumer-side
reading of the metadata.

Order per pool array inside one step (XLA copies a donated pool that is read before it is
mutated, see docs/model.md): every zero-listed page of every pool is zeroed first; then layer by
layer each (group, field, layer) array is written, then read. The draft proposer repeats
write/read rounds inside a ``lax.fori_loop`` that carries the draft pool.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from flatkv_jax import plan as plan_lib
from flatkv_jax.coordinator.metadata import StepMetadata, window_columns
from flatkv_jax.coordinator.ops import resolve_max_count
from flatkv_jax.coordinator.state import table_size
from flatkv_jax.errors import fail
from flatkv_jax.groups import GroupSpec, Owner
from flatkv_jax.model import layers as L
from flatkv_jax.model import quant
from flatkv_jax.model.addressing import gather, history_address, window_address, window_positions
from flatkv_jax.model.config import ModelConfig
from flatkv_jax.model.params import CompressorParams, LayerParams, Params
from flatkv_jax.plan import CachePlan
from flatkv_jax.pools import Pools
from flatkv_jax.recipes.deepseek_v4 import deepseek_v4_groups
from kernels_pallas import Impl
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
    """Inputs of :func:`propose`, indexed by request slot.

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


class _PoolEditor:
    """Trace-time view of the pool arrays that lets layers replace one (group, field, layer)."""

    def __init__(self, plan: CachePlan, arrays: list):
        self.plan = plan
        self.arrays = arrays

    @classmethod
    def of(cls, plan: CachePlan, pools: Pools) -> _PoolEditor:
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

    def zero(self, gi: int, page_ids: jax.Array, impl: Impl) -> None:
        zeroed = self.pools().zero_group(gi, page_ids, impl=impl)
        self.arrays[gi] = [list(per_field) for per_field in zeroed.arrays[gi]]

    def pools(self) -> Pools:
        return Pools(tuple(tuple(tuple(f) for f in g) for g in self.arrays))


@dataclasses.dataclass(frozen=True)
class _Ctx:
    """Static context of one traced call plus the addressing of ``N`` tokens.

    ``slot``, ``pos`` and ``row`` (metadata row) are ``[N]`` with ``-1`` for idle tokens;
    ``write_slot`` is ``[G, N]``, the coordinator's write slots of those tokens.
    """

    cfg: ModelConfig
    plan: CachePlan
    impl: Impl
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
        self, ed: _PoolEditor, g: GroupSpec, field: str, layer: int, rows: jax.Array
    ) -> jax.Array:
        """Writes each token's row at the coordinator's write slot; returns the new array."""
        slots = self.write_slot[self.plan.group_index(g.name)]
        pool = _write_rows(ed.get(g, field, layer), rows, slots, impl=self.impl)
        ed.set(g, field, layer, pool)
        return pool


def _compress(
    ctx: _Ctx,
    ed: _PoolEditor,
    cp: CompressorParams,
    xn,
    state: str,
    out: tuple[str, str],
    layer: int,
    rope_dim: int,
):
    """Writes this step's compressor state rows, then the compressed rows they complete."""
    gs = ctx.plan.group(state)
    pool = ctx.write(ed, gs, "state", layer, L.compressor_state(cp, xn, ctx.safe_pos))
    ratio = cp.ape.shape[1]
    page, row, ok = ctx.read_window(gs, L.window_span(cp))
    crow = L.compress_window(
        cp, gather(pool, page, row), ok, ctx.safe_pos // ratio, rope_dim, ctx.cfg
    )
    gc = ctx.plan.group(out[0])
    ctx.write(ed, gc, out[1], layer, quant.encode(gc.field(out[1]).format, crow))


def _compressed_keys(ctx: _Ctx, ed: _PoolEditor, lp: LayerParams, xn, layer: int, ratio: int):
    """Keys (= values) and mask from the compressed chain: top-k rows (CSA) or all rows (HCA)."""
    cfg = ctx.cfg
    gc = ctx.plan.group(f"c{ratio}_kv")
    n_rows = ctx.plan.table_width(gc) * gc.rows_per_page
    j = jnp.arange(n_rows, dtype=jnp.int32)
    page, row, ok = ctx.read_history(gc, jnp.broadcast_to(j[None, :], (ctx.pos.shape[0], n_rows)))
    visible = ok & (j[None, :] < ((ctx.safe_pos + 1) // ratio)[:, None])
    kv_fmt = gc.field("kv").format
    if ratio == cfg.cache.csa_ratio:
        ikeys = quant.decode(
            gc.field("index_key").format, gather(ed.get(gc, "index_key", layer), page, row)
        )
        iq, iw = L.index_queries(lp.indexer, xn, ctx.safe_pos, cfg)
        idx, chosen = L.top_k_rows(L.index_scores(iq, iw, ikeys), visible, cfg.cache.index_topk)
        page = jnp.take_along_axis(page, idx, axis=1)
        row = jnp.take_along_axis(row, idx, axis=1)
        return quant.decode(kv_fmt, gather(ed.get(gc, "kv", layer), page, row)), chosen
    return quant.decode(kv_fmt, gather(ed.get(gc, "kv", layer), page, row)), visible


def _layer(ctx: _Ctx, ed: _PoolEditor, lp: LayerParams, x, layer: int, ratio: int, swa: str):
    """One layer over the step's tokens: SWA write/read, compressor(s), attention, MLP."""
    cfg = ctx.cfg
    xn, q, kv = L.project_qkv(lp, x, ctx.safe_pos, cfg)
    g = ctx.plan.group(swa)
    fmt = g.field("kv").format
    pool = ctx.write(ed, g, "kv", layer, quant.encode(fmt, kv))
    page, row, ok = ctx.read_window(g, cfg.window)
    keys, mask = quant.decode(fmt, gather(pool, page, row)), ok
    if ratio:
        _compress(
            ctx,
            ed,
            lp.compressor,
            xn,
            f"c{ratio}_state",
            (f"c{ratio}_kv", "kv"),
            layer,
            cfg.rope_dim,
        )
        if ratio == cfg.cache.csa_ratio:
            state = f"c{ratio}_index_state"
            _compress(
                ctx,
                ed,
                lp.indexer.compressor,
                xn,
                state,
                (f"c{ratio}_kv", "index_key"),
                layer,
                cfg.index_rope_dim,
            )
        ckeys, cmask = _compressed_keys(ctx, ed, lp, xn, layer, ratio)
        keys = jnp.concatenate([keys, ckeys], axis=1)
        mask = jnp.concatenate([mask, cmask], axis=1)
    return L.finish_layer(lp, x, L.attend(q, keys, mask, lp.sink), cfg)


# --- validation (trace time: shapes and dtypes only) -------------------------------------------
def check_plan(cfg: ModelConfig, plan: CachePlan) -> None:
    """Raises unless ``plan`` holds exactly the groups of ``cfg`` (at the plan's verify width)."""
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


def check_step_inputs(
    cfg: ModelConfig,
    plan: CachePlan,
    batch: StepBatch,
    meta: StepMetadata,
    table_buffer: jax.Array,
    max_count: int | None = None,
) -> None:
    """Raises ValueError/TypeError for inputs whose shapes or dtypes do not fit ``plan``."""
    check_plan(cfg, plan)
    s, r = plan.limits.step_tokens, plan.limits.max_requests
    _check_array("tokens", batch.tokens, (s,), jnp.int32)
    _check_array("prev_hidden", batch.prev_hidden, (r, cfg.hidden), jnp.float32)
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
    cols = sum(n for _, n in window_columns(plan, max_count))
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
    _check_array("table_buffer", table_buffer, (table_size(plan),), jnp.int32)


# --- the step -----------------------------------------------------------------------------------
def _columns(plan: CachePlan, max_count: int | None):
    return window_columns(plan, resolve_max_count(plan, max_count))


def step(
    params: Params,
    pools: Pools,
    batch: StepBatch,
    meta: StepMetadata,
    table_buffer: jax.Array,
    *,
    cfg: ModelConfig,
    plan: CachePlan,
    max_count: int | None = None,
    impl: Impl | str = Impl.REFERENCE,
) -> tuple[StepOutput, Pools]:
    """One serving step of the target model (and the MTP layer over the same tokens).

    Use :func:`make_step` for the jitted version with ``pools`` donated.

    Args:
      params: model parameters.
      pools: every pool of ``plan`` (donated by :func:`make_step`).
      batch: tokens (on the metadata's flat token axis) and per-request previous hidden states.
      meta: the coordinator's :class:`~flatkv_jax.coordinator.StepMetadata` of this step: the
        token layout, ``write_slot``, the window read index and the zero lists (all applied,
        every pool of every group, before anything is written).
      table_buffer: int32 ``CacheState.table_buffer`` (read only; the history groups' read
        index, at the state layout's offsets and strides).
      cfg, plan: static model config and cache plan (``plan.groups`` must be the recipe groups
        of ``cfg.cache``).
      max_count: the static per-row bound the step's admit/extend calls and
        ``step_metadata`` used (sizes the window columns; default as the coordinator's).
      impl: kernel implementation for ``write_rows`` / ``zero_pages``.

    Returns:
      ``(StepOutput, pools)`` with this step's rows written into ``pools``.
    """
    check_step_inputs(cfg, plan, batch, meta, table_buffer, max_count)
    impl = Impl(impl)
    ed = _PoolEditor.of(plan, pools)
    for gi in range(len(plan.groups)):
        ed.zero(gi, meta.zero[gi], impl)
    ctx = _Ctx(
        cfg,
        plan,
        impl,
        meta,
        table_buffer,
        _columns(plan, max_count),
        meta.token_slot,
        meta.token_pos,
        meta.token_row,
        meta.write_slot,
    )
    tokens = jnp.where(ctx.live, batch.tokens, 0)
    x = params.embed[tokens]
    for i, lp in enumerate(params.layers):
        x = _layer(ctx, ed, lp, x, i, cfg.ratio(i), "swa_kv")
    logits = L.logits_of(params.head, params.final_norm, x, cfg)
    draft_logits = None
    if cfg.has_mtp:
        mp = params.mtp
        # The MTP layer at position q reads the target hidden of q - 1: the previous flat token
        # when it belongs to the same metadata row (rows are contiguous, ascending positions),
        # else the carried prev_hidden.
        row = meta.token_row
        chained = jnp.concatenate([jnp.zeros((1,), bool), row[1:] == row[:-1]]) & ctx.live
        shifted = jnp.concatenate([jnp.zeros_like(x[:1]), x[:-1]], axis=0)
        carried = batch.prev_hidden[jnp.clip(meta.token_slot, 0, plan.limits.max_requests - 1)]
        prev = jnp.where(chained[:, None], shifted, carried)
        g = L.mtp_input(mp, params.embed[tokens], prev, cfg)
        g = _layer(ctx, ed, mp.layer, g, cfg.cache.mtp_layers[0], 0, "mtp_swa_kv")
        draft_logits = L.logits_of(params.head, mp.final_norm, g, cfg)
    return StepOutput(logits=logits, hidden=x, draft_logits=draft_logits), ed.pools()


def propose(
    params: Params,
    pools: Pools,
    batch: DraftBatch,
    meta: StepMetadata,
    table_buffer: jax.Array,
    *,
    cfg: ModelConfig,
    plan: CachePlan,
    num_draft: int,
    max_count: int | None = None,
    impl: Impl | str = Impl.REFERENCE,
) -> tuple[DraftOutput, Pools]:
    """The MTP layer proposes ``num_draft`` tokens per active request, greedily, one position
    at a time, into the verify block the coordinator just scheduled.

    Call it with the same metadata as the verify :func:`step` that follows. Position
    ``row_start + i`` of an active request's metadata row reads ``(hidden, token)`` — the
    target hidden and chosen token for ``i = 0``, then the draft's own hidden and proposal —
    and writes its row of the draft pool ``mtp_swa_kv`` at the coordinator's write slot. The
    verify step overwrites those rows with target-hidden inputs, so accepted positions end up
    exactly as a dense recompute.

    Args:
      params, pools: as in :func:`step` (only the draft-owned pools are touched).
      batch: per request slot, the start token, previous target hidden and whether it proposes.
      meta, table_buffer, max_count: as in :func:`step`; only the zero lists of draft-owned
        groups are applied here (a page handed out by ``extend`` must be zeroed by the first
        function that touches its pool; the step zeroes it again, harmlessly, since only
        positions it rewrites live in new pages).
      cfg, plan, impl: as in :func:`step`.
      num_draft: tokens to propose (``>= 1``, static; a proposing row needs ``row_count >=
        num_draft``).

    Returns:
      ``(DraftOutput, pools)``.
    """
    check_plan(cfg, plan)
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
    r = plan.limits.max_requests
    _check_array("tokens", batch.tokens, (r,), jnp.int32)
    _check_array("prev_hidden", batch.prev_hidden, (r, cfg.hidden), jnp.float32)
    _check_array("active", batch.active, (r,), jnp.bool_)
    check_metadata(plan, meta, table_buffer, max_count)
    impl = Impl(impl)
    ed = _PoolEditor.of(plan, pools)
    for gi, g in enumerate(plan.groups):
        if g.owner is Owner.DRAFT:
            ed.zero(gi, meta.zero[gi], impl)
    gi = plan.group_index("mtp_swa_kv")
    columns = _columns(plan, max_count)
    s, t = meta.row_slot.shape[0], plan.limits.step_tokens
    slot = meta.row_slot
    on = (
        (slot >= 0)
        & batch.active[jnp.clip(slot, 0, r - 1)]
        & (meta.row_offset >= 0)
        & (meta.row_count >= num_draft)
    )
    rows = jnp.arange(s, dtype=jnp.int32)
    safe = jnp.clip(slot, 0, r - 1)
    mp, layer = params.mtp, cfg.cache.mtp_layers[0]

    def body(i, carry):
        flat, tok, hid, out_tok, out_logits = carry
        # Only the draft pool travels through the loop; the editor sees just that group.
        loop_ed = _PoolEditor(plan, [None] * len(plan.groups))
        loop_ed.arrays[gi] = [list(flat)]
        ti = meta.row_offset + i
        live = on & (ti < t)
        write = jnp.where(live[None, :], meta.write_slot[:, jnp.clip(ti, 0, t - 1)], -1)
        ctx = _Ctx(
            cfg,
            plan,
            impl,
            meta,
            table_buffer,
            columns,
            jnp.where(live, slot, -1),
            jnp.where(live, meta.row_start + i, -1),
            jnp.where(live, rows, -1),
            write,
        )
        g = L.mtp_input(mp, params.embed[tok], hid, cfg)
        g = _layer(ctx, loop_ed, mp.layer, g, layer, 0, "mtp_swa_kv")
        logits = L.logits_of(params.head, mp.final_norm, g, cfg)
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out_tok = jax.lax.dynamic_update_slice_in_dim(out_tok, nxt[:, None], i, axis=1)
        out_logits = jax.lax.dynamic_update_slice_in_dim(out_logits, logits[:, None], i, axis=1)
        return tuple(loop_ed.arrays[gi][0]), nxt, g, out_tok, out_logits

    init = (
        tuple(ed.arrays[gi][0]),
        jnp.where(on, batch.tokens[safe], 0),
        batch.prev_hidden[safe],
        jnp.zeros((s, num_draft), jnp.int32),
        jnp.zeros((s, num_draft, cfg.vocab), jnp.float32),
    )
    flat, _, _, out_tok, out_logits = jax.lax.fori_loop(0, num_draft, body, init)
    ed.arrays[gi] = [list(flat)]
    return DraftOutput(tokens=out_tok, logits=out_logits), ed.pools()


def make_step(
    cfg: ModelConfig,
    plan: CachePlan,
    *,
    max_count: int | None = None,
    impl: Impl | str = Impl.REFERENCE,
):
    """``jax.jit`` of :func:`step` for one (cfg, plan): ``fn(params, pools, batch, meta,
    table_buffer)``.

    ``pools`` (argument 1) is donated: the step updates the pools in place and the caller must
    use the returned pools. Every batch composition of the plan's fixed shapes reuses one
    compilation (per metadata row count, i.e. per tuple of results given to ``step_metadata``).
    """
    check_plan(cfg, plan)
    mc = resolve_max_count(plan, max_count)
    return jax.jit(
        functools.partial(step, cfg=cfg, plan=plan, max_count=mc, impl=Impl(impl)),
        donate_argnums=1,
    )


def make_propose(
    cfg: ModelConfig,
    plan: CachePlan,
    *,
    num_draft: int | None = None,
    max_count: int | None = None,
    impl: Impl | str = Impl.REFERENCE,
):
    """``jax.jit`` of :func:`propose`: ``fn(params, pools, batch, meta, table_buffer)``, pools
    donated.

    ``num_draft`` defaults to ``plan.limits.verify_width``.
    """
    check_plan(cfg, plan)
    k = plan.limits.verify_width if num_draft is None else num_draft
    mc = resolve_max_count(plan, max_count)
    return jax.jit(
        functools.partial(propose, cfg=cfg, plan=plan, num_draft=k, max_count=mc, impl=Impl(impl)),
        donate_argnums=1,
    )
