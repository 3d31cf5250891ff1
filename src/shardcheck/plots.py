"""Figures of a :class:`~shardcheck.seeds.training.TrainReport`, drawn with matplotlib's Agg renderer (no display)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from shardcheck._io import write_atomic

# Drift values are drawn no lower than this on the log axis: an exact 0 (bitwise-equal parameters) has no
# logarithm. float32 parameters of order 1 cannot differ by less than ~1e-8 unless they are equal.
DRIFT_FLOOR = 1e-10
# Figure size in inches and resolution: 1300 x 500 pixels.
FIGSIZE_IN = (13.0, 5.0)
DPI = 100


def plot_training(report, path, *, dpi: int = DPI) -> Path:
    """Write a two-panel PNG of a lock-step training run; the file appears whole or not at all.

    Left: loss against step; the per-step mini-batch losses of the baseline (solid) and the sharded
    run (dashed), and the full-split train and test losses after each epoch (markers; step 0 is the
    initialization). Right: the parameter drift ``max|params_sharded - params_baseline|`` per step on a log axis
    (values below ``DRIFT_FLOOR`` drawn at the floor, as the axis label says), with the tolerance of each step and
    the first step that exceeded it, if any. The title names data set, strategy, S, model and optimizer.

    Args:
        report: a :class:`~shardcheck.seeds.training.TrainReport`.
        path: the ``.png`` file to write; missing parent folders are created. The image is rendered in memory,
            written to a temporary file in the same folder and renamed over ``path``.
        dpi: dots per inch; the image is ``13 x 5`` inches, 1300 x 500 pixels at the default 100.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError: ``path`` does not end in ``.png`` or the report has no steps.
        OSError: the folder cannot be written.
    """
    from matplotlib.figure import Figure

    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"plot_training: path {str(path)!r} must end in .png; pass e.g. 'loss.png'")
    if not report.steps:
        raise ValueError("plot_training: the report has no steps to plot; train for at least one step")

    steps = np.array([s.step for s in report.steps])
    fig = Figure(figsize=FIGSIZE_IN, dpi=dpi, layout="constrained")
    ax_loss, ax_drift = fig.subplots(1, 2)
    xlabel = f"step ({report.steps_per_epoch} mini-batch updates per epoch; 0 = initialization)"
    _loss_panel(ax_loss, report, steps, xlabel)
    _drift_panel(ax_drift, report, steps, xlabel)

    lr = f"lr={report.lr:g}"
    fig.suptitle(
        f"shardcheck train: {report.dataset}, {report.model}, {report.strategy} S={report.num_shards} vs "
        f"single-device baseline, {report.optimizer} {lr}, B={report.batch_size}, {report.epochs} epochs"
    )
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    write_atomic(path, buf.getvalue())
    return path


def _loss_panel(ax, report, steps, xlabel: str) -> None:
    """Left: both runs' batch losses per step, and the train and test losses at each epoch's end."""
    s_label = f"{report.strategy} (S={report.num_shards})"
    ax.plot(
        steps, [s.loss_baseline for s in report.steps], color="0.55", lw=1.2, label="batch loss, baseline"
    )
    ax.plot(
        steps,
        [s.loss_sharded for s in report.steps],
        color="0.2",
        lw=1.0,
        ls="--",
        label=f"batch loss, {s_label}",
    )
    ep_steps = [r.step for r in report.epoch_records]
    series = (
        ("train_loss_baseline", "tab:blue", "o", "-", "train loss, baseline"),
        ("train_loss_sharded", "tab:cyan", "x", "--", f"train loss, {s_label}"),
        ("test_loss_baseline", "tab:red", "s", "-", "test loss, baseline"),
        ("test_loss_sharded", "tab:orange", "+", "--", f"test loss, {s_label}"),
    )
    for field, color, marker, ls, label in series:
        ax.plot(
            ep_steps, [getattr(r, field) for r in report.epoch_records], color=color, marker=marker, ls=ls, ms=5,
            label=label,
        )  # fmt: skip
    ax.set_xlabel(xlabel)
    ax.set_ylabel("MSE loss (standardized targets)")
    ax.set_title("Loss: baseline vs sharded (curves should overlap)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")


def _drift_panel(ax, report, steps, xlabel: str) -> None:
    """Right: the parameter drift per step on a log axis, its tolerance, and the first step beyond it."""
    drift = np.array([s.held_param_diff for s in report.steps])  # of the elements held to the tolerance
    zeros = int(np.sum(drift < DRIFT_FLOOR))
    ax.plot(steps, np.maximum(drift, DRIFT_FLOOR), color="tab:purple", lw=1.2, label="max |Δparam|")
    ax.plot(
        steps, [s.drift_tolerance for s in report.steps], color="tab:green", ls=":", lw=1.5, label="tolerance"
    )
    first = report.first_exceeded_step
    if first is not None:
        ax.axvline(first, color="tab:red", lw=1.0, label=f"first exceeded: step {first}")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(
        f"max |params_sharded - params_baseline|\n(log scale; values < {DRIFT_FLOOR:g} drawn at it)"
    )
    note = f", {zeros} step(s) exactly 0" if zeros else ""
    ax.set_title(f"Parameter drift per step (max {max(drift):.3g}{note})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
