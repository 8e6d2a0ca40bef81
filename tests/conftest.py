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
