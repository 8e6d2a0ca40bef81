"""Where a compiled step's time goes: leaf XLA:CPU thunks per coordinator function.

Replays ``benchmarks/vs_vllm.py``'s trace (as ``ab_compiled.py`` does), captures a few
states at which each chosen shape runs, then for each shape:

- compiles the step and reports its ``memory_analysis()`` temporaries and every ``copy``
  of 100,000 elements or more in the compiled HLO (a pool- or index-sized copy is a bug;
  a copy whose source and destination share a buffer costs nothing at run time, which the
  temporaries and the thunk list below tell apart);
- times it unprofiled (median and min microseconds per call over fresh copies of the
  captured states: the states differ, so the spread is partly the work, partly the machine);
- traces it with ``jax.profiler`` (host tracer level 3: one event per executed thunk) and
  attributes every **leaf** thunk (no thunk nested in it: a ``while`` or ``cond`` thunk
  counts only through its body) to the coordinator functions it was traced in, by the
  ``jax.named_scope`` this script wraps around them (:data:`SCOPES`): microseconds and
  thunks per call per scope, per thunk kind (``wrapped_scatter``, ``bitcast_gather_fusion``
  ...), and the costliest thunks.

On XLA:CPU a step's time is about its thunk count times ~1-2 us (dispatch, not arithmetic:
most thunks touch a few hundred words) plus a fixed ~75 us per call for a donated state of
33 leaves, so the thunk counts are what to cut. The leaf sum is less than the unprofiled
time: the gap is the executor's own work between thunks.

Run (about 3 minutes per shape on the 2-vCPU machine; no other load, or the numbers drift)::

    python benchmarks/profile_steps.py --shapes decode,admit-1-4096,admit-2-4096

The captured states are fresh copies, so every buffer starts cold in the caches. ``--live
START:STOP`` instead profiles the decode steps ``START .. STOP - 1`` of the replay itself (the
state donated from step to step, as ``vs_vllm.py`` runs it), keeping only the thunks that ran
inside those steps (a trace annotation marks each)::

    python benchmarks/profile_steps.py --live 150:250

The scopes are added by replacing the listed functions in every ``flatkv_jax`` module that
imported them, before anything is traced: a profiling aid only (the library itself names no
scopes, so its programs stay free of profiler metadata).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import functools
import glob
import importlib
import pkgutil
import re
import sys
import tempfile
import time

import ab_compiled
import jax
import numpy as np

#: (module, function names) wrapped in a ``jax.named_scope`` of their name.
SCOPES = (
    (
        "flatkv_jax.coordinator.ops",
        (
            *("extend_fn", "retire_fn", "reclaim_fn", "retire_reclaim_fn", "admit_fn"),
            "release_fn",
            *("_match_admission", "_record_prefix_admission", "_start_requests"),
        ),
    ),
    ("flatkv_jax.coordinator.alloc", ("grow", "sweep", "evict", "free_now")),
    (
        "flatkv_jax.coordinator.publish",
        ("publish_blocks", "_publish", "_completed_blocks", "_share_blocks", "pin", "take_hits"),
    ),
    (
        "flatkv_jax.prefix.keys",
        ("extend_chain", "add_terms", "subkeys", "token_terms", "chain_lanes", "keys_from_lanes"),
    ),
    ("flatkv_jax.prefix.index", ("insert_in", "lookup_in", "remove_in", "holds_in")),
    ("flatkv_jax.prefix.lru", ("cache_in", "take_in", "evict_all", "take_marks_in")),
    ("flatkv_jax.block_pool", ("allocate", "incref", "decref", "decref_left", "fit")),
    ("flatkv_jax.prefix.match", ("match_prompts",)),
)
_PREFIX = "S_"


def add_scopes() -> None:
    """Wraps every function of :data:`SCOPES` in a named scope, wherever it was imported."""
    import flatkv_jax

    mods = [
        importlib.import_module(m.name)
        for m in pkgutil.walk_packages(flatkv_jax.__path__, "flatkv_jax.")
        if m.name.startswith(("flatkv_jax.coordinator", "flatkv_jax.prefix", "flatkv_jax.block"))
    ]
    for mod_name, names in SCOPES:
        mod = importlib.import_module(mod_name)
        for name in names:
            orig = getattr(mod, name)

            @functools.wraps(orig)
            def scoped(*a, _f=orig, _n=name, **k):
                with jax.named_scope(_PREFIX + _n):
                    return _f(*a, **k)

            for m in mods:
                if getattr(m, name, None) is orig:
                    setattr(m, name, scoped)


def parse_shape(text: str) -> tuple:
    if text == "decode":
        return ("decode",)
    m = re.fullmatch(r"admit-(\d+)-(\d+)", text)
    if not m:
        raise SystemExit(f"--shapes {text!r}: write decode or admit-ROWS-WIDTH (admit-1-4096)")
    return ("admit", int(m[1]), int(m[2]))


def capture(run, shapes, per_shape: int, every: int = 37):
    """Replays the trace until ``per_shape`` states of every shape are captured."""
    caps: dict = collections.defaultdict(list)
    seen: collections.Counter = collections.Counter()
    orig = run._timed

    class _Done(Exception):
        pass

    def timed(key, fn, *a):
        shape = ("decode",) if key == "decode" else key
        seen[shape] += 1
        if shape in shapes and seen[shape] % every == 5 and len(caps[shape]) < per_shape:
            caps[shape].append((ab_compiled._copy(run.state), a))
        if all(len(caps[s]) >= per_shape for s in shapes):
            raise _Done
        return orig(key, fn, *a)

    run._timed = timed
    with contextlib.suppress(_Done):
        run.run()
    missing = [s for s in shapes if len(caps[s]) < per_shape]
    if missing:
        raise SystemExit(f"the trace ran {missing} fewer than {per_shape} times: pick others")
    return caps


def op_names(hlo: str) -> dict[str, str]:
    """Instruction name -> its ``op_name`` metadata (the named scopes it was traced in)."""
    out, operands = {}, {}
    for line in hlo.split("\n"):
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = [^(]*\(([^)]*)\)", line)
        if m:
            on = re.search(r'op_name="([^"]*)"', line)
            out[m[1]] = on[1] if on else ""
            operands[m[1]] = re.findall(r"%([\w.\-]+)", m[2])
    # Instructions XLA made up (a cumsum's reduce-window stages, copies) carry no metadata:
    # they take the scope of an operand, else of a user.
    users: dict = collections.defaultdict(list)
    for name, ops_ in operands.items():
        for o in ops_:
            users[o].append(name)
    for _ in range(4):
        for name in out:
            if not out[name]:
                near = [out.get(o, "") for o in operands[name]] + [out[u] for u in users[name]]
                out[name] = next((x for x in near if x), "")
    return out


def big_copies(hlo: str, min_elems: int = 100_000) -> dict[str, str]:
    """Instruction name -> line of every ``copy`` of at least ``min_elems`` elements."""
    found = {}
    for line in hlo.split("\n"):
        m = re.search(r"%([\w.\-]+) = (\w+)\[([\d,]+)\]\S* copy\(", line)
        if m and int(np.prod([int(d) for d in m[3].split(",")])) >= min_elems:
            found[m[1]] = line.strip()[:100]
    return found


def in_windows(t: int, windows: list[tuple[int, int]]) -> bool:
    """Whether time ``t`` lies in one of ``windows`` (sorted ``(start, end)`` pairs)."""
    i = bisect.bisect_right(windows, (t, float("inf"))) - 1
    return i >= 0 and windows[i][0] <= t <= windows[i][1]


#: The trace annotation ``--live`` wraps around each profiled step.
LIVE_MARK = "profile_steps.live_step"


def start_thunk_trace(directory: str) -> None:
    """Starts a ``jax.profiler`` trace with one event per executed thunk (host level 3)."""
    opts = jax.profiler.ProfileOptions()
    opts.host_tracer_level = 3
    opts.python_tracer_level = 0
    jax.profiler.start_trace(directory, profiler_options=opts)


def leaf_thunks(pb: str, names: dict[str, str], live: bool = False):
    """(scope path, instruction, microseconds) of every leaf thunk event in the trace; with
    ``live``, only those that started inside a :data:`LIVE_MARK` annotation."""
    data = jax.profiler.ProfileData.from_file(pb)
    windows = sorted(
        (e.start_ns, e.start_ns + e.duration_ns)
        for plane in data.planes
        for line in plane.lines
        for e in line.events
        if e.name == LIVE_MARK
    )
    for plane in data.planes:
        for line in plane.lines:
            # Parents before the thunks nested in them (same start: the longer first).
            evs = sorted(
                (
                    (e.start_ns, e.start_ns + e.duration_ns, e.name.split(":")[0])
                    for e in line.events
                    if e.name.split(":")[0] in names
                ),
                key=lambda ev: (ev[0], -ev[1]),
            )
            for i, (s0, e0, name) in enumerate(evs):
                if i + 1 < len(evs) and evs[i + 1][0] < e0:
                    continue  # a thunk nested in this one started before it ended
                if live and not in_windows(s0, windows):
                    continue  # another step's thunk with the same name
                path = [p[len(_PREFIX) :] for p in names[name].split("/") if p.startswith(_PREFIX)]
                yield "/".join(path) or "(no scope)", name, (e0 - s0) / 1e3


def profile(run, shape, states, reps: int, top: int) -> None:
    fn = run.decode if shape[0] == "decode" else run.admit
    comp = fn.lower(states[0][0], *states[0][1]).compile()
    hlo = comp.as_text()
    names = op_names(hlo)
    temp = comp.memory_analysis().temp_size_in_bytes
    copies = big_copies(hlo)
    print(f"== {shape}: temporaries {temp / 1e6:.2f} MB, {len(copies)} copies of >= 1e5 elements")
    for st, a in states:  # warm up
        jax.block_until_ready(comp(ab_compiled._copy(st), *a))
    fresh = [(ab_compiled._copy(st), a) for _ in range(2 * reps) for st, a in states]
    jax.block_until_ready(fresh)
    wall = []
    for st, a in fresh[: len(fresh) // 2]:
        t0 = time.perf_counter()
        jax.block_until_ready(comp(st, *a))
        wall.append(time.perf_counter() - t0)
    print(f"   unprofiled: median {np.median(wall) * 1e6:.0f} us/call, min {min(wall) * 1e6:.0f}")
    traced = fresh[len(fresh) // 2 :]
    with tempfile.TemporaryDirectory() as d:
        start_thunk_trace(d)
        for st, a in traced:
            jax.block_until_ready(comp(st, *a))
        jax.profiler.stop_trace()
        pb = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]
        events = list(leaf_thunks(pb, names))
    n = len(traced)
    ran = collections.Counter(name for _, name, _ in events)
    for name, line in copies.items():
        # XLA elides a copy whose source and destination share a buffer: no thunk runs.
        print(f"   copy runs {ran[name] / n:.1f}x per call: {line}")
    report(events, n, top)


def report(events, n: int, top: int) -> None:
    """Prints leaf microseconds and thunks per call by scope, by thunk kind and per thunk."""
    by_scope: collections.Counter = collections.Counter()
    n_scope: collections.Counter = collections.Counter()
    by_kind: collections.Counter = collections.Counter()
    n_kind: collections.Counter = collections.Counter()
    by_thunk: collections.Counter = collections.Counter()
    for scope, name, us in events:
        kind = re.sub(r"(\.\d+)+$", "", name)
        by_scope[scope] += us / n
        n_scope[scope] += 1 / n
        by_kind[kind] += us / n
        n_kind[kind] += 1 / n
        by_thunk[(scope, name)] += us / n
    total = sum(by_scope.values())
    print(f"   leaf thunks: {total:.0f} us/call, {len(events) / n:.0f} thunks/call")
    print("   -- per scope (us/call, thunks/call)")
    for scope, us in by_scope.most_common(top):
        print(f"   {us:8.1f} {n_scope[scope]:6.1f}  {scope}")
    print("   -- per thunk kind")
    for kind, us in by_kind.most_common(min(top, 20)):
        print(f"   {us:8.1f} {n_kind[kind]:6.1f}  {kind}")
    print("   -- costliest thunks")
    for (scope, name), us in by_thunk.most_common(top):
        print(f"   {us:8.1f}  {scope}  {name}")


def profile_live(run, start: int, stop: int, top: int) -> None:
    """Profiles decode steps ``start .. stop - 1`` inside the replay (warm, donated state)."""
    names: dict[str, str] = {}
    seen = [0]
    orig = run._timed
    with tempfile.TemporaryDirectory() as trace_dir:

        def timed(key, fn, *a):
            if key != "decode":
                return orig(key, fn, *a)
            seen[0] += 1
            if seen[0] == 1:
                names.update(op_names(fn.lower(run.state, *a).compile().as_text()))
            if seen[0] == start:
                start_thunk_trace(trace_dir)
            if seen[0] == stop:
                jax.profiler.stop_trace()
            if start <= seen[0] < stop:
                with jax.profiler.TraceAnnotation(LIVE_MARK):
                    return orig(key, fn, *a)
            return orig(key, fn, *a)

        run._timed = timed
        run.run()
        if seen[0] < stop:
            raise SystemExit(f"--live {start}:{stop}: the trace has {seen[0]} decode steps")
        pb = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
        events = list(leaf_thunks(pb, names, live=True))
    print(f"== decode steps {start}..{stop - 1} of the replay (warm state)")
    report(events, stop - start, top)


def parse_live(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+):(\d+)", text)
    if not m or not 1 <= int(m[1]) < int(m[2]):
        raise SystemExit(f"--live {text!r}: write START:STOP with 1 <= START < STOP (150:250)")
    return int(m[1]), int(m[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="decode,admit-1-4096")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--states", type=int, default=4, help="captured states per shape")
    ap.add_argument("--reps", type=int, default=5, help="calls per state, timed and traced")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--peer", default=None, help="path of vllm_kv_bench.py (the trace)")
    ap.add_argument("--live", default=None, help="START:STOP decode steps of the replay itself")
    ap.add_argument(
        "--evict-ahead-tokens", type=int, default=0, help="the plan's evict_ahead_tokens"
    )
    args = ap.parse_args()
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    live = parse_live(args.live) if args.live else None
    add_scopes()
    vs = ab_compiled._import_vs_vllm()
    run = ab_compiled._make_run(
        vs,
        argparse.Namespace(peer=args.peer, batch=args.batch),
        evict_ahead_tokens=args.evict_ahead_tokens,
    )
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, batch {args.batch}")
    if live:
        profile_live(run, *live, args.top)
        return
    caps = capture(run, shapes, args.states)
    for shape in shapes:
        profile(run, shape, caps[shape], args.reps, args.top)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
