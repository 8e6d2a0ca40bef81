"""The benchmarks' ``--platform`` argument: which JAX backend a run measures.

Chosen by argument, never by an environment variable a shell left behind: a run on a GPU host
that silently measured the CPU is how the first H200 session here lost half its device time.
The choice is applied with ``jax.config.update("jax_platforms", ...)``, which works after
``import jax`` as long as no array has been created yet (importing flatkv_jax creates none).
"""

from __future__ import annotations

import argparse

import jax

# Our names -> JAX's platform names ("auto" keeps JAX's own choice: the accelerator if any).
PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu", "auto": None}


def add_platform_argument(parser: argparse.ArgumentParser, default: str = "cpu") -> None:
    """Adds ``--platform {cpu,gpu,tpu,auto}`` to ``parser``."""
    parser.add_argument(
        "--platform",
        choices=tuple(PLATFORMS),
        default=default,
        help=f"JAX backend to measure (default {default}; auto: the accelerator if there is one)",
    )


def use_platform(name: str) -> str:
    """Selects the backend named ``name`` (see :data:`PLATFORMS`) and returns a one-line
    description of the device the run measures, for the benchmark's header.

    Raises:
      ValueError: ``name`` is not a known platform or not available here, or the run would
        measure another backend than the one asked for (JAX had already created its
        backends: call this before any array is made).
    """
    if name not in PLATFORMS:
        raise ValueError(
            f"platform={name!r} is invalid: it must be one of {', '.join(PLATFORMS)}. "
            "Fix: pass --platform cpu, gpu, tpu or auto."
        )
    if PLATFORMS[name] is not None:
        jax.config.update("jax_platforms", PLATFORMS[name])
    try:
        dev = jax.devices()[0]
    except (RuntimeError, AssertionError) as e:  # jax 0.10 asserts when no backend is left
        raise ValueError(
            f"platform={name!r} is not available on this machine ({type(e).__name__}: {e}). "
            "Fix: install the jax plugin for it (e.g. jax[cuda13]) or pass --platform cpu."
        ) from e
    if name != "auto" and dev.platform != name:
        raise ValueError(
            f"platform={name!r} is invalid here: JAX already runs on {dev.platform}, so the run "
            f"would measure {dev.platform}. Fix: select the platform before any JAX array is made."
        )
    return f"{dev.platform} ({dev.device_kind})"
