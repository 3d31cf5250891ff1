"""Steps built from a task: the reference, the simulation, data parallel, FSDP and gradient accumulation.

Every step updates ``model`` and ``optimizer`` in place and returns the pre-update loss (or a
:class:`StepResult`); :data:`STRATEGIES` is the one registry of them.
"""

from shardcheck.steps._core import Candidate as Candidate
from shardcheck.steps._core import StepResult as StepResult
from shardcheck.steps.registry import CANDIDATES as CANDIDATES
from shardcheck.steps.registry import STRATEGIES as STRATEGIES
from shardcheck.steps.registry import Strategy as Strategy
from shardcheck.steps.registry import get_strategy as get_strategy
from shardcheck.steps.registry import mesh_for as mesh_for
