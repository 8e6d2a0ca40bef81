"""Batched inputs of the coordinator operations: fixed-size arrays with a validity mask.

Every batch is a pytree of ``[B]`` arrays (``B`` is the batch size, any static size; the host
helpers in :mod:`flatkv_jax.coordinator.host` pad to ``max_requests``). Rows with
``valid == False`` are ignored and report ``Status.IDLE``. A handle is ``(slot, generation)``
as returned by ``admit``; a request slot may appear at most once per batch (later rows naming
the same slot report ``BAD_ARG``).
"""

from __future__ import annotations

import dataclasses
import enum

import jax


class ReleaseMode(enum.IntEnum):
    """How ``release`` ends a request (docs/semantics.md)."""

    #: The request finished: publish its complete committed blocks, then free.
    FINISH = 0
    #: Drop everything: free, publish nothing (nor do its in-flight steps).
    ABORT = 1
    #: Preempt: like FINISH for the cache, so a readmission can hit its own prefix.
    RETRACT = 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdmitBatch:
    """New requests.

    Attributes:
      valid: ``bool[B]``.
      prompt_len: ``int32[B]``, prompt tokens (>= 1, <= max_context).
      first_chunk: ``int32[B]``, prompt tokens this admit allocates and schedules as its first
        step (0 <= first_chunk <= prompt_len, <= the op's ``max_count``). With a prefix hit
        ``h`` the chunk is clipped to ``prompt_len - h``.
      tokens: ``int32[B, L]`` or None: the prompts, padded (any static ``L``). With tokens the
        admit matches the prefix index and the request publishes its committed blocks; without
        (None) the hit is 0 and the request never publishes.
      namespace: ``int32[B]`` or None (= 0): the namespace's low word; requests in different
        namespaces never share a block.
    """

    valid: jax.Array
    prompt_len: jax.Array
    first_chunk: jax.Array
    tokens: jax.Array | None = None
    namespace: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExtendBatch:
    """Next-step tokens of running requests.

    Attributes:
      valid: ``bool[B]``.
      slot, generation: ``int32[B]``, the handle.
      count: ``int32[B]``, new tokens (1 <= count <= the op's ``max_count``): 1 for decode,
        ``1 + verify_width`` for a speculative verify step, a chunk for chunked prefill.
      tokens: ``int32[B, T]`` or None: the step's token ids (positions ``[n, n + count)``;
        columns past ``count`` ignored; any static ``T``). They are kept with the in-flight
        step and published when it retires. None: the request stops publishing.
    """

    valid: jax.Array
    slot: jax.Array
    generation: jax.Array
    count: jax.Array
    tokens: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RetireBatch:
    """Results of the oldest in-flight step of requests.

    Attributes:
      valid: ``bool[B]``.
      slot, generation: ``int32[B]``, the handle the step was issued with.
      accepted: ``int32[B]``, tokens of the step that were accepted (0 <= accepted <= count).
    """

    valid: jax.Array
    slot: jax.Array
    generation: jax.Array
    accepted: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RewindBatch:
    """Explicit rewinds.

    Attributes:
      valid: ``bool[B]``.
      slot, generation: ``int32[B]``.
      extent: ``int32[B]``, the new extent (committed <= extent <= current extent).
    """

    valid: jax.Array
    slot: jax.Array
    generation: jax.Array
    extent: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HandleBatch:
    """Handles only (``reclaim``).

    Attributes:
      valid: ``bool[B]``.
      slot, generation: ``int32[B]``.
    """

    valid: jax.Array
    slot: jax.Array
    generation: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ReleaseBatch:
    """Finishing, aborted or preempted requests.

    Attributes:
      valid: ``bool[B]``.
      slot, generation: ``int32[B]``.
      mode: ``int32[B]``, a :class:`ReleaseMode`.
    """

    valid: jax.Array
    slot: jax.Array
    generation: jax.Array
    mode: jax.Array
