"""Probe: the vs_vllm trace's coordinator programs compiled as one XLA:CPU function each.

On XLA:CPU a coordinator step is hundreds of small thunks, and the thunk executor costs about
a microsecond between two of them (docs/benchmarks.md, "Thunks, not arithmetic"). XLA:CPU has
one way to run many HLO ops as one compiled function: its ``small-while-loop-hoisting`` pass
turns a ``while`` loop whose one iteration accesses fewer bytes than the backend option
``xla_cpu_small_while_loop_byte_threshold`` (default 1,024) into a call that the legacy IR
emitter compiles whole (``xla_cpu_small_call``). The pass skips any loop that holds a
``scatter`` or a ``sort`` (the call emitter has neither), but with
``--xla_cpu_use_fusion_emitters=false`` XLA expands every scatter into a loop of
dynamic-update-slices first. So a step body wrapped in a ``while`` loop that runs once,
compiled with a threshold above its bytes, without fusion emitters and without sorts, runs as
**one thunk**.

This script dumps, in ``ab_compiled.py``'s format, the vs_vllm programs built that way:

- ``XLA_FLAGS`` gets ``--xla_backend_extra_options=xla_cpu_small_while_loop_byte_threshold=
  10**15 --xla_cpu_use_fusion_emitters=false`` (set here, before JAX starts: the byte
  threshold is a backend option that ``jax.jit(compiler_options=...)`` cannot carry, and
  that is why this is a probe, not a library option);
- every jitted vs_vllm step runs its body inside a ``lax.while_loop`` that runs once (its
  stop flag starts from the input, so XLA cannot fold the loop away);
- ``jax.lax.sort`` is replaced by :func:`bitonic_sort`, a sorting network of gathers and
  selects with the same result (a stable lexicographic sort on the first ``num_keys``
  operands): the coordinator sorts only on rare paths (a decref of repeated pages, batch
  dedupes of more than 512 rows), but one sort anywhere in a program keeps the loop apart.

Compare with the programs as the library compiles them, checking every call's output and
state against them (``--check-all``)::

    python benchmarks/ab_compiled.py dump /tmp/base.pkl
    python benchmarks/one_program_probe.py /tmp/one.pkl
    python benchmarks/ab_compiled.py run base=/tmp/base.pkl one=/tmp/one.pkl \\
        --shapes decode,admit-1-4096,admit-2-4096 --check-all

Prints, per shape, the compile time and how many hoisted calls the compiled program holds
(the entry computation's body should be one of them).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import pickle
import sys
import time

_FLAGS = (
    "--xla_backend_extra_options=xla_cpu_small_while_loop_byte_threshold=1000000000000000",
    "--xla_cpu_use_fusion_emitters=false",
)


def bitonic_sort(operands, dimension: int = -1, is_stable: bool = True, num_keys: int = 1):
    """``jax.lax.sort`` of 1-D operands without a ``sort`` op: a bitonic network over the
    operands padded to a power of two, ordered by the first ``num_keys`` operands, then by
    position (so the order is total and stable, as ``lax.sort``'s)."""
    import jax
    import jax.numpy as jnp

    del is_stable  # the position key makes it stable
    ops = list(operands) if isinstance(operands, (tuple, list)) else [operands]
    n = ops[0].shape[0]
    if any(o.ndim != 1 for o in ops) or dimension not in (0, -1):
        raise ValueError("bitonic_sort: the probe sorts 1-D operands only")
    size = 1 << max(n - 1, 0).bit_length()
    pos = jnp.arange(size, dtype=jnp.int32)
    pad = (pos >= n).astype(jnp.int32)  # padding sorts last
    cols = [jnp.pad(o, (0, size - n)) for o in ops]
    keys = [pad, *cols[:num_keys], pos]

    def greater(a, b):
        gt = jnp.zeros(a[0].shape, bool)
        eq = jnp.ones(a[0].shape, bool)
        for x, y in zip(a, b, strict=True):
            gt = gt | (eq & (x > y))
            eq = eq & (x == y)
        return gt

    # The network's stages (k, j) as data, run by one loop: unrolled, the sorts of a decode
    # step made a program too large for the compiler's memory.
    stages = [(k, j) for k in (1 << e for e in range(1, size.bit_length())) for j in
              (k >> d for d in range(1, k.bit_length()))]  # fmt: skip
    ks = jnp.asarray([k for k, _ in stages] or [0], jnp.int32)
    js = jnp.asarray([j for _, j in stages] or [0], jnp.int32)

    def stage(i, carry):
        keys, cols = carry
        k, j = ks[i], js[i]
        partner = pos ^ j
        take_min = (pos < partner) == ((pos & k) == 0)
        mine = keys + cols
        theirs = [x[partner] for x in mine]
        swap = take_min == greater(keys, theirs[: len(keys)])
        mine = [jnp.where(swap, t, m) for m, t in zip(mine, theirs, strict=True)]
        return mine[: len(keys)], mine[len(keys) :]

    keys, cols = jax.lax.fori_loop(0, len(stages), stage, (keys, cols))
    return tuple(c[:n] for c in cols)


def once(fn):
    """``fn(state, *args) -> (state, out)`` run inside a ``while`` loop of one iteration."""
    import jax
    import jax.numpy as jnp

    def wrapped(state, *args):
        out0 = jax.eval_shape(fn, state, *args)[1]
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out0)
        # A stop flag that starts from the input: XLA cannot prove the trip count.
        done = jax.tree.leaves(args)[0].ravel()[0] == jnp.iinfo(jnp.int32).min

        def body(carry):
            st, _, _ = carry
            st, out = fn(st, *args)
            return st, out, jnp.bool_(True)

        st, out, _ = jax.lax.while_loop(lambda c: ~c[2], body, (state, zeros, done))
        return st, out

    return wrapped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="pickle of serialized executables (ab_compiled.py's format)")
    ap.add_argument("--shapes", default="decode,admit-1-4096,admit-2-4096")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--peer", default=None, help="vllm_kv_bench.py (default: vs_vllm's)")
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_FLAGS]).strip()
    import jax  # after XLA_FLAGS: XLA reads them once, when it starts

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import ab_compiled
    from jax.experimental import serialize_executable

    jax.config.update("jax_platforms", "cpu")
    shapes = ab_compiled._pick_shapes(args.shapes)
    vs = ab_compiled._import_vs_vllm()
    jit, sort = jax.jit, jax.lax.sort
    # Only while vs_vllm builds and traces its steps.
    jax.jit = lambda fn, **kw: jit(once(fn), **kw)
    jax.lax.sort = bitonic_sort
    try:
        run = ab_compiled._make_run(vs, args)
        blobs = {}
        for shape in shapes:
            t = time.perf_counter()
            comp = ab_compiled._compile(run, shape)
            hoisted = comp.as_text().count('xla_cpu_small_call="true"')
            print(f"{shape}: compiled in {time.perf_counter() - t:.1f} s, {hoisted} hoisted calls")
            blobs[shape] = serialize_executable.serialize(comp)[0]
    finally:
        jax.jit, jax.lax.sort = jit, sort
    pathlib.Path(args.out).write_bytes(pickle.dumps(blobs))
    print(f"{args.out}: {len(blobs)} executables")


if __name__ == "__main__":
    main()
