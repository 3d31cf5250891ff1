"""Parity: prove a task's sharded step against its single-device step, leaf by leaf, over many steps.

:func:`check_parity` (``harness``) runs both sides; ``compare`` holds the leaf comparisons, ``tolerance`` the
derived rule, ``diagnosis`` the rules that name a failure's cause, ``report`` the result objects.
``check_parity`` and ``assert_step_parity`` here also take the seeds' ``(model, optimizer, batches)`` form: they
are the seeds' adapter over the engine's (:mod:`shardcheck.seeds.parity`), imported on first use.
"""

from typing import TYPE_CHECKING

from shardcheck.parity.candidates import strategy_candidate as strategy_candidate
from shardcheck.parity.compare import flatten_state as flatten_state
from shardcheck.parity.compare import replica_mismatch as replica_mismatch
from shardcheck.parity.compare import to_host as to_host
from shardcheck.parity.diagnosis import KINDS as KINDS
from shardcheck.parity.diagnosis import Diagnosis as Diagnosis
from shardcheck.parity.diagnosis import LeafError as LeafError
from shardcheck.parity.diagnosis import StepRecord as StepRecord
from shardcheck.parity.diagnosis import diagnose as diagnose
from shardcheck.parity.harness import minibatches as minibatches
from shardcheck.parity.reference_trajectory import shared_reference as shared_reference
from shardcheck.parity.report import CandidateError as CandidateError
from shardcheck.parity.report import ParityError as ParityError
from shardcheck.parity.report import ParityReport as ParityReport
from shardcheck.parity.tolerance import MOMENT_FACTOR as MOMENT_FACTOR
from shardcheck.parity.tolerance import Tolerance as Tolerance
from shardcheck.parity.tolerance import derive_tolerance as derive_tolerance
from shardcheck.steps import Candidate as Candidate

if TYPE_CHECKING:
    from shardcheck.seeds.parity import assert_step_parity as assert_step_parity
    from shardcheck.seeds.parity import check_parity as check_parity

_ADAPTED = ("assert_step_parity", "check_parity")


def __getattr__(name: str):
    # the adapter imports this package (its engine): it is imported on first use, not with the package
    if name not in _ADAPTED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from shardcheck.seeds import parity as adapter

    value = getattr(adapter, name)
    globals()[name] = value
    return value
