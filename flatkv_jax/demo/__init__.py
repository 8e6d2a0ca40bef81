"""``flatkv demo``: the serving engine on the tiny V4 model and a built-in agentic workload.

- workload: :class:`WorkloadConfig`, :func:`make_workload` (tenants, shared system prompts,
  multi-turn sessions whose next prompt extends the last answer; deterministic from a seed)
- runner: :class:`DemoOptions`, :func:`run_demo`, :class:`WorkloadDriver`
- replay: :func:`replay_ops` (the engine's coordinator operations on the radix oracle)
- report: :class:`DemoReport`, :func:`format_report`; plot: :func:`plot_series`

See docs/serving.md ("flatkv demo").
"""

from flatkv_jax.demo.replay import ReplayResult, replay_ops
from flatkv_jax.demo.report import DemoReport, StepSeries, format_report
from flatkv_jax.demo.runner import DemoOptions, WorkloadDriver, run_demo
from flatkv_jax.demo.workload import Session, Turn, Workload, WorkloadConfig, make_workload

__all__ = [
    "DemoOptions",
    "DemoReport",
    "ReplayResult",
    "Session",
    "StepSeries",
    "Turn",
    "Workload",
    "WorkloadConfig",
    "WorkloadDriver",
    "format_report",
    "make_workload",
    "replay_ops",
    "run_demo",
]
