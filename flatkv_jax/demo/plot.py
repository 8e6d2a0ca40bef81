"""The ``--plot`` figure: pool occupancy per group, prefix hit rate and tokens per step.

matplotlib is an optional extra (``pip install ".[plot]"``); :func:`require_matplotlib` checks
for it before the demo runs, so a missing extra fails in a second rather than after the run.
"""

from __future__ import annotations

import numpy as np

from flatkv_jax.demo.report import StepSeries

INSTALL_HINT = 'pip install ".[plot]"  (or: pip install matplotlib)'


class MissingExtraError(ImportError):
    """An optional extra the requested feature needs is not installed."""


def require_matplotlib():
    """Imports matplotlib with the non-interactive Agg backend, or raises.

    Returns:
      ``matplotlib.pyplot``.

    Raises:
      MissingExtraError: matplotlib is not installed; the message names the install command.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MissingExtraError(
            f"--plot needs matplotlib, which is not installed ({e}). Fix: {INSTALL_HINT}."
        ) from e
    return plt


def check_plot_path(path: str, plt) -> None:
    """Checks before the run that ``--plot`` can be written: a format matplotlib knows (from
    the suffix) and an existing, writable folder.

    Raises:
      ValueError: naming the path, the rule and the fix.
    """
    import os
    import pathlib

    target = pathlib.Path(path)
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    suffix = target.suffix.lower().lstrip(".")
    if suffix not in formats:
        raise ValueError(
            f"--plot {path} is invalid: the figure's format comes from the suffix, one of "
            f"{', '.join('.' + f for f in sorted(formats))}. Fix: pass e.g. --plot demo.png."
        )
    folder = target.parent if str(target.parent) else pathlib.Path(".")
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ValueError(
            f"--plot {path} is invalid: its folder {str(folder)!r} does not exist or cannot "
            "be written. Fix: create the folder, or pass a path in a writable one."
        )


def plot_series(series: StepSeries, path: str, *, title: str = "flatkv demo") -> None:
    """Writes the three-panel figure to ``path`` (format from the suffix, e.g. ``.png``).

    Panels: pages in use per pool as a fraction of its usable pages; the prefix hit rate
    (cumulative over the run, and per step where the step admitted requests); prefill and
    decode tokens per step.
    """
    plt = require_matplotlib()
    steps = np.arange(len(series.in_use))
    fig, axes = plt.subplots(3, 1, figsize=(9, 8.5), sharex=True, constrained_layout=True)
    fig.suptitle(title)

    ax = axes[0]
    in_use = np.asarray(series.in_use, float).reshape(len(steps), len(series.group_names))
    for gi, name in enumerate(series.group_names):
        ax.plot(steps, in_use[:, gi] / max(series.usable[gi], 1), label=name, lw=1.2)
    ax.set_ylabel("pages in use / usable")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    ax.grid(alpha=0.3)

    ax = axes[1]
    prompt = np.asarray(series.prompt_tokens, float)
    hit = np.asarray(series.hit_tokens, float)
    cum = np.divide(
        np.cumsum(hit), np.cumsum(prompt), out=np.zeros_like(prompt), where=np.cumsum(prompt) > 0
    )
    admitted = prompt > 0
    ax.scatter(
        steps[admitted],
        hit[admitted] / prompt[admitted],
        s=8,
        alpha=0.5,
        label="step (its admissions)",
    )
    ax.plot(steps, cum, color="black", lw=1.5, label="cumulative")
    ax.set_ylabel("prefix hit rate")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)

    ax = axes[2]
    pre = np.asarray(series.prefill_tokens, float)
    dec = np.asarray(series.decode_tokens, float)
    ax.bar(steps, pre, width=1.0, label="prefill", color="tab:blue")
    ax.bar(steps, dec, width=1.0, bottom=pre, label="decode + verify", color="tab:orange")
    ax.set_ylabel("tokens per step")
    ax.set_xlabel("engine step")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)

    fig.savefig(path, dpi=110)
    plt.close(fig)
