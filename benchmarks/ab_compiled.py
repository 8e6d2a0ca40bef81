"""Two versions of the coordinator, side by side in one process, on the vs_vllm trace.

Timing on the 2-vCPU developer machine drifts by +-20 % between runs a minute apart, so two
versions measured in separate runs (even interleaved) can disagree on the sign of a 5 %
change. This script removes the drift: each version's **compiled** decode and admission
steps are serialized (``dump``, run in that version's tree), then one process (``run``)
replays ``benchmarks/vs_vllm.py``'s trace and, at every timed step, runs every version (in
a random order) on its own fresh copy of the same state, so all see the same step on the
same machine at the same moment; the ratio printed is the median over steps of each step's
time ratio (paired), beside each version's median.

Both versions must keep the same state pytree (leaf shapes and order) and the same
semantics: before timing a shape, ``run`` applies every version to copies of the same state
and input and refuses to go on if their outputs or new states differ (stale free-stack slots
and where in its bucket pair an index entry sits are not compared);
``--check-all`` compares them at every timed call instead, outside the timing (a version that
differs only on rare paths, e.g. ``one_program_probe.py``'s sorts, is caught where it
differs).

Run (the older version from a git worktree)::

    git worktree add /tmp/old <rev>
    (cd /tmp/old && PYTHONPATH=/tmp/old python /work/main/benchmarks/ab_compiled.py \\
        --peer /work/shared/peers/vllm_kv_bench.py dump /tmp/old.pkl)
    python benchmarks/ab_compiled.py dump /tmp/new.pkl
    python benchmarks/ab_compiled.py run old=/tmp/old.pkl new=/tmp/new.pkl

``dump`` imports ``flatkv_jax`` and ``vs_vllm`` from the tree it runs in (``PYTHONPATH``),
so the script itself may come from any tree. Prints, per shape, the median microseconds per
request of each version and the median of its per-step ratios to the first.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import pickle
import statistics
import sys
import time

import jax
import numpy as np


def _import_vs_vllm():
    """``vs_vllm`` from the tree whose ``flatkv_jax`` is imported (``PYTHONPATH``)."""
    import flatkv_jax

    bench = pathlib.Path(flatkv_jax.__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    import vs_vllm

    return vs_vllm


#: Compiled shapes compared by default: the decode step, and the admission buckets the
#: trace uses most.
SHAPES = (
    ("decode",),
    ("admit", 1, 2048),
    ("admit", 1, 4096),
    ("admit", 2, 2048),
    ("admit", 2, 4096),
    ("admit", 4, 4096),
)
#: Dumped too, compared when ``--shapes`` names them: ``run`` holds four executables per
#: shape (a compile, a spare, two versions) and all eight shapes at once ran out of memory
#: maps in LLVM's loader ("Cannot allocate memory") on the 2-vCPU machine.
MORE_SHAPES = (("admit", 4, 2048), ("admit", 8, 4096))


#: The vs_vllm defaults the trace and the plan are built from (vs_vllm's own options exist
#: only in its newer versions; these are the same in all of them).
_TRACE = dict(
    requests_per_batch=4.0,
    decode_len=128,
    prompt_min=1024,
    prompt_max=4096,
    num_system_prompts=8,
    system_prompt_len=1024,
    max_num_batched_tokens=16384,
    pool_factor=1.25,
    admit_rows=8,
    admit_width=0,
    granularity=128,
    oracle=False,
    seed=0,
    evict_ahead_tokens=0,
)


def _make_run(vs, args, **overrides):
    """A ``vs_vllm.Run`` on the trace and plan of ``_TRACE`` (``overrides`` replace its
    options, e.g. ``evict_ahead_tokens``)."""
    opts = argparse.Namespace(**{**_TRACE, **overrides})
    peer = pathlib.Path(args.peer) if args.peer else vs.DEFAULT_PEER
    if not peer.is_file():
        raise SystemExit(f"--peer {peer}: no such file; pass the path of vllm_kv_bench.py")
    make_trace, _ = vs.load_make_trace(peer)
    trace = make_trace(
        int(opts.requests_per_batch * args.batch),
        opts.seed,
        opts.num_system_prompts,
        opts.system_prompt_len,
        opts.prompt_min,
        opts.prompt_max,
        opts.decode_len,
    )
    return vs.Run(opts, args.batch, trace, 1)


def _example(run, shape):
    if shape[0] == "decode":
        return np.zeros((4, run.b), np.int32)
    return np.zeros((shape[1], 2 + shape[2]), np.int32)


def _compile(run, shape):
    fn = run.decode if shape[0] == "decode" else run.admit
    return fn.lower(run.state, _example(run, shape)).compile()


def dump(args) -> None:
    from jax.experimental import serialize_executable

    vs = _import_vs_vllm()
    run = _make_run(vs, args)
    blobs = {s: serialize_executable.serialize(_compile(run, s))[0] for s in SHAPES + MORE_SHAPES}
    pathlib.Path(args.out).write_bytes(pickle.dumps(blobs))
    import flatkv_jax

    src = pathlib.Path(flatkv_jax.__file__).parent
    print(f"{args.out}: {len(blobs)} executables of {src}")


def _copy(tree):
    return jax.tree.map(lambda x: x.copy(), tree)


def _stacks_below_top(tree, plan):
    """``tree`` with every allocator's free-stack slots above its pools' tops set to -1: those
    slots are stale (what was popped last), and two versions may leave different stale
    values there with the same meaning."""
    from flatkv_jax.block_pool import BlockPoolSet
    from flatkv_jax.coordinator.state import pool_layout

    layout = pool_layout(plan)
    pool = np.repeat(np.arange(layout.num_pools), layout.usable)  # each stack slot's pool
    slot = np.arange(layout.total_usable) - np.asarray(layout.stack_offset)[pool]

    def canon(x):
        if not isinstance(x, BlockPoolSet):
            return x
        live = slot < np.asarray(x.top)[pool]
        return BlockPoolSet(np.where(live, np.asarray(x.free_ids), -1), x.top, x.refcount)

    return jax.tree.map(canon, tree, is_leaf=lambda x: isinstance(x, BlockPoolSet))


def _index_as_entries(tree):
    """``tree`` with every prefix index set replaced by its entries, sorted: ``(group, page,
    key words)`` per entry in use, which pages are held, and the counts. Where an entry sits
    (which bucket of its pair, which way) is not part of the semantics: a key may sit in
    either bucket of its pair (docs/prefix.md), and two versions that insert in different
    chunks may place it differently."""
    from flatkv_jax.prefix.index import PrefixIndexSet

    def canon(x):
        if not isinstance(x, PrefixIndexSet):
            return x
        pages = np.asarray(x.pages)
        group = np.repeat(np.arange(len(x.num_buckets)), x.num_buckets)[:, None]
        used = pages > 0
        rows = np.concatenate(
            [
                np.broadcast_to(group, pages.shape)[used][:, None].astype(np.int64),
                pages[used][:, None].astype(np.int64),
                np.asarray(x.keys)[used].astype(np.int64),
            ],
            axis=1,
        )
        rows = rows[np.lexsort(rows.T[::-1])]
        return (rows, np.asarray(x.slot_of_page) >= 0, np.asarray(x.count))

    return jax.tree.map(canon, tree, is_leaf=lambda x: isinstance(x, PrefixIndexSet))


def _same(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb, strict=True)
    )


def _pick_shapes(text: str | None) -> tuple:
    """``--shapes``: comma-separated ``decode`` / ``admit-ROWS-WIDTH`` among :data:`SHAPES`
    and :data:`MORE_SHAPES` (default: :data:`SHAPES`)."""
    if not text:
        return SHAPES
    names = {"-".join(map(str, s)): s for s in SHAPES + MORE_SHAPES}
    picked = []
    for name in text.split(","):
        if name not in names:
            raise SystemExit(f"--shapes {name!r}: pick among {', '.join(names)}")
        picked.append(names[name])
    return tuple(picked)


def run_ab(args) -> None:
    from jax.experimental import serialize_executable

    specs = [spec.partition("=")[::2] for spec in args.versions]
    for spec, (_, path) in zip(args.versions, specs, strict=True):
        if not path:
            raise SystemExit(f"version {spec!r}: write it as NAME=FILE (from `dump`)")
    for spec, (_, path) in zip(args.versions, specs, strict=True):
        if not pathlib.Path(path).is_file():
            raise SystemExit(f"version {spec!r}: {path} is not a file; make it with `dump`")
    versions = [(name, pickle.loads(pathlib.Path(path).read_bytes())) for name, path in specs]
    vs = _import_vs_vllm()
    run = _make_run(vs, args)
    exe = {}
    spares = []
    shapes = _pick_shapes(args.shapes)
    for name, blobs in versions:
        for shape in shapes:
            if shape not in blobs:
                raise SystemExit(f"version {name}: no {shape} in its dump; dump it again")
    for shape in shapes:
        _, in_tree, out_tree = serialize_executable.serialize(_compile(run, shape))
        # The first executable deserialized for a shape ran ~6 % slower than later copies of
        # itself (three copies of one version, every step timed on each: x1.00, x0.94,
        # x0.94): a spare copy, kept loaded, takes that place. It evened decode (x0.99,
        # x0.98), not admission (x0.93-0.95): run both orders and take the geometric mean.
        spares.append(
            serialize_executable.deserialize_and_load(versions[0][1][shape], in_tree, out_tree)
        )
        for name, blobs in versions:
            try:
                exe[name, shape] = serialize_executable.deserialize_and_load(
                    blobs[shape], in_tree, out_tree
                )
            except Exception as e:  # any load failure means the same thing
                raise SystemExit(
                    f"version {name}, shape {shape}: cannot load ({type(e).__name__}: {e}); "
                    "both versions must keep the same state pytree and batch shapes"
                ) from e
    checked: set = set()
    times: dict = {}
    first = versions[0][0]
    rng = np.random.default_rng()
    orig = run._timed

    def timed(key, fn, *a):
        shape = ("decode",) if key == "decode" else key
        if shape not in shapes or key not in run.seen:
            return orig(key, fn, *a)
        if shape not in checked:
            outs = [
                _index_as_entries(
                    _stacks_below_top(exe[name, shape](_copy(run.state), *a), run.plan)
                )
                for name, _ in versions
            ]
            for (name, _), o in zip(versions[1:], outs[1:], strict=True):
                if not _same(o, outs[0]):
                    raise SystemExit(
                        f"{name} and {versions[0][0]} disagree on {shape}: not the same "
                        "semantics, nothing to compare"
                    )
            checked.add(shape)
        # Every version runs every step, on its own fresh copy of the same state, in a random
        # order; the trace goes on from the last one's state (they are the same). Taking turns
        # over the steps instead gave versions different steps: with a fixed seed the same
        # split every run, and a copy of one executable read x0.92-0.95 of itself.
        rows = int(np.count_nonzero(np.asarray(a[0])[0] if key == "decode" else a[0][:, 0]))
        ran = {}
        for i in rng.permutation(len(versions)):
            name = versions[i][0]
            state = jax.block_until_ready(_copy(run.state))
            t = time.perf_counter()
            state, out = exe[name, shape](state, *a)
            out = jax.device_get(out)
            dt = time.perf_counter() - t
            times.setdefault((shape, name), []).append(dt / max(rows, 1) * 1e6)
            if args.check_all:
                ran[name] = (state, out)
        if args.check_all:
            # Outside the timed calls: every version's output and new state at this step.
            canon = {n: _index_as_entries(_stacks_below_top(r, run.plan)) for n, r in ran.items()}
            for name, _ in versions[1:]:
                if not _same(canon[name], canon[first]):
                    raise SystemExit(
                        f"{name} and {first} disagree on {shape} at call {len(times[shape, name])}"
                    )
        run.state = state
        return out, dt

    run._timed = timed
    run.run()
    print(f"{os.cpu_count()} CPUs, jax {jax.__version__}, B = {args.batch}")
    for shape in shapes:
        base = times.get((shape, first))
        for name, _ in versions:
            t = times.get((shape, name))
            if not t:
                continue
            med = statistics.median(t)
            paired = statistics.median(x / y for x, y in zip(t, base, strict=True))
            ratio = f"  x{paired:.3f} of {first} (median of per-step ratios)"
            print(f"{shape!s:22s} {name:10s} {med:9.2f} us/request  n={len(t)}{ratio}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--peer", default=None, help="vllm_kv_bench.py (default: vs_vllm's)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="serialize this tree's compiled steps")
    d.add_argument("out")
    r = sub.add_parser("run", help="replay the trace alternating the versions")
    r.add_argument("versions", nargs="+", help="NAME=FILE from dump, the first is the base")
    r.add_argument(
        "--shapes", default=None, help="e.g. decode,admit-8-4096 (default: the six of SHAPES)"
    )
    r.add_argument(
        "--check-all",
        action="store_true",
        help="compare every version's output and state at every timed call, not only at the "
        "first call of each shape (outside the timing)",
    )
    args = ap.parse_args()
    if args.cmd == "dump":
        dump(args)
    else:
        run_ab(args)


if __name__ == "__main__":
    main()
