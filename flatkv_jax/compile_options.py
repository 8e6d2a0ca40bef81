"""XLA compiler options for programs made of coordinator operations.

On XLA:CPU, the compiler's ``cpu-parallel-task-assigner`` pass splits a loop fusion, a
scatter or a reduce-window across the intra-op threads when its cost model's estimate crosses
a threshold: an I/O-bound fusion past ~512 KB of bytes accessed, or a compute-bound one past
~200,000 (flops + 10 x bytes). The estimate counts whole operands, so a fusion that gathers
256 words out of a request FIFO of 8 MB, or hashes a batch's 256 tokens with a few dozen
integer operations each, counts as large; each split then costs a hand-off to another thread
and back (~5-15 us measured in a profile) for about a microsecond of work. A coordinator step
is hundreds of such small thunks (a B = 256 decode step with prefix reuse: ~380, of which ~80
were split), so disabling the pass makes the decode step x0.96 on the
``benchmarks/vs_vllm.py`` trace (admission within the noise; 2-vCPU machine,
``docs/benchmarks.md``). Other backends have no pass of that name and ignore the option.

Pass :data:`COORDINATOR_COMPILER_OPTIONS` as ``jax.jit(..., compiler_options=...)`` for a
jitted step that is mostly coordinator work (the library's own jitted operations do). A step
dominated by large arrays (a model forward on CPU) may want the split: leave it out there.

Example::

    step = jax.jit(my_step, donate_argnums=0, compiler_options=COORDINATOR_COMPILER_OPTIONS)
"""

from __future__ import annotations

import types

#: XLA pass names this library disables for coordinator programs (see the module docstring).
DISABLED_PASSES = ("cpu-parallel-task-assigner",)

#: ``compiler_options`` for ``jax.jit`` / ``Lowered.compile`` of coordinator programs (a
#: read-only mapping; ``dict(COORDINATOR_COMPILER_OPTIONS)`` to extend it).
COORDINATOR_COMPILER_OPTIONS = types.MappingProxyType(
    {"xla_disable_hlo_passes": ",".join(DISABLED_PASSES)}
)
