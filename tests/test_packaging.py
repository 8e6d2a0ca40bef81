"""What a user of a Python library expects from the package: a version, a typing marker that
ships, ``python -m``, the license pyproject claims, and lint in CI."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import flatkv_jax

ROOT = Path(__file__).resolve().parents[1]

#: SHA-256 of the Apache License 2.0 text as published at apache.org/licenses/LICENSE-2.0.txt.
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def test_version_is_a_version_string():
    assert re.fullmatch(r"\d+\.\d+\.\d+", flatkv_jax.__version__)


def test_build_ships_py_typed_and_takes_the_version_from_the_package(tmp_path):
    """setuptools (offline, no wheel package needed): ``build_py`` copies ``py.typed`` into
    the build, and the distribution version is ``flatkv_jax.__version__``."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for pkg in ("flatkv_jax", "kernels_pallas"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=ignore)
    setup = [sys.executable, "-c", "from setuptools import setup; setup()"]

    def run(*args):
        return subprocess.run(
            [*setup, *args], cwd=src, capture_output=True, text=True, check=True, timeout=300
        )

    assert run("--version").stdout.strip().splitlines()[-1] == flatkv_jax.__version__
    run("-q", "build_py", "-d", str(tmp_path / "lib"))
    assert (tmp_path / "lib" / "flatkv_jax" / "py.typed").is_file()
    assert (tmp_path / "lib" / "flatkv_jax" / "__main__.py").is_file()


def test_python_dash_m_runs_the_cli():
    r = subprocess.run(
        [sys.executable, "-m", "flatkv_jax", "--version"],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"flatkv {flatkv_jax.__version__}"
    r = subprocess.run(
        [sys.executable, "-m", "flatkv_jax", "plan", "--model", "tiny-v4", "--pages", "64",
         "--max-requests", "2", "--max-context", "32", "--chunk", "8", "--verify", "1"],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "prefix granularity 16 tokens" in r.stdout


def test_license_is_the_apache_2_text():
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_SHA256
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # The SPDX form (the TOML-table form stops building with setuptools after 2027-02-18).
    assert meta["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in meta["build-system"]["requires"]


def test_ci_lints_with_ruff_from_the_dev_extra():
    ci = (ROOT / ".ci" / "run").read_text()
    lines = [ln.strip() for ln in ci.splitlines() if ln.strip() and not ln.startswith("#")]
    install = next(ln for ln in lines if ln.startswith("pip install") and "-e" in ln)
    assert "dev" in install and "test" in install
    fmt, check, tests = (
        lines.index(c) for c in ("ruff format --check .", "ruff check .", "python -m pytest -q")
    )
    assert lines.index(install) < fmt < check < tests  # lint before the (long) suite
    assert re.search(r'dev = \["ruff[^"]*"\]', (ROOT / "pyproject.toml").read_text())
