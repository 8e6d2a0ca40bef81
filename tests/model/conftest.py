"""Shared model fixtures: one tiny model and plan per format, built once per test session."""

from __future__ import annotations

import pytest
from model_harness import Setup

from flatkv_jax.model import tiny_model


@pytest.fixture(scope="session")
def fp32_setup():
    return Setup(tiny_model())
