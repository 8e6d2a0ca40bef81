"""The reference DeepSeek-V4 model as ``flax.nnx`` modules.

Each layer kind is a module that holds its weights as :class:`flax.nnx.Param` and has two ways
to run: ``dense`` (the whole sequence at once, every row computed in place: the parity
reference) and ``cached`` (the tokens of one serving step, rows written to and read from the
flat pools at the coordinator's addresses). Both call the same module methods for every piece
of math (projections, compressor pooling, indexer scores, attention, MLP), so the two paths
can only differ in where rows come from. The primitives themselves are in
:mod:`flatkv_jax.model.layers`.

:class:`DeepSeekV4` is the model a serving engine drives, through three methods:
``step`` (one target step, MTP layer included), ``propose`` (MTP drafts) and ``dense``
(cache-free recompute). A user's own flax model plugs into the engine by implementing the
same three methods and a ``cfg`` attribute (docs/model.md).

Every row a pool stores passes through ``quant.encode``/``decode`` on the cached path and
``quant.roundtrip`` on the dense path, so both see identical values in every row format.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from flatkv_jax.coordinator.metadata import StepMetadata
from flatkv_jax.errors import fail
from flatkv_jax.groups import Owner
from flatkv_jax.model import layers as L
from flatkv_jax.model import quant
from flatkv_jax.model.addressing import gather
from flatkv_jax.model.cache_io import (
    CacheContext,
    DraftBatch,
    DraftOutput,
    PoolEditor,
    StepBatch,
    StepOutput,
    check_draft_inputs,
    check_step_inputs,
    check_token_ids,
    columns,
    resolve_kernels,
)
from flatkv_jax.model.config import ModelConfig
from flatkv_jax.model.params import (
    CompressorParams,
    IndexerParams,
    LayerParams,
    MTPParams,
    Params,
    param_shapes,
    random_params,
)
from flatkv_jax.plan import CachePlan
from flatkv_jax.pools import Pools
from flatkv_jax.recipes.deepseek_v4 import indexer_row_format, kv_row_format
from kernels_pallas import Impl


class RMSNorm(nnx.Module):
    """RMS norm over the last axis with a learned scale ``weight [dim]``."""

    def __init__(self, weight: jax.Array, eps: float):
        self.weight = nnx.Param(weight)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return L.rms_norm(x, self.weight[...], self.eps)


class Embed(nnx.Module):
    """Token embedding ``table [vocab, hidden]``."""

    def __init__(self, table: jax.Array):
        self.table = nnx.Param(table)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.table[...][tokens]


class LMHead(nnx.Module):
    """Output projection ``kernel [hidden, vocab]`` (shared by the target and the MTP layer;
    each brings its own final norm)."""

    def __init__(self, kernel: jax.Array):
        self.kernel = nnx.Param(kernel)

    def __call__(self, x: jax.Array, norm: RMSNorm) -> jax.Array:
        return norm(x) @ self.kernel[...]


class Compressor(nnx.Module):
    """Compresses ``ratio`` raw tokens (``2 * ratio`` with overlap) into one cached row.

    Every raw token produces a *state row* (a ``kv`` and a ``score`` vector per series, score
    biased by position in window); a row is the per-channel softmax(score)-weighted sum of
    its window's ``kv``, RMS-normed and RoPE'd at position ``j * ratio``.

    Attributes:
      wkv, wgate: ``[hidden, series * dim]``; series 0 is a token's contribution to the next
        window's row (overlap only), the last series to its own window's row.
      ape: ``[series, ratio, dim]`` positional score bias.
      norm: the row's RMS norm.
      state_group, out_group, out_field: where the cached path keeps state rows and rows.
    """

    def __init__(
        self,
        p: CompressorParams,
        cfg: ModelConfig,
        *,
        rope_dim: int,
        state_group: str,
        out_group: str,
        out_field: str,
    ):
        self.wkv = nnx.Param(p.wkv)
        self.wgate = nnx.Param(p.wgate)
        self.ape = nnx.Param(p.ape)
        self.norm = RMSNorm(p.norm, cfg.eps)
        self.series, self.ratio, self.dim = p.ape.shape
        self.rope_dim = rope_dim
        self.theta = cfg.rope_theta
        self.state_group, self.out_group, self.out_field = state_group, out_group, out_field

    @property
    def span(self) -> int:
        """Raw tokens one row reads: ``2 * ratio`` with overlap, else ``ratio``."""
        return self.series * self.ratio

    def state(self, xn: jax.Array, pos: jax.Array) -> jax.Array:
        """State rows ``[N, series, 2, dim]`` of tokens ``xn [N, hidden]`` at ``pos [N]``."""
        return L.compressor_state(self.wkv[...], self.wgate[...], self.ape[...], xn, pos)

    def compress(self, window: jax.Array, valid: jax.Array, j: jax.Array) -> jax.Array:
        """Rows ``j [N]`` from their windows' state rows ``[N, span, series, 2, dim]``."""
        row = self.norm(L.compress_window(window, valid, self.ratio))
        return L.rope_tail(row, j * self.ratio, self.rope_dim, self.theta)

    def dense(self, xn: jax.Array) -> jax.Array:
        """Every complete row of a whole sequence (positions ``0 .. T-1``): ``[T // ratio, dim]``."""
        t = xn.shape[0]
        state = self.state(xn, jnp.arange(t, dtype=jnp.int32))
        j = jnp.arange(t // self.ratio, dtype=jnp.int32)
        span = jnp.arange(self.span, dtype=jnp.int32)[None, :]
        win = (j[:, None] + 1) * self.ratio - self.span + span
        return self.compress(state[jnp.maximum(win, 0)], win >= 0, j)

    def cached(self, ctx: CacheContext, ed: PoolEditor, xn: jax.Array, layer: int) -> None:
        """Writes this step's state rows, then the rows they complete (a row is written by the
        token that completes its window: the write slot is ``-1`` for every other token)."""
        plan = ctx.plan
        gs = plan.group(self.state_group)
        pool = ctx.write(ed, gs, "state", layer, self.state(xn, ctx.safe_pos))
        page, row, ok = ctx.read_window(gs, self.span)
        crow = self.compress(gather(pool, page, row), ok, ctx.safe_pos // self.ratio)
        gc = plan.group(self.out_group)
        ctx.write(
            ed, gc, self.out_field, layer, quant.encode(gc.field(self.out_field).format, crow)
        )


class Indexer(nnx.Module):
    """Lightning indexer of a CSA layer: picks the ``index_topk`` compressed rows a query
    attends to, by ``sum_h w_h * relu(q_h . k) / sqrt(d)`` over its own compressed keys."""

    def __init__(self, p: IndexerParams, cfg: ModelConfig, *, ratio: int):
        self.wq = nnx.Param(p.wq)
        self.wweights = nnx.Param(p.wweights)
        self.compressor = Compressor(
            p.compressor,
            cfg,
            rope_dim=cfg.index_rope_dim,
            state_group=f"c{ratio}_index_state",
            out_group=f"c{ratio}_kv",
            out_field="index_key",
        )
        self.heads, self.head_dim = cfg.index_heads, cfg.index_head_dim
        self.rope_dim, self.theta = cfg.index_rope_dim, cfg.rope_theta
        self.topk = cfg.cache.index_topk

    def select(self, xn: jax.Array, pos: jax.Array, keys: jax.Array, visible: jax.Array):
        """Top-k among the visible index keys ``keys [N, M, d]`` of tokens ``xn`` at ``pos``:
        ``(index int32 [N, k], ok bool [N, k])``."""
        q = (xn @ self.wq[...]).reshape(xn.shape[0], self.heads, self.head_dim)
        q = L.rope_heads(q, pos, self.rope_dim, self.theta)
        scores = L.index_scores(q, xn @ self.wweights[...], keys)
        return L.top_k_rows(scores, visible, self.topk)


class Attention(nnx.Module):
    """Shared K=V attention: a sliding window over raw rows plus an attention sink; CSA layers
    add the indexer's top-k compressed rows, HCA layers every visible compressed row, all in
    one softmax.

    Attributes:
      norm: input RMS norm; wq ``[hidden, heads * head_dim]``; wkv ``[hidden, head_dim]`` (the
        latent, normed by kv_norm); wo ``[heads * head_dim, hidden]``; sink ``[heads]``.
      compressor: CSA / HCA layers; ``None`` on window-only layers.
      indexer: CSA layers; else ``None``.
      layer: the model layer index (pools are per layer); ratio: compression ratio (0: none);
      swa_group: the window group of the raw rows (``swa_kv``, or ``mtp_swa_kv`` for MTP).
    """

    def __init__(self, p: LayerParams, cfg: ModelConfig, *, layer: int, ratio: int, swa: str):
        self.norm = RMSNorm(p.attn_norm, cfg.eps)
        self.wq = nnx.Param(p.wq)
        self.wkv = nnx.Param(p.wkv)
        self.kv_norm = RMSNorm(p.kv_norm, cfg.eps)
        self.wo = nnx.Param(p.wo)
        self.sink = nnx.Param(p.sink)
        self.layer, self.ratio, self.swa_group = layer, ratio, swa
        self.csa = bool(ratio) and ratio == cfg.cache.csa_ratio
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.rope_dim, self.theta, self.window = cfg.rope_dim, cfg.rope_theta, cfg.window
        self.kv_format = kv_row_format(cfg.cache)
        self.index_format = indexer_row_format(cfg.cache)
        self.compressor = (
            Compressor(
                p.compressor,
                cfg,
                rope_dim=cfg.rope_dim,
                state_group=f"c{ratio}_state",
                out_group=f"c{ratio}_kv",
                out_field="kv",
            )
            if ratio
            else None
        )
        self.indexer = Indexer(p.indexer, cfg, ratio=ratio) if self.csa else None

    def project(self, x: jax.Array, pos: jax.Array):
        """``(x_norm [N, hidden], q [N, heads, head_dim], kv [N, head_dim])``, RoPE on the last
        ``rope_dim`` dims of ``q`` and ``kv``; ``kv`` is the row the cache stores."""
        xn = self.norm(x)
        q = (xn @ self.wq[...]).reshape(x.shape[0], self.heads, self.head_dim)
        q = L.rope_heads(q, pos, self.rope_dim, self.theta)
        kv = L.rope_tail(self.kv_norm(xn @ self.wkv[...]), pos, self.rope_dim, self.theta)
        return xn, q, kv

    def output(self, x: jax.Array, q: jax.Array, keys: jax.Array, mask: jax.Array) -> jax.Array:
        """Attention over per-query ``keys [N, K, d]`` (= values) where ``mask``, output
        projection, residual."""
        attn = L.attend(q, keys, mask, self.sink[...])
        return x + attn.reshape(x.shape[0], -1) @ self.wo[...]

    def dense(self, x: jax.Array) -> jax.Array:
        """The whole sequence ``x [T, hidden]`` (positions ``0 .. T-1``)."""
        t = x.shape[0]
        pos = jnp.arange(t, dtype=jnp.int32)
        xn, q, kv = self.project(x, pos)
        keys = quant.roundtrip(self.kv_format, kv)
        # Sliding window: query p sees raw rows p - window + 1 .. p.
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - self.window)
        rows = t // self.ratio if self.ratio else 0
        if rows:
            crow = quant.roundtrip(self.kv_format, self.compressor.dense(xn))
            # Row j is complete once token (j+1)*ratio - 1 is seen: visible to p >= that.
            visible = jnp.arange(rows)[None, :] < ((pos + 1) // self.ratio)[:, None]
            if self.csa:
                ikeys = self.indexer.compressor.dense(xn)
                ikeys = quant.roundtrip(self.index_format, ikeys)
                ikeys = jnp.broadcast_to(ikeys[None], (t, *ikeys.shape))
                idx, ok = self.indexer.select(xn, pos, ikeys, visible)
                chosen = jnp.zeros((t, rows), bool).at[jnp.arange(t)[:, None], idx].set(ok)
            else:
                chosen = visible
            keys = jnp.concatenate([keys, crow], axis=0)
            mask = jnp.concatenate([mask, chosen], axis=1)
        return self.output(x, q, jnp.broadcast_to(keys[None], (t, *keys.shape)), mask)

    def cached(self, ctx: CacheContext, ed: PoolEditor, x: jax.Array) -> jax.Array:
        """The step's tokens: each (group, field, layer) array is written before it is read
        (XLA copies a donated pool that is read before it is mutated)."""
        xn, q, kv = self.project(x, ctx.safe_pos)
        g = ctx.plan.group(self.swa_group)
        fmt = g.field("kv").format
        pool = ctx.write(ed, g, "kv", self.layer, quant.encode(fmt, kv))
        page, row, ok = ctx.read_window(g, self.window)
        keys, mask = quant.decode(fmt, gather(pool, page, row)), ok
        if self.ratio:
            self.compressor.cached(ctx, ed, xn, self.layer)
            if self.csa:
                self.indexer.compressor.cached(ctx, ed, xn, self.layer)
            ckeys, cmask = self._history(ctx, ed, xn)
            keys = jnp.concatenate([keys, ckeys], axis=1)
            mask = jnp.concatenate([mask, cmask], axis=1)
        return self.output(x, q, keys, mask)

    def _history(self, ctx: CacheContext, ed: PoolEditor, xn: jax.Array):
        """Keys (= values) and mask from the compressed chain: top-k rows (CSA) or all rows."""
        gc = ctx.plan.group(f"c{self.ratio}_kv")
        n_rows = ctx.plan.table_width(gc) * gc.rows_per_page
        j = jnp.arange(n_rows, dtype=jnp.int32)
        rows = jnp.broadcast_to(j[None, :], (ctx.pos.shape[0], n_rows))
        page, row, ok = ctx.read_history(gc, rows)
        visible = ok & (j[None, :] < ((ctx.safe_pos + 1) // self.ratio)[:, None])
        kv_fmt = gc.field("kv").format
        if self.csa:
            ikeys = gather(ed.get(gc, "index_key", self.layer), page, row)
            ikeys = quant.decode(gc.field("index_key").format, ikeys)
            idx, chosen = self.indexer.select(xn, ctx.safe_pos, ikeys, visible)
            page = jnp.take_along_axis(page, idx, axis=1)
            row = jnp.take_along_axis(row, idx, axis=1)
            return quant.decode(kv_fmt, gather(ed.get(gc, "kv", self.layer), page, row)), chosen
        return quant.decode(kv_fmt, gather(ed.get(gc, "kv", self.layer), page, row)), visible


class MLP(nnx.Module):
    """Pre-norm SwiGLU with residual: ``x + swiglu(norm(x))``."""

    def __init__(self, p: LayerParams, cfg: ModelConfig):
        self.norm = RMSNorm(p.mlp_norm, cfg.eps)
        self.w_gate = nnx.Param(p.w_gate)
        self.w_up = nnx.Param(p.w_up)
        self.w_down = nnx.Param(p.w_down)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + L.swiglu(self.norm(x), self.w_gate[...], self.w_up[...], self.w_down[...])


class Block(nnx.Module):
    """One transformer layer: :class:`Attention` then :class:`MLP`."""

    def __init__(self, p: LayerParams, cfg: ModelConfig, *, layer: int, ratio: int, swa: str):
        self.attn = Attention(p, cfg, layer=layer, ratio=ratio, swa=swa)
        self.mlp = MLP(p, cfg)

    def dense(self, x: jax.Array) -> jax.Array:
        return self.mlp(self.attn.dense(x))

    def cached(self, ctx: CacheContext, ed: PoolEditor, x: jax.Array) -> jax.Array:
        return self.mlp(self.attn.cached(ctx, ed, x))

    def params(self) -> LayerParams:
        a, m = self.attn, self.mlp
        return LayerParams(
            attn_norm=a.norm.weight[...],
            wq=a.wq[...],
            wkv=a.wkv[...],
            kv_norm=a.kv_norm.weight[...],
            wo=a.wo[...],
            sink=a.sink[...],
            mlp_norm=m.norm.weight[...],
            w_gate=m.w_gate[...],
            w_up=m.w_up[...],
            w_down=m.w_down[...],
            compressor=None if a.compressor is None else _compressor_params(a.compressor),
            indexer=None
            if a.indexer is None
            else IndexerParams(
                wq=a.indexer.wq[...],
                wweights=a.indexer.wweights[...],
                compressor=_compressor_params(a.indexer.compressor),
            ),
        )


def _compressor_params(c: Compressor) -> CompressorParams:
    return CompressorParams(
        wkv=c.wkv[...], wgate=c.wgate[...], ape=c.ape[...], norm=c.norm.weight[...]
    )


class MTPLayer(nnx.Module):
    """The MTP draft layer: at position ``q`` its input mixes ``embed(t_q)`` with the target's
    final residual at ``q - 1``; one window-only :class:`Block` over the draft group
    ``mtp_swa_kv``; logits through the shared head with its own final norm."""

    def __init__(self, p: MTPParams, cfg: ModelConfig):
        self.enorm = RMSNorm(p.enorm, cfg.eps)
        self.hnorm = RMSNorm(p.hnorm, cfg.eps)
        self.proj = nnx.Param(p.proj)
        self.block = Block(p.layer, cfg, layer=cfg.cache.mtp_layers[0], ratio=0, swa="mtp_swa_kv")
        self.final_norm = RMSNorm(p.final_norm, cfg.eps)

    def input(self, tok_emb: jax.Array, prev_hidden: jax.Array) -> jax.Array:
        """``[enorm(embed(t_q)), hnorm(h_{q-1})] @ proj``."""
        x = jnp.concatenate([self.enorm(tok_emb), self.hnorm(prev_hidden)], axis=-1)
        return x @ self.proj[...]


def check_params(cfg: ModelConfig, params: Params) -> None:
    """Raises unless ``params`` has exactly the structure, shapes and dtypes of ``cfg``."""
    if not isinstance(params, Params):
        fail(
            "params",
            type(params).__name__,
            "it must be a Params pytree",
            "build it with init_params(cfg, seed) or DeepSeekV4.to_params()",
            exc=TypeError,
        )
    want = param_shapes(cfg)
    got_leaves, got_tree = jax.tree.flatten_with_path(params)
    want_leaves, want_tree = jax.tree.flatten_with_path(want)
    if got_tree != want_tree:
        fail(
            "params",
            f"{len(got_leaves)} arrays",
            f"the layer structure of cfg needs {len(want_leaves)} (layer kinds, MTP)",
            "build the params from the same ModelConfig as the model",
        )
    for (path, a), (_, w) in zip(got_leaves, want_leaves, strict=True):
        if not hasattr(a, "shape") or tuple(a.shape) != w.shape or a.dtype != w.dtype:
            fail(
                f"params{jax.tree_util.keystr(path)}",
                (tuple(a.shape), str(a.dtype)) if hasattr(a, "shape") else type(a).__name__,
                f"cfg wants shape {w.shape} and dtype {w.dtype.name}",
                "build the params from the same ModelConfig as the model",
            )


def _pinned_precision(method):
    """Traces ``method`` under the model's ``cfg.matmul_precision``.

    The precision is part of the model, not of the caller's context: a serving step traced on
    a GPU would otherwise get TF32 products while the dense reference (or another backend) gets
    fp32, and parity would fail for reasons that have nothing to do with the cache.
    """

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with jax.default_matmul_precision(self.cfg.matmul_precision):
            return method(self, *args, **kwargs)

    return wrapped


class DeepSeekV4(nnx.Module):
    """The reference DeepSeek-V4 model: what a serving engine drives.

    Build it with random weights from ``nnx.Rngs`` or from a :class:`Params` pytree::

        model = DeepSeekV4(tiny_model(), rngs=nnx.Rngs(0))
        model = DeepSeekV4.from_params(cfg, init_params(cfg, seed))

    and jit its methods the flax way (pools donated)::

        graphdef, weights = nnx.split(model)

        @functools.partial(jax.jit, donate_argnums=1)
        def step(weights, pools, batch, meta, table_buffer):
            return nnx.merge(graphdef, weights).step(pools, batch, meta, table_buffer, plan=plan)

    Attributes:
      cfg: the :class:`ModelConfig` (static).
      embed: token embedding; layers: one :class:`Block` per target layer; final_norm, head:
        the target's logits; mtp: the :class:`MTPLayer` or ``None``.
    """

    def __init__(
        self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None, params: Params | None = None
    ):
        """Random weights from ``rngs`` (one ``rngs.params()`` key), or exactly ``params``.

        Args:
          cfg: the model config.
          rngs: random weights (see :func:`~flatkv_jax.model.params.random_params`).
          params: the weights to hold (prefer :meth:`from_params`); exactly one of the two.
        """
        if not isinstance(cfg, ModelConfig):
            fail(
                "cfg",
                cfg,
                "it must be a ModelConfig",
                "build it with tiny_model() or v4_flash_model()",
                exc=TypeError,
            )
        if (rngs is None) == (params is None):
            fail(
                "rngs",
                "given with params" if rngs is not None else None,
                "give exactly one of rngs (random weights) and params (given weights)",
                "use DeepSeekV4(cfg, rngs=nnx.Rngs(seed)) or DeepSeekV4.from_params(cfg, params)",
                exc=TypeError,
            )
        if rngs is not None:
            if not isinstance(rngs, nnx.Rngs):
                fail(
                    "rngs",
                    type(rngs).__name__,
                    "it must be a flax.nnx.Rngs",
                    "pass rngs=nnx.Rngs(seed)",
                    exc=TypeError,
                )
            params = random_params(cfg, rngs.params())
        check_params(cfg, params)
        self.cfg = cfg
        self.embed = Embed(params.embed)
        self.layers = nnx.List(
            Block(lp, cfg, layer=i, ratio=cfg.ratio(i), swa="swa_kv")
            for i, lp in enumerate(params.layers)
        )
        self.final_norm = RMSNorm(params.final_norm, cfg.eps)
        self.head = LMHead(params.head)
        self.mtp = None if params.mtp is None else MTPLayer(params.mtp, cfg)

    @classmethod
    def from_params(cls, cfg: ModelConfig, params: Params) -> DeepSeekV4:
        """The model holding exactly ``params`` (e.g. ``init_params(cfg, seed)``)."""
        return cls(cfg, params=params)

    def to_params(self) -> Params:
        """The weights as a :class:`Params` pytree (what :meth:`from_params` takes)."""
        mtp = None
        if self.mtp is not None:
            m = self.mtp
            mtp = MTPParams(
                enorm=m.enorm.weight[...],
                hnorm=m.hnorm.weight[...],
                proj=m.proj[...],
                layer=m.block.params(),
                final_norm=m.final_norm.weight[...],
            )
        return Params(
            embed=self.embed.table[...],
            layers=tuple(b.params() for b in self.layers),
            final_norm=self.final_norm.weight[...],
            head=self.head.kernel[...],
            mtp=mtp,
        )

    # --- dense reference --------------------------------------------------------------------
    def dense(self, tokens: jax.Array):
        """Cache-free forward of one whole sequence (the parity reference), jitted.

        Args:
          tokens: int32 ``[T]``, positions ``0 .. T-1``.

        Returns:
          ``(logits [T, vocab], hidden [T, hidden], draft_logits [T, vocab] or None)``: target
          logits (predicting token ``p + 1``), the final residual stream (what the MTP layer
          reads) and the MTP layer's logits at each position ``q`` from ``(hidden[q-1],
          tokens[q])``.
        """
        tokens = check_token_ids(tokens)
        graphdef, weights = nnx.split(self)
        return _dense_jit(graphdef, weights, tokens)

    @_pinned_precision
    def dense_trace(self, tokens: jax.Array):
        """:meth:`dense` without the jit and checks (for use inside a traced function)."""
        x = self.embed(tokens)
        for block in self.layers:
            x = block.dense(x)
        logits = self.head(x, self.final_norm)
        if self.mtp is None:
            return logits, x, None
        # The draft at position q reads the target hidden of q - 1 (zeros before position 0).
        prev = jnp.concatenate([jnp.zeros_like(x[:1]), x[:-1]], axis=0)
        g = self.mtp.block.dense(self.mtp.input(self.embed(tokens), prev))
        return logits, x, self.head(g, self.mtp.final_norm)

    # --- cached path ------------------------------------------------------------------------
    @_pinned_precision
    def step(
        self,
        pools: Pools,
        batch: StepBatch,
        meta: StepMetadata,
        table_buffer: jax.Array,
        *,
        plan: CachePlan,
        max_count: int | None = None,
        impl: Impl | str = Impl.REFERENCE,
        interpret: object = None,
    ) -> tuple[StepOutput, Pools]:
        """One serving step of the target model (and the MTP layer over the same tokens).

        Meant to run under ``jax.jit`` with ``pools`` donated (the step updates them in place;
        use the returned pools).

        Args:
          pools: every pool of ``plan``.
          batch: tokens (on the metadata's flat token axis) and per-request previous hiddens.
          meta: the coordinator's :class:`~flatkv_jax.coordinator.StepMetadata` of this step:
            token layout, ``write_slot``, window read index, zero lists (all applied, every
            pool of every group, before anything is written).
          table_buffer: int32 ``CacheState.table_buffer`` (read only; the history groups' read
            index, at the state layout's offsets and strides).
          plan: the static cache plan (``plan.groups`` must be the recipe groups of
            ``cfg.cache``).
          max_count: the static per-row bound the step's admit/extend calls and
            ``step_metadata`` used (sizes the window columns; default as the coordinator's).
          impl: kernel implementation for ``write_rows`` / ``zero_pages`` (``Impl`` or its
            string value).
          interpret: the Pallas kernels' interpret mode; ``None`` (auto): on for
            ``impl="pallas_tpu"`` on a CPU backend, else off.

        Returns:
          ``(StepOutput, pools)`` with this step's rows written into ``pools``.

        Raises:
          ValueError, TypeError: at trace time, for inputs that do not fit ``cfg`` and ``plan``
            (pools, batch, metadata or table buffer of another plan or ``max_count``).
        """
        cfg = self.cfg
        check_step_inputs(cfg, plan, pools, batch, meta, table_buffer, max_count)
        impl, interpret = resolve_kernels(impl, interpret)
        ed = PoolEditor.of(plan, pools)
        for gi in range(len(plan.groups)):
            ed.zero(gi, meta.zero[gi], impl, interpret)
        ctx = CacheContext(
            plan,
            impl,
            interpret,
            meta,
            table_buffer,
            columns(plan, max_count),
            meta.token_slot,
            meta.token_pos,
            meta.token_row,
            meta.write_slot,
        )
        tokens = jnp.where(ctx.live, batch.tokens, 0)
        x = self.embed(tokens)
        for block in self.layers:
            x = block.cached(ctx, ed, x)
        logits = self.head(x, self.final_norm)
        draft_logits = None
        if self.mtp is not None:
            # The MTP layer at position q reads the target hidden of q - 1: the previous flat
            # token when it belongs to the same metadata row (rows are contiguous, ascending
            # positions), else the carried prev_hidden.
            row = meta.token_row
            chained = jnp.concatenate([jnp.zeros((1,), bool), row[1:] == row[:-1]]) & ctx.live
            shifted = jnp.concatenate([jnp.zeros_like(x[:1]), x[:-1]], axis=0)
            r = plan.limits.max_requests
            carried = batch.prev_hidden[jnp.clip(meta.token_slot, 0, r - 1)]
            prev = jnp.where(chained[:, None], shifted, carried)
            g = self.mtp.block.cached(ctx, ed, self.mtp.input(self.embed(tokens), prev))
            draft_logits = self.head(g, self.mtp.final_norm)
        return StepOutput(logits=logits, hidden=x, draft_logits=draft_logits), ed.pools()

    @_pinned_precision
    def propose(
        self,
        pools: Pools,
        batch: DraftBatch,
        meta: StepMetadata,
        table_buffer: jax.Array,
        *,
        plan: CachePlan,
        num_draft: int | None = None,
        max_count: int | None = None,
        impl: Impl | str = Impl.REFERENCE,
        interpret: object = None,
    ) -> tuple[DraftOutput, Pools]:
        """The MTP layer proposes ``num_draft`` tokens per active request, greedily, one
        position at a time, into the verify block the coordinator just scheduled.

        Call it with the same metadata as the verify :meth:`step` that follows. Position
        ``row_start + i`` of an active request's metadata row reads ``(hidden, token)`` — the
        target hidden and chosen token for ``i = 0``, then the draft's own hidden and
        proposal — and writes its row of the draft pool ``mtp_swa_kv`` at the coordinator's
        write slot. The verify step overwrites those rows with target-hidden inputs, so
        accepted positions end up exactly as a dense recompute.

        Args:
          pools: as in :meth:`step` (only the draft-owned pools are touched).
          batch: per request slot, the start token, previous target hidden and whether it
            proposes.
          meta, table_buffer, max_count: as in :meth:`step`; only the zero lists of
            draft-owned groups are applied here (a page handed out by ``extend`` must be zeroed
            by the first function that touches its pool; the step zeroes it again, harmlessly,
            since only positions it rewrites live in new pages).
          plan, impl, interpret: as in :meth:`step`.
          num_draft: tokens to propose (static, ``>= 1``; default ``plan.limits.verify_width``;
            a proposing row needs ``row_count >= num_draft``).

        Returns:
          ``(DraftOutput, pools)``.
        """
        cfg = self.cfg
        if num_draft is None and isinstance(plan, CachePlan):
            num_draft = plan.limits.verify_width
        check_draft_inputs(cfg, plan, pools, batch, meta, table_buffer, num_draft, max_count)
        impl, interpret = resolve_kernels(impl, interpret)
        ed = PoolEditor.of(plan, pools)
        for gi, g in enumerate(plan.groups):
            if g.owner is Owner.DRAFT:
                ed.zero(gi, meta.zero[gi], impl, interpret)
        gi = plan.group_index("mtp_swa_kv")
        cols = columns(plan, max_count)
        s, t, r = meta.row_slot.shape[0], plan.limits.step_tokens, plan.limits.max_requests
        slot = meta.row_slot
        on = (
            (slot >= 0)
            & batch.active[jnp.clip(slot, 0, r - 1)]
            & (meta.row_offset >= 0)
            & (meta.row_count >= num_draft)
        )
        rows = jnp.arange(s, dtype=jnp.int32)
        safe = jnp.clip(slot, 0, r - 1)
        mtp = self.mtp

        def body(i, carry):
            flat, tok, hid, out_tok, out_logits = carry
            # Only the draft pool travels through the loop; the editor sees just that group.
            loop_ed = PoolEditor(plan, [None] * len(plan.groups))
            loop_ed.arrays[gi] = [list(flat)]
            ti = meta.row_offset + i
            live = on & (ti < t)
            write = jnp.where(live[None, :], meta.write_slot[:, jnp.clip(ti, 0, t - 1)], -1)
            ctx = CacheContext(
                plan,
                impl,
                interpret,
                meta,
                table_buffer,
                cols,
                jnp.where(live, slot, -1),
                jnp.where(live, meta.row_start + i, -1),
                jnp.where(live, rows, -1),
                write,
            )
            g = mtp.block.cached(ctx, loop_ed, mtp.input(self.embed(tok), hid))
            logits = self.head(g, mtp.final_norm)
            nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            out_tok = jax.lax.dynamic_update_slice_in_dim(out_tok, nxt[:, None], i, axis=1)
            out_logits = jax.lax.dynamic_update_slice_in_dim(out_logits, logits[:, None], i, 1)
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


@functools.partial(jax.jit, static_argnums=0)
def _dense_jit(graphdef, weights, tokens):
    return nnx.merge(graphdef, weights).dense_trace(tokens)
