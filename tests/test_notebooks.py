"""Every notebook's code cells run top to bottom (the notebooks are documentation that must work).

Each notebook runs in a fresh Python process, as a user's kernel would: it must not depend on
this suite's strict conftest settings, and a long test session's compiled-code caches must not
leak into it. The notebooks assert their key numbers in their own cells (capacities, hits,
statuses, parity), so a notebook whose story stops being true fails here; figures are drawn
with matplotlib's Agg backend (no display).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))

_RUNNER = """
import json, sys
nb = json.load(open(sys.argv[1]))
scope = {}
for i, c in enumerate(x for x in nb["cells"] if x["cell_type"] == "code"):
    exec(compile("".join(c["source"]), f"{sys.argv[1]}[cell {i}]", "exec"), scope)
"""


# A line each notebook prints when its story reached the end (besides its own asserts).
EXPECTED_OUTPUT = {
    "quickstart.ipynb": "hit 16 tokens",
    "plan_explorer.ipynb": "more tokens in the same bytes",
    "lifecycle_walkthrough.ipynb": "every page is free again",
    "serving_experiment.ipynb": "greedy tokens equal",
}


def test_every_notebook_is_covered():
    assert {p.name for p in NOTEBOOKS} == set(EXPECTED_OUTPUT)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    nb = json.loads(path.read_text())
    assert any(c["cell_type"] == "code" for c in nb["cells"]), f"{path.name} has no code cells"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {
        "JAX_PLATFORMS": "cpu",
        "MPLBACKEND": "Agg",
    }
    r = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert EXPECTED_OUTPUT[path.name] in r.stdout, r.stdout[-4000:]
