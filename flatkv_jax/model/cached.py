"""The cached step: the model reading and writing the flat pools as a serving stack would.

Cache-side inputs are only what the coordinator publishes per step (:class:`StepMeta`): the
flat token layout (request slot and absolute position of each token, ``-1`` = idle), the
absolute table of every group and the zero list of every pool. Write slots and read addresses
are derived here from tables + positions (:mod:`flatkv_jax.model.addressing`).

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

from flatkv_jax.errors import fail
from flatkv_jax.groups import GroupSpec, Owner
from flatkv_jax.model import layers as L
from flatkv_jax.model import quant
from flatkv_jax.model.addressing import gather, row_address, window_positions, write_slots
from flatkv_jax.model.config import ModelConfig
from flatkv_jax.model.params import CompressorParams, LayerParams, Params
from flatkv_jax.plan import CachePlan
from flatkv_jax.pools import Pools
from flatkv_jax.recipes.deepseek_v4 import deepseek_v4_groups
from kernels_pallas import Impl
from kernels_pallas import write_rows as _write_rows
from kernels_pallas import zero_pages as _zero_pages


def _dataclass(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_dataclass
class StepMeta:
    """What the coordinator publishes for one step (every array int32, fixed shapes).

    Attributes:
      token_slot: ``[step_tokens]`` request slot of each flat token, ``-1`` = idle. The tokens
        of one request are contiguous and in ascending position order (the MTP layer reads the
        hidden state of the previous flat token when it is the same request's previous position).
      token_pos: ``[step_tokens]`` absolute position of each token, ``-1`` = idle.
      tables: per group (plan order) the absolute table ``[max_requests, table_width(g)]``.
      zero_pages: per group the pages to zero before anything reads that pool, ``[K_g]``
        padded with ``-1`` (any ``K_g``).
    """

    token_slot: jax.Array
    token_pos: jax.Array
    tables: tuple[jax.Array, ...]
    zero_pages: tuple[jax.Array, ...]


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
    """Inputs of :func:`propose`, one row per request slot.

    Attributes:
      tokens: int32 ``[max_requests]`` the token at ``start_pos`` (the one the target just chose).
      start_pos: int32 ``[max_requests]`` first draft position, ``-1`` = this slot proposes nothing.
      prev_hidden: float32 ``[max_requests, hidden]`` target hidden of ``start_pos - 1``.
    """

    tokens: jax.Array
    start_pos: jax.Array
    prev_hidden: jax.Array


@_dataclass
class DraftOutput:
    """``tokens int32 [max_requests, k]`` (greedy proposals for positions ``start_pos + 1 ..
    start_pos + k``) and their ``logits float32 [max_requests, k, vocab]``."""

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
        flat = tuple(a for per_field in self.arrays[gi] for a in per_field)
        it = iter(_zero_pages(flat, page_ids, impl=impl))
        self.arrays[gi] = [[next(it) for _ in per_field] for per_field in self.arrays[gi]]

    def pools(self) -> Pools:
        return Pools(tuple(tuple(tuple(f) for f in g) for g in self.arrays))


@dataclasses.dataclass(frozen=True)
class _Ctx:
    """Static context of one traced call plus the step's token layout."""

    cfg: ModelConfig
    plan: CachePlan
    impl: Impl
    tables: dict
    token_slot: jax.Array
    token_pos: jax.Array

    @property
    def live(self) -> jax.Array:
        return (self.token_pos >= 0) & (self.token_slot >= 0)

    @property
    def pos(self) -> jax.Array:
        """Positions with idle tokens at 0 (so the math stays finite; their rows are skipped)."""
        return jnp.where(self.live, self.token_pos, 0)

    def read_rows(self, g: GroupSpec, rows: jax.Array):
        """Addresses of rows ``rows [S, E]`` (``< 0`` = none) of each token's own request."""
        rows = jnp.where(self.live[:, None], rows, -1)
        return row_address(g, self.tables[g.name], self.token_slot[:, None], rows)

    def write(
        self, ed: _PoolEditor, g: GroupSpec, field: str, layer: int, rows: jax.Array
    ) -> jax.Array:
        """Writes each token's row (where it completes one) and returns the updated array."""
        slots = write_slots(g, self.tables[g.name], self.token_slot, self.token_pos)
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
    pool = ctx.write(ed, gs, "state", layer, L.compressor_state(cp, xn, ctx.pos))
    ratio = cp.ape.shape[1]
    page, row, ok = ctx.read_rows(gs, window_positions(ctx.token_pos, L.window_span(cp)))
    crow = L.compress_window(cp, gather(pool, page, row), ok, ctx.pos // ratio, rope_dim, ctx.cfg)
    gc = ctx.plan.group(out[0])
    ctx.write(ed, gc, out[1], layer, quant.encode(gc.field(out[1]).format, crow))


def _compressed_keys(ctx: _Ctx, ed: _PoolEditor, lp: LayerParams, xn, layer: int, ratio: int):
    """Keys (= values) and mask from the compressed chain: top-k rows (CSA) or all rows (HCA)."""
    cfg = ctx.cfg
    gc = ctx.plan.group(f"c{ratio}_kv")
    n_rows = ctx.plan.table_width(gc) * gc.rows_per_page
    j = jnp.arange(n_rows, dtype=jnp.int32)
    page, row, ok = ctx.read_rows(
        gc, jnp.broadcast_to(j[None, :], (ctx.token_pos.shape[0], n_rows))
    )
    visible = ok & (j[None, :] < ((ctx.pos + 1) // ratio)[:, None])
    kv_fmt = gc.field("kv").format
    if ratio == cfg.cache.csa_ratio:
        ikeys = quant.decode(
            gc.field("index_key").format, gather(ed.get(gc, "index_key", layer), page, row)
        )
        iq, iw = L.index_queries(lp.indexer, xn, ctx.pos, cfg)
        idx, chosen = L.top_k_rows(L.index_scores(iq, iw, ikeys), visible, cfg.cache.index_topk)
        page = jnp.take_along_axis(page, idx, axis=1)
        row = jnp.take_along_axis(row, idx, axis=1)
        return quant.decode(kv_fmt, gather(ed.get(gc, "kv", layer), page, row)), chosen
    return quant.decode(kv_fmt, gather(ed.get(gc, "kv", layer), page, row)), visible


def _layer(ctx: _Ctx, ed: _PoolEditor, lp: LayerParams, x, layer: int, ratio: int, swa: str):
    """One layer over the step's tokens: SWA write/read, compressor(s), attention, MLP."""
    cfg = ctx.cfg
    xn, q, kv = L.project_qkv(lp, x, ctx.pos, cfg)
    g = ctx.plan.group(swa)
    fmt = g.field("kv").format
    pool = ctx.write(ed, g, "kv", layer, quant.encode(fmt, kv))
    page, row, ok = ctx.read_rows(g, window_positions(ctx.token_pos, cfg.window))
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
    if not isinstance(plan, CachePlan):
        fail(
            "plan",
            plan,
            "it must be a CachePlan",
            "build it with plan_with_pages or plan_for_budget",
            exc=TypeError,
        )
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


def _check_cache(plan: CachePlan, tables, zero_pages) -> None:
    n = len(plan.groups)
    if not isinstance(tables, tuple) or len(tables) != n:
        fail(
            "tables",
            type(tables).__name__,
            f"one table per group ({n}), a tuple in plan order",
            "pass a tuple of tables",
        )
    if not isinstance(zero_pages, tuple) or len(zero_pages) != n:
        fail(
            "zero_pages",
            type(zero_pages).__name__,
            f"one zero list per group ({n}), a tuple in plan order",
            "pass a tuple",
        )
    for g, t, z in zip(plan.groups, tables, zero_pages, strict=True):
        _check_array(f"tables[{g.name}]", t, plan.table_shape(g), jnp.int32)
        if not hasattr(z, "shape") or z.ndim != 1 or z.dtype != jnp.int32:
            fail(
                f"zero_pages[{g.name}]",
                getattr(z, "shape", z),
                "a rank-1 int32 array padded with -1",
                "pass jnp.full((K,), -1, jnp.int32)",
            )


def check_step_inputs(cfg: ModelConfig, plan: CachePlan, batch: StepBatch, meta: StepMeta) -> None:
    """Raises ValueError/TypeError for inputs whose shapes or dtypes do not fit ``plan``."""
    check_plan(cfg, plan)
    s, r = plan.limits.step_tokens, plan.limits.max_requests
    _check_array("token_slot", meta.token_slot, (s,), jnp.int32)
    _check_array("token_pos", meta.token_pos, (s,), jnp.int32)
    _check_array("tokens", batch.tokens, (s,), jnp.int32)
    _check_array("prev_hidden", batch.prev_hidden, (r, cfg.hidden), jnp.float32)
    _check_cache(plan, meta.tables, meta.zero_pages)


# --- the step -----------------------------------------------------------------------------------
def step(
    params: Params,
    pools: Pools,
    batch: StepBatch,
    meta: StepMeta,
    *,
    cfg: ModelConfig,
    plan: CachePlan,
    impl: Impl | str = Impl.REFERENCE,
) -> tuple[StepOutput, Pools]:
    """One serving step of the target model (and the MTP layer over the same tokens).

    Use :func:`make_step` for the jitted version with ``pools`` donated.

    Args:
      params: model parameters.
      pools: every pool of ``plan`` (donated by :func:`make_step`).
      batch: tokens and per-request previous hidden states.
      meta: the coordinator's step metadata.
      cfg, plan: static model config and cache plan (``plan.groups`` must be the recipe groups
        of ``cfg.cache``).
      impl: kernel implementation for ``write_rows`` / ``zero_pages``.

    Returns:
      ``(StepOutput, pools)`` with this step's rows written into ``pools``.
    """
    check_step_inputs(cfg, plan, batch, meta)
    impl = Impl(impl)
    ed = _PoolEditor.of(plan, pools)
    for gi in range(len(plan.groups)):
        ed.zero(gi, meta.zero_pages[gi], impl)
    ctx = _Ctx(
        cfg,
        plan,
        impl,
        {g.name: t for g, t in zip(plan.groups, meta.tables, strict=True)},
        meta.token_slot,
        meta.token_pos,
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
        # when it is the same request's previous position, else the carried prev_hidden.
        slot, pos = meta.token_slot, meta.token_pos
        chained = (slot[1:] == slot[:-1]) & (pos[1:] == pos[:-1] + 1)
        chained = jnp.concatenate([jnp.zeros((1,), bool), chained]) & ctx.live
        shifted = jnp.concatenate([jnp.zeros_like(x[:1]), x[:-1]], axis=0)
        carried = batch.prev_hidden[jnp.clip(slot, 0, plan.limits.max_requests - 1)]
        prev = jnp.where(chained[:, None], shifted, carried)
        g = L.mtp_input(mp, params.embed[tokens], prev, cfg)
        g = _layer(ctx, ed, mp.layer, g, cfg.cache.mtp_layers[0], 0, "mtp_swa_kv")
        draft_logits = L.logits_of(params.head, mp.final_norm, g, cfg)
    return StepOutput(logits=logits, hidden=x, draft_logits=draft_logits), ed.pools()


def propose(
    params: Params,
    pools: Pools,
    batch: DraftBatch,
    tables: tuple[jax.Array, ...],
    zero_pages: tuple[jax.Array, ...],
    *,
    cfg: ModelConfig,
    plan: CachePlan,
    num_draft: int,
    impl: Impl | str = Impl.REFERENCE,
) -> tuple[DraftOutput, Pools]:
    """The MTP layer proposes ``num_draft`` tokens per request, greedily, one position at a time.

    Position ``start_pos + i`` reads ``(hidden, token)`` — the target hidden and chosen token
    for ``i = 0``, then the draft's own hidden and proposal — and writes its row of the draft
    pool ``mtp_swa_kv``. The rows of positions a later verify step covers are overwritten there
    with target-hidden inputs, so accepted positions end up exactly as a dense recompute.

    Args:
      params, pools: as in :func:`step` (only the draft-owned pools are touched).
      batch: per request slot, the start token, position and previous target hidden.
      tables, zero_pages: per group (plan order), as in :class:`StepMeta`; only the zero lists
        of draft-owned groups are applied (a page handed out by ``extend`` must be zeroed by the
        first function that touches its pool).
      cfg, plan, impl: as in :func:`step`.
      num_draft: tokens to propose (``>= 1``, static).

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
    _check_array("start_pos", batch.start_pos, (r,), jnp.int32)
    _check_array("prev_hidden", batch.prev_hidden, (r, cfg.hidden), jnp.float32)
    _check_cache(plan, tables, zero_pages)
    impl = Impl(impl)
    ed = _PoolEditor.of(plan, pools)
    for gi, g in enumerate(plan.groups):
        if g.owner is Owner.DRAFT:
            ed.zero(gi, zero_pages[gi], impl)
    gi = plan.group_index("mtp_swa_kv")
    named = {g.name: t for g, t in zip(plan.groups, tables, strict=True)}
    live = batch.start_pos >= 0
    slot = jnp.where(live, jnp.arange(r, dtype=jnp.int32), -1)
    mp, layer = params.mtp, cfg.cache.mtp_layers[0]

    def body(i, carry):
        flat, tok, hid, out_tok, out_logits = carry
        # Only the draft pool travels through the loop; the editor sees just that group.
        loop_ed = _PoolEditor(plan, [None] * len(plan.groups))
        loop_ed.arrays[gi] = [list(flat)]
        ctx = _Ctx(cfg, plan, impl, named, slot, jnp.where(live, batch.start_pos + i, -1))
        g = L.mtp_input(mp, params.embed[tok], hid, cfg)
        g = _layer(ctx, loop_ed, mp.layer, g, layer, 0, "mtp_swa_kv")
        logits = L.logits_of(params.head, mp.final_norm, g, cfg)
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out_tok = jax.lax.dynamic_update_slice_in_dim(out_tok, nxt[:, None], i, axis=1)
        out_logits = jax.lax.dynamic_update_slice_in_dim(out_logits, logits[:, None], i, axis=1)
        return tuple(loop_ed.arrays[gi][0]), nxt, g, out_tok, out_logits

    init = (
        tuple(ed.arrays[gi][0]),
        jnp.where(live, batch.tokens, 0),
        batch.prev_hidden,
        jnp.zeros((r, num_draft), jnp.int32),
        jnp.zeros((r, num_draft, cfg.vocab), jnp.float32),
    )
    flat, _, _, out_tok, out_logits = jax.lax.fori_loop(0, num_draft, body, init)
    ed.arrays[gi] = [list(flat)]
    return DraftOutput(tokens=out_tok, logits=out_logits), ed.pools()


def make_step(cfg: ModelConfig, plan: CachePlan, *, impl: Impl | str = Impl.REFERENCE):
    """``jax.jit`` of :func:`step` for one (cfg, plan): ``fn(params, pools, batch, meta)``.

    ``pools`` (argument 1) is donated: the step updates the pools in place and the caller must
    use the returned pools. Every batch composition of the plan's fixed shapes reuses one
    compilation.
    """
    check_plan(cfg, plan)
    return jax.jit(functools.partial(step, cfg=cfg, plan=plan, impl=Impl(impl)), donate_argnums=1)


def make_propose(
    cfg: ModelConfig,
    plan: CachePlan,
    *,
    num_draft: int | None = None,
    impl: Impl | str = Impl.REFERENCE,
):
    """``jax.jit`` of :func:`propose`: ``fn(params, pools, batch, tables, zero_pages)``, pools donated.

    ``num_draft`` defaults to ``plan.limits.verify_width``.
    """
    check_plan(cfg, plan)
    k = plan.limits.verify_width if num_draft is None else num_draft
    return jax.jit(
        functools.partial(propose, cfg=cfg, plan=plan, num_draft=k, impl=Impl(impl)),
        donate_argnums=1,
    )
