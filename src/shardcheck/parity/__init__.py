"""Parity: prove a task's sharded step against its single-device step, leaf by leaf, over many steps.

:func:`check_parity` (``harness``) runs both sides; ``compare`` holds the leaf comparisons, ``tolerance`` the
derived rule, ``diagnosis`` the rules that name a failure's cause, ``report`` the result objects.
``shardcheck.check_parity`` and ``shardcheck.assert_step_parity`` (the seeds' adapter over the engine's,
:mod:`shardcheck.seeds.parity`, which also takes the ``(model, optimizer, batches)`` form) are imported from
``shardcheck``; their old paths here are deprecated (:mod:`shardcheck._deprecations`).
"""

from shardcheck import _deprecations
from shardcheck.parity.comparison.live import flatten_state as flatten_state
from shardcheck.parity.comparison.live import replica_mismatch as replica_mismatch
from shardcheck.parity.comparison.live import to_host as to_host
from shardcheck.parity.diagnosis.evidence import KINDS as KINDS
from shardcheck.parity.diagnosis.evidence import Diagnosis as Diagnosis
from shardcheck.parity.diagnosis.evidence import LeafError as LeafError
from shardcheck.parity.diagnosis.evidence import StepRecord as StepRecord
from shardcheck.parity.diagnosis.rules import diagnose as diagnose
from shardcheck.parity.harness.candidates import strategy_candidate as strategy_candidate
from shardcheck.parity.harness.check import minibatches as minibatches
from shardcheck.parity.harness.reference_trajectory import shared_reference as shared_reference
from shardcheck.parity.report import CandidateError as CandidateError
from shardcheck.parity.report import ParityError as ParityError
from shardcheck.parity.report import ParityReport as ParityReport
from shardcheck.parity.tolerance.derive import MOMENT_FACTOR as MOMENT_FACTOR
from shardcheck.parity.tolerance.derive import Tolerance as Tolerance
from shardcheck.parity.tolerance.derive import derive_tolerance as derive_tolerance
from shardcheck.steps import Candidate as Candidate

# ``check_parity`` and ``assert_step_parity`` are ``shardcheck.check_parity`` / ``shardcheck.assert_step_parity``;
# their old paths here resolve through the one deprecation table, with a ``DeprecationWarning``.
__getattr__ = _deprecations.module_getattr(__name__)
