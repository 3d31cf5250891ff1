"""What the registries offer, by name, importable without JAX: the strategies and the named optimizers.

:mod:`shardcheck.steps.registry` builds :data:`shardcheck.steps.STRATEGIES` from :data:`STRATEGY_SPECS`, adding
each strategy's step builder; the command line builds its parsers (choices, ``--help``) from this module, so
``shardcheck verify --help`` imports no JAX and starts no backend.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StrategySpec:
    """What a strategy is, without its step.

    Attributes:
        name: the registry key (``reference``, ``simulation``, ``dp``, ``fsdp``, ``gspmd``, ``accumulation``,
            ``multiprocess``).
        summary: one line for ``--help`` and reports.
        placement: where parameters and optimizer state live: ``"single"`` (one device), ``"replicated"``
            (every device of the mesh) or ``"fsdp"`` (split by the model's annotations, else over the FSDP
            axis: :func:`shardcheck.steps.sharded.state_specs`).
        uses_mesh: the step runs on a device mesh of ``num_shards`` batch shards (its devices, unless the mesh has
            model axes: :func:`shardcheck.mesh.data_shards`).
        wraps_optimizer: the step steps an optimizer of its own around the task's transformation
            (``optax.MultiSteps``), not the one it is given.
        explicit_collectives: a mesh step whose gradients are gathered and reduced by shardcheck's own
            collectives inside one ``jax.shard_map`` (``dp``, ``fsdp``, ``multiprocess``); False for ``gspmd``
            (the plain step, partitioned by XLA) and the single-device strategies.
    """

    name: str
    summary: str
    placement: str
    uses_mesh: bool
    wraps_optimizer: bool = dataclasses.field(default=False, kw_only=True)
    explicit_collectives: bool = dataclasses.field(default=False, kw_only=True)


PLACEMENT_WORDS = {
    "single": "one device",
    "replicated": "replicated",
    "fsdp": "split by the model's annotations, else over the fsdp axis",
}
"""A strategy's ``placement`` (:attr:`StrategySpec.placement`) in the summary's words (trial 53:
``train --strategy gspmd`` read "state placement: fsdp")."""

REFERENCE = "reference"
"""The registry's baseline: every other strategy is compared with its step."""

BASELINE = "baseline"
"""The name ``shardcheck run``'s seed form reports the reference under (seed 001's baseline)."""

STRATEGY_SPECS: dict[str, StrategySpec] = {
    s.name: s
    for s in (
        StrategySpec(REFERENCE, "the task's single-device step (the baseline)", "single", False),
        StrategySpec(
            "simulation",
            "S equal shards on one device, gradients summed then divided once (seed 000)",
            "single",
            False,
        ),
        StrategySpec(
            "dp",
            "data parallel: batch split over the data axes, state replicated, one psum per leaf",
            "replicated",
            True,
            explicit_collectives=True,
        ),
        StrategySpec(
            "fsdp",
            "fully sharded: state split by its annotations or over the fsdp axis, all-gather and reduce-scatter",
            "fsdp",
            True,
            explicit_collectives=True,
        ),
        StrategySpec(
            "gspmd",
            "the plain step under jax.jit, state placed from the model's annotations, XLA's collectives",
            "fsdp",
            True,
        ),
        StrategySpec(
            "accumulation",
            "gradient accumulation over S micro-batches with optax.MultiSteps",
            "single",
            False,
            wraps_optimizer=True,
        ),
        StrategySpec(
            "multiprocess",
            "data parallel on a mesh spanning every process of a launched run",
            "replicated",
            True,
            explicit_collectives=True,
        ),
    )
}
"""Every registered strategy's spec, in registry order."""

COMPARED = tuple(name for name in STRATEGY_SPECS if name != REFERENCE)
"""Every strategy but the reference: those compared with it (``verify --strategies``, ``train --strategy``)."""

CANDIDATES = tuple(name for name in COMPARED if name != "multiprocess")
"""The strategies compared with the reference by default (``multiprocess`` needs a launched run)."""

DEFAULT_STRATEGY = "fsdp"
"""The strategy trained or sized when none is chosen (``train --strategy``, :func:`shardcheck.train`,
``memory --mesh`` without ``--strategy``): fully sharded, every state category split."""


def xla_partitioned() -> tuple[str, ...]:
    """The mesh strategies whose step is the plain step under ``jax.jit`` on placed state, XLA inserting the
    collectives (no ``explicit_collectives``): ``("gspmd",)``.

    None of them is a memory layout (:data:`shardcheck.partitioning.LAYOUTS`: one per placement, run by its first
    registered strategy); ``shardcheck memory`` sizes them with ``--mesh`` only, by compiling their own step ahead
    of time on that mesh.
    """
    return tuple(n for n, s in STRATEGY_SPECS.items() if s.uses_mesh and not s.explicit_collectives)


OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
"""The optimizers built by name (:func:`shardcheck.optimizers.make_tx`)."""

SCHEDULES = ("constant", "cosine")

TINY_LM_SIZES = ("tiny", "small", "125m", "350m", "1b")
"""The named sizes of the tiny-lm task (:mod:`shardcheck.tasks.sizes`, whose table gives their shapes): the
command line's ``--size`` choices."""
"""The learning-rate schedules built by name (:func:`shardcheck.optimizers.make_tx`, ``--schedule``)."""


def seed_form() -> tuple[str, ...]:
    """The computations of ``shardcheck run`` without ``--task`` (seeds 000 and 001), in registry order.

    The single-device strategies that step the optimizer they are given, and the first mesh strategy of each
    placement: ``("baseline", "simulation", "dp", "fsdp")``, the reference named ``baseline`` (seed 001's name).
    """
    first: dict[str, str] = {}
    for name, spec in STRATEGY_SPECS.items():
        first.setdefault(spec.placement, name)
    names = []
    for name, spec in STRATEGY_SPECS.items():
        if first[spec.placement] == name if spec.uses_mesh else not spec.wraps_optimizer:
            names.append(BASELINE if name == REFERENCE else name)
    return tuple(names)


# ------------------------------------------------------------------------------------------- subcommands

SUMMARIES = {
    "run": "one SGD step of each computation on a real data set, compared with the baseline",
    "launch": "run a subcommand as P local processes x N CPU devices over JAX's distributed runtime",
    "train": "train a sharded strategy beside the single-device baseline on real data and watch them drift",
    "memory": "bytes per device of params, grads and optimizer state under each strategy (estimate, measured)",
    "verify": "prove each sharded step against the single-device baseline, leaf by leaf, over many steps",
    "record": "save a run's per-step, per-leaf digests (small enough to commit) for verify --against to replay",
}
"""Each ``shardcheck`` subcommand's one line in ``shardcheck --help``. It lives here, without JAX, so that the
top-level help loads no subcommand module (they import JAX) and :mod:`shardcheck.launcher` tells a subcommand from
a command without importing the command line; the modules' own ``add_parser`` help must say the same
(tests/test_cli_cache.py checks)."""
SUBCOMMANDS = tuple(SUMMARIES)
