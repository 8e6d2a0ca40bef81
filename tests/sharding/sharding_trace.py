"""A random serving trace per rank, and the fused per-rank step it drives.

The step is one rank's serving step as single-device code: retire the previous step's
results, release finished requests, reclaim window slots, admit new requests with prefix
reuse on, extend running ones, build the step metadata and write every token's rows into the
pools (reference write kernels, after zeroing the recycled pages). The host driver keeps one
simulated scheduler per rank and builds every batch at a fixed shape, so the step compiles
once for the whole trace.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from flatkv_jax import ServingLimits, plan_with_pages
from flatkv_jax.coordinator import ReleaseMode, host, ops
from flatkv_jax.coordinator.metadata import step_metadata_fn
from flatkv_jax.recipes import hybrid_swa_groups
from flatkv_jax.status import Status
from kernels_pallas import Impl, write_rows

#: One full-attention (history) group and one sliding-window group (window 8), both with
#: K and V rows of 512 bytes (so a pool copy would show in the memory analysis), blocks
#: of 4 tokens: prefix hits, window reclaim and holes, in few arrays
#: (the step compiles in seconds; the V4 recipe's seven groups take minutes on a busy CPU).
GROUPS = hybrid_swa_groups("FS", 2, 64, 8, dtype="float32", rows_per_page=4)
LIMITS = ServingLimits(
    max_requests=4, max_context=64, chunk_tokens=16, verify_width=1, step_tokens=64
)
#: Small pools: prefix pages are evicted and some admissions run out of pages.
PLAN = plan_with_pages(GROUPS, LIMITS, {"full_kv": 40, "swa_kv": 14})
WIDTH = LIMITS.max_context  # one admission token width: one compilation
DECODE = 1 + LIMITS.verify_width


def write_step(plan, pools, meta):
    """Zeroes each group's recycled pages, then writes every scheduled token's rows (a value
    made of its position, slot and the array's index) with the reference write kernel."""
    t = meta.token_pos.shape[0]
    for gi in range(len(plan.groups)):
        pools = pools.zero_group(gi, meta.zero[gi])
        flat = list(pools.flat_group(gi))
        for k, arr in enumerate(flat):
            v = (meta.token_pos * 3 + meta.token_slot * 5 + k) % 113 + 1
            v = v.reshape(t, *([1] * (arr.ndim - 2)))
            rows = jnp.broadcast_to(v, (t, *arr.shape[2:])).astype(arr.dtype)
            flat[k] = write_rows(arr, rows, meta.write_slot[gi], impl=Impl.REFERENCE)
        pools = pools.with_flat_group(gi, tuple(flat))
    return pools


def rank_step(plan, state, pools, retire, release, reclaim, admit, extend):
    """One rank's serving step (single-device code; ``per_rank`` runs it on every rank)."""
    state, r_ret = ops.retire_fn(plan, state, retire)
    state, r_rel = ops.release_fn(plan, state, release)
    state, r_rec = ops.reclaim_fn(plan, state, reclaim)
    state, r_adm = ops.admit_fn(plan, state, admit)
    state, r_ext = ops.extend_fn(plan, state, extend, same_step=(r_adm,))
    meta = step_metadata_fn(plan, state, (r_adm, r_ext))
    pools = write_step(plan, pools, meta)
    return state, pools, (r_ret, r_rel, r_rec, r_adm, r_ext)


@dataclasses.dataclass
class Request:
    handle: tuple[int, int]
    tokens: list[int]  # known token ids from position 0: the prompt, then generated ones
    prompt_len: int
    target: int  # committed tokens at which the request finishes
    namespace: int
    extent: int = 0
    committed: int = 0
    inflight: tuple[int, int] | None = None  # (start, count) of the step in flight


class RankDriver:
    """One rank's scheduler: shared system prompts per namespace (prefix hits), chunked
    prefill, speculative decode with random acceptance, FINISH / ABORT, pool pressure.

    :meth:`batches` decides the step's five batches up front (the step is one fused call), so
    it predicts the retire outcome; :meth:`update` then takes the step's real results (a
    failed prediction only shows up as a non-OK status, which both runs share).
    """

    def __init__(self, plan, rank: int, seed: int):
        self.plan = plan
        self.rng = np.random.default_rng([seed, rank])
        # Rank-specific system prompts: each rank's trace is its own workload.
        self.system = [[int(x) for x in self.rng.integers(1, 1000, 32)] for _ in range(2)]
        self.running: list[Request] = []
        self.stats = dict(hits=0, admitted=0, finished=0, aborted=0, not_ok=0)

    def batches(self):
        """The step's (retire, release, reclaim, admit, extend) batches, fixed shapes."""
        p, rng = self.plan, self.rng
        size, chunk = p.limits.max_requests, p.limits.chunk_tokens
        retire_rows = []
        self.retiring = [q for q in self.running if q.inflight]
        for q in self.retiring:
            start, count = q.inflight
            a = count if start + count <= q.prompt_len else int(rng.integers(1, count + 1))
            retire_rows.append((q.handle, a))
            q.committed = start + a  # predicted (update() takes the real values)
            if a < count:
                q.extent = q.committed  # rejected drafts (decode only: a >= 1 past the prompt)
                del q.tokens[q.extent :]
            q.inflight = None
        self.releasing = [q for q in self.running if q.committed >= q.target or rng.random() < 0.04]
        modes = [
            ReleaseMode.FINISH if q.committed >= q.target else ReleaseMode.ABORT
            for q in self.releasing
        ]
        self.reclaiming = [q for q in self.running if q not in self.releasing]
        self.admitting = []
        for _ in range(min(size - len(self.reclaiming), 2)):
            if rng.random() < 0.75:
                ns = int(rng.integers(0, 2))
                prompt = self.system[ns][: int(rng.integers(16, 33))]
                prompt = prompt + [int(x) for x in rng.integers(1, 1000, int(rng.integers(1, 24)))]
                target = int(rng.integers(len(prompt) + 2, p.limits.max_context - DECODE + 1))
                self.admitting.append(Request((-1, -1), prompt, len(prompt), target, ns))
        self.extending, ext_rows, ext_tokens = [], [], []
        for q in self.reclaiming:
            n = q.extent
            count = min(chunk, q.prompt_len - n) if n < q.prompt_len else DECODE
            if q.committed >= q.target or n + count > p.limits.max_context:
                continue
            new = [int(x) for x in rng.integers(1, 1000, max(0, n + count - len(q.tokens)))]
            self.extending.append((q, n, count, new))
            ext_rows.append((q.handle, count))
            ext_tokens.append((q.tokens + new)[n : n + count])
        return (
            host.retire_batch(p, retire_rows, size),
            host.release_batch(
                p, list(zip([q.handle for q in self.releasing], modes, strict=True)), size
            ),
            host.handle_batch(p, [q.handle for q in self.reclaiming], size),
            host.admit_batch(
                p,
                [(q.prompt_len, min(q.prompt_len, chunk)) for q in self.admitting],
                size,
                tokens=[q.tokens for q in self.admitting],
                namespace=[q.namespace for q in self.admitting],
                width=WIDTH,
            ),
            host.extend_batch(p, ext_rows, size, tokens=ext_tokens),
        )

    def update(self, results) -> None:
        """Takes one step's results (NumPy, this rank's)."""
        r_ret, r_rel, _, r_adm, r_ext = results
        ok = int(Status.OK)
        for i, q in enumerate(self.retiring):
            if r_ret.status[i] == ok:
                q.committed, q.extent = int(r_ret.committed[i]), int(r_ret.extent[i])
                del q.tokens[max(q.extent, q.prompt_len) :]
            else:
                self.stats["not_ok"] += 1
        for i, q in enumerate(self.releasing):
            if r_rel.status[i] == ok:
                self.running.remove(q)
                self.stats["finished" if q.committed >= q.target else "aborted"] += 1
            else:
                self.stats["not_ok"] += 1
        for i, (q, n, count, new) in enumerate(self.extending):
            if r_ext.status[i] == ok:
                q.tokens += new
                q.extent, q.inflight = n + count, (n, count)
            else:
                self.stats["not_ok"] += 1
        for i, q in enumerate(self.admitting):
            if r_adm.status[i] == ok:
                h, count = int(r_adm.start[i]), int(r_adm.count[i])
                q.handle = (int(r_adm.slot[i]), int(r_adm.generation[i]))
                q.committed, q.extent, q.inflight = h, h + count, (h, count)
                self.running.append(q)
                self.stats["admitted"] += 1
                self.stats["hits"] += h
            else:
                self.stats["not_ok"] += 1
