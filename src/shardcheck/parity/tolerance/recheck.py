"""A FAIL within a few tolerances on an accelerator, checked again with both sides' matmuls at ``"highest"``.

On a GPU or TPU a float32 matmul rounds its operands (TF32, a bfloat16 pass: ``shardcheck.parity.tolerance.matmul``); a
check whose worst leaf is just past its tolerance may be that rounding, not a bug. JAX's advice for telling the two
apart is to run at ``"highest"`` (float32) precision, as projects comparing sharded runs pin it: the check is run
again under ``jax.default_matmul_precision("highest")`` with the float32 policy, and the report says whether the
failure survives (``ParityReport.precision_recheck``). On a CPU, which computes float32 whatever is asked, it is
never needed.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from shardcheck.parity.tolerance.matmul import _platform_family, platforms_of

RECHECK_WITHIN = 8.0
"""A FAIL whose worst leaf is at most this many times its tolerance is re-checked (a bug's error is usually far
larger: a factor S, a missing reduction)."""

HIGHEST = ("highest", "float32")


def wanted(report, platforms, setting=None) -> bool:
    """Whether ``report`` (a :class:`~shardcheck.ParityReport`) is re-checked at ``"highest"``: a FAIL (not a
    ``CANNOT VERIFY`` or ``NO VERDICT``) whose worst leaf is within :data:`RECHECK_WITHIN` tolerances, from a check
    with a side on an accelerator (``platforms``: ``{(platform, compute capability)}``), not already run at
    ``"highest"`` (``setting``: ``jax_default_matmul_precision``, read from the config when ``None``)."""
    setting = jax.config.jax_default_matmul_precision if setting is None else setting
    if report.step_ok or report.cannot_verify is not None or report.reference_diverged_at is not None:
        return False
    if str(setting).lower() in HIGHEST or all(_platform_family(p) == "cpu" for p, _ in platforms):
        return False
    worst = report.worst
    return worst is not None and math.isfinite(worst.badness) and worst.badness <= RECHECK_WITHIN


def outcome(again) -> str:
    """The report's sentence from the check run again at ``"highest"`` (``again``, its report)."""
    if again.step_ok:
        return (
            f"precision explains it: with both sides' matmuls at 'highest' (float32) the check gives "
            f"{again.verdict}; the FAIL is the matmul rounding, not a bug (pass matmul_precision= or verify "
            "--matmul-precision with the precision the steps use, or pin jax.default_matmul_precision('highest'))"
        )
    worst = again.worst
    where = "" if worst is None else f" (worst {worst.name} at {worst.badness:.3g} x its tolerance)"
    return (
        f"precision does not explain it: with both sides' matmuls at 'highest' (float32) the check gives "
        f"{again.verdict}{where}"
    )


def setting() -> str | None:
    """``jax_default_matmul_precision`` now (``None``: unset)."""
    return jax.config.jax_default_matmul_precision


def at_highest(report, devices, call: dict):
    """``report``, with :attr:`~shardcheck.ParityReport.precision_recheck` set where :func:`wanted` (``devices``:
    those the check's sides ran on): ``check_parity(**call)`` is run again with ``matmul_precision="float32"``
    under ``jax.default_matmul_precision("highest")``."""
    if not wanted(report, platforms_of(devices)):
        return report
    from shardcheck.parity.harness.check import check_parity  # the harness imports this module

    with jax.default_matmul_precision("highest"):
        again = check_parity(**{**call, "matmul_precision": "float32"})
    return dataclasses.replace(report, precision_recheck=outcome(again))
