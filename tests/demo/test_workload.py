"""The demo's synthetic workload: deterministic, shared system prompts, multi-turn sessions."""

import dataclasses

import pytest

from flatkv_jax.demo.workload import Turn, Workload, WorkloadConfig, make_workload


def test_same_seed_same_workload_other_seed_another():
    assert make_workload(3) == make_workload(3)
    assert make_workload(3) != make_workload(4)


def test_structure():
    cfg = WorkloadConfig(requests=60, tenants=3, vocab=64)
    wl = make_workload(0, cfg)
    assert wl.requests == 60
    assert len(wl.system_prompts) == 3
    lo, hi = cfg.system_tokens
    assert all(lo <= len(p) <= hi for p in wl.system_prompts)
    arrivals = [s.arrival_step for s in wl.sessions]
    assert arrivals == sorted(arrivals)
    assert [s.index for s in wl.sessions] == list(range(len(wl.sessions)))
    # Several sessions per tenant share the tenant's system prompt: that is the prefix the
    # prefix cache serves across sessions.
    per_tenant = [sum(s.namespace == t for s in wl.sessions) for t in range(3)]
    assert max(per_tenant) >= 2
    multi = [s for s in wl.sessions if len(s.turns) > 1]
    assert multi, "the workload must contain multi-turn sessions"
    lengths = set()
    for s in wl.sessions:
        first = wl.first_prompt(s)
        assert first[: len(wl.system_prompts[s.namespace])] == wl.system_prompts[s.namespace]
        assert s.turns[0].think_steps == 0
        for t in s.turns:
            assert all(1 <= x < 64 for x in t.user)
            lengths.add(t.max_new_tokens)
    # Mixed decode lengths (short and long answers).
    assert min(lengths) <= cfg.short_decode[1] and max(lengths) >= cfg.long_decode[0]


def test_next_prompt_extends_the_previous_prompt_and_answer():
    turn = Turn(user=(7, 8), max_new_tokens=3, think_steps=1)
    assert Workload.next_prompt((1, 2, 3), (4, 5), turn) == (1, 2, 3, 4, 5, 7, 8)


def test_longest_session_fits_the_bound():
    cfg = WorkloadConfig(requests=200)
    wl = make_workload(1, cfg)
    for s in wl.sessions:
        total = len(wl.system_prompts[s.namespace]) + sum(
            len(t.user) + t.max_new_tokens for t in s.turns
        )
        assert total <= cfg.max_session_tokens


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("requests", 0, "requests=0"),
        ("tenants", -1, "tenants=-1"),
        ("vocab", 1, "vocab=1"),
        ("short_user", (5, 2), "short_user=(5, 2)"),
        ("think_steps", (1,), "think_steps=(1,)"),
        ("long_fraction", 1.5, "long_fraction=1.5"),
    ],
)
def test_config_errors_name_the_field(field, value, needle):
    with pytest.raises(ValueError, match="Fix") as e:
        dataclasses.replace(WorkloadConfig(), **{field: value})
    assert needle in str(e.value)


def test_seed_must_be_a_nonnegative_int():
    with pytest.raises(ValueError, match="seed=-1"):
        make_workload(-1)
