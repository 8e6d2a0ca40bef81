"""benchmarks/vs_vllm.py's host helpers: admission row buckets and the oracle's plan (same page
geometry as the V4-Flash plan the benchmark drives). The benchmark itself compiles V4-Flash
shapes for minutes and is run by hand (docs/benchmarks.md). Also the benchmarks' shared
``--platform`` choice (benchmarks/_platform.py)."""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from flatkv_jax import ServingLimits, plan_with_pages

_BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    # The benchmarks run as scripts, so their helpers (_platform) import from their folder.
    sys.path.insert(0, str(_BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, _BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(_BENCH))
    return mod


@pytest.fixture(scope="module")
def vs():
    return _load("vs_vllm")


def test_platform_is_chosen_by_argument_and_checked():
    """--platform defaults to cpu and is applied, and a platform JAX no longer can switch to
    (its backends exist) or an unknown name is refused with the fix, never measured silently."""
    plat = _load("_platform")
    ap = argparse.ArgumentParser()
    plat.add_platform_argument(ap)
    assert ap.parse_args([]).platform == "cpu"
    assert ap.parse_args(["--platform", "gpu"]).platform == "gpu"
    jnp.ones(1).block_until_ready()  # the test process's backend exists: cpu
    before = jax.config.jax_platforms
    try:
        assert plat.use_platform("auto").startswith("cpu (")
        assert plat.use_platform("cpu").startswith("cpu (")
        with pytest.raises(ValueError, match=r"platform='cuda' is invalid: it must be one of cpu"):
            plat.use_platform("cuda")
        with pytest.raises(ValueError, match=r"platform='tpu' is invalid here: JAX already runs"):
            plat.use_platform("tpu")
    finally:
        jax.config.update("jax_platforms", before)


def test_row_buckets_are_powers_of_two_up_to_the_cap(vs):
    assert [vs.row_bucket(n, 16) for n in range(1, 17)] == [1, 2, 4, 4] + [8] * 4 + [16] * 8
    assert [vs.row_bucket(n, 6) for n in (1, 3, 5, 6)] == [1, 4, 6, 6]


def test_oracle_plan_keeps_the_page_geometry(vs):
    gs = vs.groups()
    batch, max_len, budget = 4, 4096 + 256, 16384
    limits = ServingLimits(
        max_requests=batch,
        max_context=max_len,
        chunk_tokens=4096,
        verify_width=0,
        step_tokens=budget + batch,
    )
    plan = plan_with_pages(gs, limits, vs.pool_pages(gs, batch, max_len, budget, 1.25))
    small = vs.oracle_plan(plan)
    assert small.limits == plan.limits
    assert small.prefix_granularity == plan.prefix_granularity == 128
    for a, b in zip(plan.groups, small.groups, strict=True):
        assert (a.name, a.block_tokens, a.window, a.retention) == (
            b.name,
            b.block_tokens,
            b.window,
            b.retention,
        )
        assert plan.pages(a) == small.pages(b)
        assert len(b.layers) == 1 and b.fields[0].format.shape == (1,)


def test_hit_ceilings_count_whole_granules_shared_with_an_earlier_prompt(vs):
    a = [1, 2, 3, 4, 5, 6, 7]
    prompts = [
        a,  # first: nothing earlier
        [*a[:4], 9, 9, 9],  # shares 2 granules of 2 with a
        [*a[:2], 8, 8],  # shares 1; its second granule differs
        a[:5],  # shares 2 whole granules: its 5th token stays to compute
        a[:4],  # shares 2, but at least its last token is computed: 1 granule
        [0, *a[1:]],  # differs in the first token: nothing
    ]
    assert vs.hit_ceilings(prompts, 2) == [0, 4, 2, 4, 2, 0]
    assert vs.hit_ceilings(prompts, 4) == [0, 4, 0, 4, 0, 0]


def test_platform_missing_here_is_named_with_the_fix():
    """A fresh process asking for a backend this machine lacks gets our message, not JAX's
    bare AssertionError (jax 0.10) or a silent fall-back to the CPU."""
    code = (
        f"import sys; sys.path.insert(0, {str(_BENCH)!r}); import _platform; "
        "print(_platform.use_platform('tpu'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if out.returncode == 0:
        pytest.skip(f"this machine has a TPU: {out.stdout.strip()}")
    assert "platform='tpu' is not available on this machine" in out.stderr, out.stderr[-2000:]
    assert "Fix: install the jax plugin for it" in out.stderr


def test_ab_compiled_compares_whole_states_and_names_its_inputs():
    """benchmarks/ab_compiled.py: two versions' outputs are the same only if every leaf is
    (shape and value), and a version given without its file is refused with the form."""
    ab = _load("ab_compiled")
    a = {"x": jnp.arange(4), "y": (jnp.ones((2, 2)), jnp.zeros(3, jnp.int32))}
    b = {"x": jnp.arange(4), "y": (jnp.ones((2, 2)), jnp.zeros(3, jnp.int32))}
    assert ab._same(a, b)
    c = {"x": jnp.arange(4).at[2].set(7), "y": b["y"]}
    assert not ab._same(a, c)
    assert not ab._same(a, {"x": jnp.arange(4)})
    args = argparse.Namespace(versions=["old=/nonexistent.pkl", "new"], batch=4, peer=None)
    with pytest.raises(SystemExit, match=r"version 'new': write it as NAME=FILE"):
        ab.run_ab(args)
    args.versions = ["old=/nonexistent.pkl"]
    with pytest.raises(SystemExit, match=r"/nonexistent.pkl is not a file; make it with `dump`"):
        ab.run_ab(args)


def test_profile_steps_reads_shapes_scopes_and_copies_from_the_hlo():
    """benchmarks/profile_steps.py's host helpers: the shape and ``--live`` arguments, the
    step windows ``--live`` keeps thunks from, the scope of each instruction (made-up ones
    take an operand's), and the big copies it lists."""
    ps = _load("profile_steps")
    assert ps.parse_shape("decode") == ("decode",)
    assert ps.parse_shape("admit-2-4096") == ("admit", 2, 4096)
    with pytest.raises(SystemExit, match=r"'admit-2': write decode or admit-ROWS-WIDTH"):
        ps.parse_shape("admit-2")
    hlo = """
  %a.1 = s32[8]{0} fusion(%p.0), kind=kLoop, metadata={op_name="jit(f)/S_grow/add"}
  %wrapped_reduce-window.3 = s32[8]{0} fusion(%a.1), kind=kLoop, calls=%c.2
  %copy.9 = u32[335872,7]{1,0} copy(%wrapped_reduce-window.3)
  %copy.10 = s32[16]{0} copy(%a.1)
"""
    assert ps.parse_live("150:250") == (150, 250)
    for bad in ("250:150", "0:5", "150"):
        with pytest.raises(SystemExit, match=r"write START:STOP with 1 <= START < STOP"):
            ps.parse_live(bad)
    windows = [(10, 20), (30, 40)]
    inside = [t for t in (5, 10, 15, 20, 25, 30, 40, 41) if ps.in_windows(t, windows)]
    assert inside == [10, 15, 20, 30, 40]
    names = ps.op_names(hlo)
    assert names["a.1"] == "jit(f)/S_grow/add"
    assert names["wrapped_reduce-window.3"] == "jit(f)/S_grow/add"
    assert names["copy.9"] == "jit(f)/S_grow/add"
    assert list(ps.big_copies(hlo)) == ["copy.9"]


def test_pairs_run_the_peer_on_the_same_trace_arguments(vs):
    """``--pairs``: the peer's command carries every trace and pool argument of ours, and the
    pair ratios add the peer's hashing to its manager time (as the --vllm ratios do)."""
    args = argparse.Namespace(
        peer_python="/p/bin/python", peer="/s/vllm_kv_bench.py", requests_per_batch=4.0,
        decode_len=96, prompt_min=512, prompt_max=2048, num_system_prompts=3,
        system_prompt_len=256, max_num_batched_tokens=8192, pool_factor=1.5, seed=7,
    )  # fmt: skip
    cmd = vs.peer_command(args, 64, "/t/out.json")
    assert cmd[:2] == ["/p/bin/python", "/s/vllm_kv_bench.py"]
    flags = dict(zip(cmd[2::2], cmd[3::2], strict=True))
    assert flags == {
        "--configs": "dsv4", "--batches": "64", "--repeats": "1", "--json": "/t/out.json",
        "--requests-per-batch": "4.0", "--decode-len": "96", "--prompt-min": "512",
        "--prompt-max": "2048", "--num-system-prompts": "3", "--system-prompt-len": "256",
        "--max-num-batched-tokens": "8192", "--pool-factor": "1.5", "--seed": "7",
    }  # fmt: skip
    peer = {"decode_us": 20.0, "hash_dec_us": 2.0, "admit_us": 300.0, "hash_admit_us": 1700.0}
    assert vs.pair_ratios(peer, {"decode_us": 2.2, "admit_us": 400.0}) == pytest.approx((10, 5))


def test_pairs_refuse_a_missing_peer_venv_and_a_second_peer_source():
    """The refusals name the fix (the setup script; one source of peer numbers)."""
    script = str(_BENCH / "vs_vllm.py")
    base = [sys.executable, script, "--batches", "8", "--pairs", "1", "--compile-cache", ""]
    out = subprocess.run(
        [*base, "--peer-python", "/nonexistent/python"], capture_output=True, text=True
    )
    assert out.returncode != 0
    assert "setup_vllm_peer.sh" in out.stderr and "/nonexistent/python" in out.stderr
    out = subprocess.run([*base, "--vllm", "x.json"], capture_output=True, text=True)
    assert out.returncode != 0 and "--pairs runs the peer itself: drop --vllm" in out.stderr


def test_compare_evict_ahead_reads_two_counts(vs):
    """``--compare-evict-ahead A,B``: two non-negative counts, or a refusal with an example."""
    assert vs.parse_pair("0,16") == (0, 16)
    assert vs.parse_pair(" 8, 0") == (8, 0)
    for bad in ("16", "0,16,32", "a,b", "-1,4"):
        with pytest.raises(SystemExit, match=r"write two counts, e.g. 0,16"):
            vs.parse_pair(bad)


@pytest.mark.parametrize("n", [1, 2, 5, 64, 100])
@pytest.mark.parametrize("num_keys", [1, 2, 3])
def test_one_program_probe_sort_is_lax_sort(n, num_keys):
    """benchmarks/one_program_probe.py's sorting network gives ``jax.lax.sort``'s result
    (stable, lexicographic on the first ``num_keys`` operands), with many equal keys."""
    probe = _load("one_program_probe")
    keys = jax.random.randint(jax.random.key(n * 7 + num_keys), (3, n), 0, 4, jnp.int32)
    ops = (*keys, jnp.arange(n, dtype=jnp.int32)[::-1])
    want = jax.lax.sort(ops, num_keys=num_keys)
    got = jax.jit(lambda o: probe.bitonic_sort(o, num_keys=num_keys))(ops)
    for w, g in zip(want, got, strict=True):
        assert jnp.array_equal(w, g), (w, g)


def test_one_program_probe_runs_a_step_once():
    """``once(fn)`` runs ``fn``'s body exactly once inside a while loop."""
    probe = _load("one_program_probe")

    def step(state, x):
        return state + x, state * 2

    state, out = jax.jit(probe.once(step))(jnp.arange(4), jnp.ones(4, jnp.int32))
    assert state.tolist() == [1, 2, 3, 4] and out.tolist() == [0, 2, 4, 6]
