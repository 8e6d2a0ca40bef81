"""The engine's step kinds and row bounds (narrow steps, ``admit_rows``, ``prefill_rows``).

A directory of its own, whose modules drop JAX's compiled programs when they end: these tests
compile some twenty step programs (plans of their own, one per kind), and each holds a few
thousand memory maps. In one process with tests/serving they held ~60,600 maps at the end
(2026-12-06), 92 % of Linux's default ``vm.max_map_count`` of 65,530, and this directory
alone ~53,600 without the per-module drop; past the limit a process aborts inside XLA (seen
on a branch that compiled a few more). The engines, plans and workloads are those of
tests/serving, imported from there.
"""

import gc
import pathlib
import sys

import jax
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "serving"))


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    yield
    jax.clear_caches()
    gc.collect()
