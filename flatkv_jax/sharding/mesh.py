"""The data-parallel rank mesh and the per-rank prefix-key seeds."""

from __future__ import annotations

import hashlib

import jax
import numpy as np
from jax.sharding import Mesh

from flatkv_jax.errors import fail, is_int

#: The name of the data-parallel (attention) rank axis of every sharded cache array.
RANK_AXIS = "dp"


def rank_mesh(n_ranks: int, devices=None) -> Mesh:
    """A one-axis mesh (:data:`RANK_AXIS`) over ``n_ranks`` devices: rank ``r`` is device ``r``.

    ``n_ranks = 1`` is valid (a mesh of one): the same sharded code then runs on one device.

    Args:
      n_ranks: data-parallel ranks, one device each.
      devices: the devices to use (default ``jax.devices()``, every device of every process);
        the first ``n_ranks`` are taken in order.

    Raises:
      TypeError/ValueError: ``n_ranks`` not a positive int, or more ranks than devices.
    """
    if not is_int(n_ranks):
        fail("n_ranks", n_ranks, "it must be an int", "pass the number of ranks", exc=TypeError)
    if n_ranks < 1:
        fail("n_ranks", n_ranks, "it must be positive", "pass n_ranks >= 1")
    devs = list(jax.devices() if devices is None else devices)
    if n_ranks > len(devs):
        fail(
            "n_ranks",
            n_ranks,
            f"each rank needs its own device and only {len(devs)} exist "
            f"(jax.device_count() = {jax.device_count()}, platform {devs[0].platform})",
            "pass n_ranks <= the device count; on CPU set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={n_ranks} before jax is imported",
        )
    return Mesh(np.array(devs[:n_ranks]), (RANK_AXIS,))


def mesh_ranks(mesh: object) -> int:
    """The rank count of a mesh made by :func:`rank_mesh` (raises on any other mesh)."""
    if not isinstance(mesh, Mesh) or mesh.axis_names != (RANK_AXIS,):
        fail(
            "mesh",
            mesh,
            f"the cache mesh has one axis named {RANK_AXIS!r}",
            "build it with flatkv_jax.sharding.rank_mesh(n_ranks)",
            exc=TypeError,
        )
    return int(mesh.devices.size)


def rank_seeds(seed, n_ranks: int) -> list[np.ndarray]:
    """Per-rank prefix-key seeds, ``uint32[SEED_WORDS]`` each.

    Rank ``r`` of ``create_state_sharded(plan, mesh, seed=seed)`` equals
    ``create_state(plan, seed=rank_seeds(seed, n)[r])``.

    Args:
      seed: ``None`` draws a secret seed per rank from the operating system's entropy (as
        ``create_state(seed=None)``); an int or ``uint32`` words make them reproducible:
        rank 0 gets ``seed`` itself (so a mesh of one equals ``create_state(seed=seed)``) and
        rank ``r > 0`` a SHA-256 derivation of ``(seed, r)``, so ranks never share keys.
      n_ranks: the rank count.

    Raises:
      TypeError/ValueError: a bad ``seed`` (as ``create_state``) or ``n_ranks``.
    """
    from flatkv_jax.coordinator import state as state_mod  # its new_seed (tests patch it)
    from flatkv_jax.prefix.keys import seed_words

    if not is_int(n_ranks) or n_ranks < 1:
        fail("n_ranks", n_ranks, "it must be a positive int", "pass the number of ranks")
    if seed is None:
        return [np.asarray(state_mod.new_seed(), np.uint32) for _ in range(n_ranks)]
    base = seed_words(seed)
    out = [base]
    for r in range(1, n_ranks):
        digest = hashlib.sha256(b"flatkv-rank-seed" + base.tobytes() + r.to_bytes(8, "little"))
        out.append(np.frombuffer(digest.digest()[: base.nbytes], np.uint32).copy())
    return out
