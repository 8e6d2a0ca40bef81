"""Strict test environment shared by every test.

The host platform is split into 8 CPU devices before JAX is imported, so the sharding tests
can build a mesh; dtype promotion is strict so an accidental float64/int64 or a silent
int32 -> float upcast fails loudly; x64 stays off (the library must work in 32-bit mode).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_enable_x64", False)


def pytest_configure(config):
    # A test that silently ran on 1 device would hide sharding bugs.
    assert jax.device_count() == 8, "conftest must run before anything imports jax"


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(0)


_last_dir = None


def pytest_runtest_setup(item):
    # One long process compiles thousands of programs; dropping JAX's caches when the run
    # moves to another test directory bounds the memory they hold (a full run once crashed
    # inside an XLA compile late in the session). Tests within a directory still share
    # their compilations (e.g. the coordinator tests compile each op once per plan).
    global _last_dir
    here = item.path.parent
    if _last_dir is not None and here != _last_dir:
        import gc

        jax.clear_caches()
        gc.collect()
    _last_dir = here


@pytest.fixture(autouse=True)
def _fixed_prefix_key_seed(monkeypatch):
    # Every cache state a test creates without seed= gets the same prefix key seed, so tests
    # may compare two independently created states bit for bit. Serving draws a secret seed
    # per state (create_state(seed=None)); tests/prefix/test_prefix_keys.py undoes this patch
    # to check that.
    import numpy as np

    from flatkv_jax.coordinator import state

    monkeypatch.setattr(state, "new_seed", lambda: np.array([0x5EED, 0, 0, 0], np.uint32))


# --- CI scheduling: `-n 2 --dist loadfile` (pyproject.toml) -------------------------------------
#: Files whose tests each run in a fresh subprocess (nothing is shared in-process): each test
#: is its own unit of work, so both workers take some.
_PER_TEST = ("tests/test_docs_examples.py", "tests/test_notebooks.py")
#: Worker seconds per unit (a full run on a loaded 2-core machine, 2026-12-03), used only to
#: start the longest units first: a long unit handed out last runs alone at the end. Unlisted
#: units are short. The order matters, not the exact numbers.
_WEIGHT = {
    "tests/coordinator": 1800,
    "tests/serving": 1100,
    "tests/model": 1000,
    "tests/oracle": 1000,
    "tests/prefix": 950,
    "tests/demo": 410,
    "tests/serving_kinds": 300,
    "tests/test_notebooks.py::test_notebook_runs[serving_experiment.ipynb]": 280,
    "tests/sharding": 240,
    "tests/test_docs_examples.py::test_page_examples_run[serving.md]": 240,
    "tests/test_notebooks.py::test_notebook_runs[lifecycle_walkthrough.ipynb]": 230,
    "tests/test_docs_examples.py::test_page_examples_run[coordinator.md]": 210,
    "tests/test_docs_examples.py::test_page_examples_run[routing.md]": 190,
    "tests/test_notebooks.py::test_notebook_runs[quickstart.ipynb]": 150,
    "tests/test_docs_examples.py::test_page_examples_run[sleep.md]": 45,
}


def _unit(nodeid: str) -> str:
    """A test's unit of work: its directory under tests/ (the files of a directory share
    compiled programs: tests/serving/test_engine_sleep.py reuses test_engine.py's engines, the
    tests/model files one jitted step, the coordinator files the ops of one plan; JAX's caches
    are only dropped between directories, above), a top-level file, or one subprocess test."""
    path = nodeid.split("::", 1)[0]
    if path in _PER_TEST:
        return nodeid
    folder = path.rpartition("/")[0]
    return path if folder == "tests" else folder


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with :func:`_unit` as the unit, longest units first, and a worker
    given its next unit only when it is about to idle (so no worker hoards long units)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid):
            return _unit(nodeid)

        def _assign_work_unit(self, node):
            longest = max(self.workqueue, key=lambda unit: _WEIGHT.get(unit, 0))
            self.workqueue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

        def _reschedule(self, node):
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            # A worker runs a test once it knows the next one: one pending test means idle.
            if self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

    return Scheduling(config, log)
