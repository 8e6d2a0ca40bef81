"""`flatkv demo` end to end through the command line, on a very small workload.

One run of the real engine (the tiny model, both step kinds compiled once), checked by the
demo's own independent checks: every request served, no compilation after warm-up, the
engine's prefix hits equal to the radix oracle's on the replayed trace, and parity with dense
recompute within the fp32 tolerance.
"""

import json

from demo_cases import JSON_KEYS

from flatkv_jax import cli
from flatkv_jax.demo.runner import TOL_FP32


def test_demo_json_end_to_end(capsys):
    # 3 requests = the first session's first three turns (seed 0): turn 2 and 3 extend the
    # previous prompt and answer, so the prefix cache must hit.
    code = cli.main(["demo", "--requests", "3", "--json"])
    out = capsys.readouterr().out
    data = json.loads(out)
    assert set(data) == JSON_KEYS
    assert data["requests"] == {"submitted": 3, "served": 3, "aborted": 0}
    assert data["compilations_after_warmup"] == 0
    prefix = data["prefix"]
    assert prefix["hit_tokens"] > 0
    assert prefix["oracle_agrees"], prefix["oracle_notes"]
    assert prefix["hit_tokens"] == prefix["oracle_hit_tokens"]
    assert prefix["hit_rate"] == prefix["oracle_hit_rate"]
    parity = data["parity"]
    assert parity["tokens"] > 0 and parity["greedy_mismatches"] == 0
    assert parity["max_abs_logit_error"] <= TOL_FP32
    assert data["ok"] is True and code == 0
