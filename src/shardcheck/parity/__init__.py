"""Parity: prove a task's sharded step against its single-device step, leaf by leaf, over many steps.

:func:`check_parity` (``harness``) runs both sides; ``compare`` holds the leaf comparisons, ``tolerance`` the
derived rule, ``diagnosis`` the rules that name a failure's cause, ``report`` the result objects.
"""

from shardcheck.parity.candidates import strategy_candidate as strategy_candidate
from shardcheck.parity.compare import flatten_state as flatten_state
from shardcheck.parity.compare import replica_mismatch as replica_mismatch
from shardcheck.parity.compare import to_host as to_host
from shardcheck.parity.diagnosis import KINDS as KINDS
from shardcheck.parity.diagnosis import Diagnosis as Diagnosis
from shardcheck.parity.diagnosis import LeafError as LeafError
from shardcheck.parity.diagnosis import StepRecord as StepRecord
from shardcheck.parity.diagnosis import diagnose as diagnose
from shardcheck.parity.harness import assert_step_parity as assert_step_parity
from shardcheck.parity.harness import check_parity as check_parity
from shardcheck.parity.harness import minibatches as minibatches
from shardcheck.parity.report import CandidateError as CandidateError
from shardcheck.parity.report import ParityError as ParityError
from shardcheck.parity.report import ParityReport as ParityReport
from shardcheck.parity.tolerance import MOMENT_FACTOR as MOMENT_FACTOR
from shardcheck.parity.tolerance import Tolerance as Tolerance
from shardcheck.parity.tolerance import derive_tolerance as derive_tolerance
from shardcheck.steps import Candidate as Candidate
