"""Every ``__all__`` of every package and module under flatkv_jax and kernels_pallas resolves:
``from X import *`` succeeds and binds exactly the listed names."""

import importlib
import pkgutil

import pytest

import flatkv_jax
import kernels_pallas


def _modules() -> list[str]:
    names = []
    for pkg in (flatkv_jax, kernels_pallas):
        names.append(pkg.__name__)
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            names.append(info.name)
    return sorted(names)


MODULES = _modules()


def test_walk_finds_the_packages():
    # A walk that found nothing would make every test below vacuous.
    assert "flatkv_jax.coordinator.ops" in MODULES
    assert "flatkv_jax.prefix" in MODULES
    assert "kernels_pallas.write_rows" in MODULES
    assert sum(hasattr(importlib.import_module(m), "__all__") for m in MODULES) >= 10


@pytest.mark.parametrize("name", MODULES)
def test_all_resolves(name):
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    if exported is None:
        return
    assert len(set(exported)) == len(exported), f"{name}.__all__ repeats a name"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ lists names the module does not define: {missing}"
    namespace: dict = {}
    exec(f"from {name} import *", namespace)  # the statement under test
    assert set(exported) <= set(namespace)
