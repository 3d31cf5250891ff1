"""What a parity run admits, checked before any step runs, and the run built from it.

:func:`check_options` (tolerances, ``accept_weak``, the mesh, the shard count), the model (the admission rule
of the Task, :func:`shardcheck.task.check_model`, C7), the task's batches, the reference and the candidate; :func:`_setup` builds the
:class:`~shardcheck.parity.harness.state._Run` from copies of the initial state: nothing of the caller's changes.
"""

from __future__ import annotations

import itertools
import math
import weakref

import jax
import jax.numpy as jnp
from flax import nnx

from shardcheck import _validate
from shardcheck._catalog import REFERENCE
from shardcheck._tree import copy_state
from shardcheck.mesh import check_mesh, data_shards
from shardcheck.parity.comparison.rng_counts import all_streams
from shardcheck.parity.harness.candidates import as_candidate, check_step_signature
from shardcheck.parity.harness.row_coupling import check_rows_separable, coupled_rows, float32_model
from shardcheck.parity.harness.state import _Run
from shardcheck.parity.tolerance import matmul
from shardcheck.parity.tolerance.allowances import _noise_shards
from shardcheck.parity.tolerance.overrides import _check_leaf_tolerance, _leaf_names
from shardcheck.parity.tolerance.precision import Precision, float32_compute, traced_compute_dtype
from shardcheck.steps import STRATEGIES, Candidate
from shardcheck.steps.registry import mesh_for
from shardcheck.steps.sharded import mesh_step, state_specs
from shardcheck.steps.sharded_init import sharded_training_state
from shardcheck.task import (
    Task,
    check_divisible,
    check_model,
    draws_refusal,
    initial_states,
    written_batch_stats,
)


def _check_tolerances(fn, rtol, atol):
    for label, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf
        ):
            raise ValueError(f"{fn}: {label} must be a number >= 0 and finite, got {value!r}")


def _task_batches(fn: str, task: Task, steps: int | None) -> list:
    if steps is None:
        return list(task.batches)
    steps = _validate.check_int(fn, "steps", steps)
    if steps > len(task.batches):
        raise ValueError(
            f"{fn}: steps={steps} but task {task.name!r} holds only {len(task.batches)} batch(es); pass steps="
            f"{len(task.batches)} or fewer, or give the task more batches"
        )
    return list(task.batches[:steps])


def check_options(fn: str, *, rtol, atol, accept_weak, mesh, num_shards) -> int | None:
    """The run's options checked in the order the errors are reported: ``rtol``/``atol``, ``accept_weak``, the
    mesh, the shard count; returns S (``num_shards``, or the mesh's batch shards when only a mesh is given)."""
    _check_tolerances(fn, rtol, atol)
    if not isinstance(accept_weak, bool):
        raise TypeError(f"{fn}: accept_weak must be True or False, got {accept_weak!r}")
    if mesh is not None:
        check_mesh(fn, mesh)
    if num_shards is None and mesh is not None:
        # the batch is split over the batch axes: S = mesh.size unless the mesh has model axes
        num_shards = data_shards(mesh)
    if num_shards is not None:
        num_shards = _validate.check_num_shards(fn, num_shards)
    if num_shards is not None and num_shards > 1 and mesh is not None:  # S=1: the callers' own messages
        _check_shards_fit_mesh(fn, num_shards, mesh)
    return num_shards


def _check_shards_fit_mesh(fn: str, num_shards: int, mesh) -> None:
    """S must be a multiple of the size of some of the mesh's axes together (the batch shards a step splits the
    batch into, times any micro-batches it accumulates): ``num_shards=3`` on a ``data=4`` mesh names no split of
    it, and the diagnosis would read its factors as 3's (trial 33: x4 read "summed over 'data' once too often").

    Raises:
        ValueError: no product of one or more axes of size > 1 divides ``num_shards`` (a mesh of one device takes
            any S).
    """
    sizes = [int(n) for n in mesh.shape.values() if int(n) > 1]
    products = {math.prod(c) for r in range(1, len(sizes) + 1) for c in itertools.combinations(sizes, r)}
    if not products or any(num_shards % p == 0 for p in products):
        return
    raise ValueError(
        f"{fn}: num_shards={num_shards} splits the batch over none of the mesh {dict(mesh.shape)}'s axes (S is "
        f"the batch shards, a product of axis sizes {sorted(products)}, times any micro-batches the step "
        f"accumulates); pass num_shards={data_shards(mesh)} (the mesh's batch shards), a multiple of it, or leave "
        "it out"
    )


def _setup(
    fn, candidate, task, *, steps, num_shards, mesh, reference, name, dtypes, leaf_tolerance, initial_state
):
    """Validate everything and build the run; nothing runs and nothing of the caller's changes."""
    ref_strategy, ref_mesh, ref_name = reference_strategy(fn, reference, task, num_shards, mesh)
    model, optimizer, data, copies = _initial(fn, task, reference, steps, initial_state, ref_mesh)
    cand = as_candidate(fn, candidate, task, num_shards, mesh, name)
    # the task's own initial model and first batch: probed once a task
    cached = initial_state is None and ref_strategy is None
    # the non-parameter state the forward pass writes (a counter), the RNG streams it draws from (a VAE's eps,
    # Dropout), and whether the loss is weighted
    updated, drawn, weighted = _admitted(fn, task, model, data[0], cached)
    _check_weights_accepted(fn, cand, data)
    _check_strategy(fn, candidate, cand, model, optimizer, mesh, data, weighted)
    _check_state_carried(fn, candidate, updated, drawn, model)
    if ref_strategy is not None:
        _check_strategy(fn, reference, ref_strategy, model, optimizer, ref_mesh, data, weighted)
        _check_state_carried(fn, reference, updated, drawn, model)
    (ref_model, ref_opt), (cand_model, cand_opt) = copies or [copy_state(model, optimizer) for _ in range(2)]
    if cand.make_optimizer is not None:
        cand_opt = cand.make_optimizer(cand_model, cand_opt)
        _check_view(fn, cand, optimizer, cand_opt)
    kwargs = {"mesh": mesh} if cand.pass_mesh else {}
    policy, precision = _precision(fn, task, model, data[0], mesh, dtypes, cached)
    # the model's structure is fixed over the run: its float32-compute graph is built once
    graphdef32 = float32_compute(*nnx.split(model, nnx.Param, ...)) if precision.compute_eps > 0 else None
    coupled = _rows_coupled(
        fn,
        (candidate, reference),
        (cand, ref_strategy),
        model,
        graphdef32,
        task,
        data[0],
        cached,
        precision.compute_eps,
    )
    # the leaf names only where there are overrides to check against them (two graph traversals, ~2 ms, #35)
    names = [] if leaf_tolerance is None else _leaf_names(model, optimizer)
    overrides = _check_leaf_tolerance(fn, leaf_tolerance, names)
    run = _Run(
        task,
        ref_model,
        ref_opt,
        None if isinstance(reference, str) else reference,
        cand,
        cand_model,
        cand_opt,
        kwargs,
        weighted,
        precision,
        overrides,
        graphdef32,
        ref_strategy=ref_strategy,
        reference_name=ref_name,
        matmul_source=policy[1],
        matmul_realization=policy[2] if precision.matmul_coarser else None,
        # the task's step and the registered strategies write their new state into the Variables in place
        in_place=isinstance(candidate, str) and (reference is None or isinstance(reference, str)),
        draws=tuple(drawn),
        batch_stats=written_batch_stats(model, updated),
        undrawn=tuple(s for s in all_streams(model) if s not in drawn),
        # at low-precision compute the tolerance measures a correct split's rounding on the loss run per shard:
        # no correct split where the loss couples the rows (trial 13: CLIP's local negatives made it 4x too wide)
        rows_coupled=coupled,
    )
    return run, data


def _precision(fn, task: Task, model, batch, mesh, dtypes: dict, cached: bool) -> tuple[tuple, Precision]:
    """The matmul policy (:func:`~shardcheck.parity.tolerance.matmul.resolve`'s triple) and the check's
    :class:`~shardcheck.parity.tolerance.precision.Precision`: the caller's ``dtypes`` overrides, else the
    model's layers and parameters and its loss's traced matmul operands (:func:`traced_compute_dtype`)."""
    dtypes = dict(dtypes)
    policy = matmul.resolve(fn, dtypes.pop("matmul_precision", None), task.loss_fn, model, batch, mesh)
    traced = _memo(task, ("traced",), cached, lambda: traced_compute_dtype(task.loss_fn, model, batch))
    return policy, Precision.of(model, fn=fn, matmul=policy[0], traced=traced, **dtypes)


def reference_strategy(fn, reference, task, num_shards, mesh) -> tuple[Candidate | None, object, str]:
    """The reference side of a run: ``(step, mesh, name)``.

    ``reference`` naming a registered mesh strategy (``gspmd``, ``dp``, ``fsdp``, ``multiprocess``): its step on
    the candidate's mesh, not donating its state (its state before a step is read after it), the mesh, and
    ``"gspmd on data=2,model=4"``. ``None`` or ``"reference"``: the task's single-device step ``(None, None,
    "reference")``; a callable: ``(None, None, "user reference")``.

    Raises:
        ValueError: an unknown name; a strategy that runs on one device or wraps the optimizer (``simulation``,
            ``accumulation``: check them as candidates); a mesh strategy without ``mesh`` or ``num_shards``.
    """
    if not isinstance(reference, str):
        return None, None, "reference" if reference is None else "user reference"
    if reference == REFERENCE:
        return None, None, REFERENCE
    usable = [n for n, s in STRATEGIES.items() if s.uses_mesh and not s.wraps_optimizer]
    if reference not in STRATEGIES:
        raise ValueError(
            f"{fn}: reference={reference!r} is unknown; use None (the task's single-device step), a mesh "
            f"strategy ({', '.join(usable)}), a step function, or a recording (a shardcheck.Recording, or the "
            "path of an .npz file `shardcheck record` wrote)"
        )
    strategy = STRATEGIES[reference]
    if reference not in usable:
        raise ValueError(
            f"{fn}: reference={reference!r} is not a strategy on a mesh; compare against the task's "
            f"single-device step (reference=None), a mesh strategy ({', '.join(usable)}) on the candidate's mesh, "
            f"or a step function; check {reference!r} as a candidate instead"
        )
    if num_shards is None:
        raise ValueError(
            f"{fn}: reference={reference!r} runs on the candidate's mesh; pass mesh= (or num_shards=)"
        )
    ref_mesh = mesh_for(fn, strategy, num_shards, mesh)

    def step(model, optimizer, batch):
        return mesh_step(
            reference, task.loss_fn, model, optimizer, batch, ref_mesh, with_grads=True, donate=False
        )

    shape = ",".join(f"{axis}={size}" for axis, size in ref_mesh.shape.items())
    return Candidate(reference, step, num_shards), ref_mesh, f"{reference} on {shape}"


def _initial(fn, task, reference, steps, initial_state, ref_mesh=None):
    """The run's initial ``(model, optimizer)`` (``initial_state``, else fresh from the task: created directly
    in the reference strategy's placement on ``ref_mesh`` when the reference is a mesh strategy,
    :func:`~shardcheck.steps.sharded_init.sharded_training_state`), its batches, after the task and the
    reference are checked, and, for the task's own fresh state on one device, the reference's and the
    candidate's copies of it (:func:`~shardcheck.task.initial_states`; else ``None``: the caller copies)."""
    if not isinstance(task, Task):
        raise TypeError(
            f"{fn}: task must be a shardcheck.Task (or, in the (model, optimizer, batches) form, an nnx.Module), got "
            f"{type(task).__name__}; build one with shardcheck.Task(model=..., optimizer=..., loss_fn=..., batches=...)"
        )
    if reference is not None and not isinstance(reference, str):
        check_reference(fn, reference)
        check_step_signature(fn, "reference", reference, 3, False)
    copies = None
    if initial_state is None and ref_mesh is not None:
        model, optimizer = sharded_training_state(fn, task, reference, ref_mesh)
    elif initial_state is None:
        (model, optimizer), *copies = initial_states(task, fn, 3)
    else:
        model, optimizer = initial_state
    return model, optimizer, _task_batches(fn, task, steps), copies


# The strategies that run the full-batch forward pass once a step (the single-device step, and GSPMD's jit of
# it): they write back what it writes to the model's non-parameter state, once, and draw the full batch's random
# numbers however the batch is split (jax_threefry_partitionable).
FULL_BATCH_FORWARD = ("reference", "gspmd")

# How each other strategy runs the forward pass, and what it draws there.
_PER_SHARD = {
    "simulation": ("runs the forward pass once per shard", "every shard drawing with the same key"),
    "accumulation": (
        "runs the forward pass once per micro-batch",
        "each micro-batch drawing numbers of its own for its rows",
    ),
}
_IN_SHARD_MAP = ("runs the forward pass per device in jax.shard_map", "every shard drawing with the same key")


def _check_state_carried(fn, candidate, updated: list[str], drawn: list[str] = (), model=None) -> None:
    """A named strategy that cannot run the forward pass as the single-device step does is refused, naming why:
    where the forward pass writes the model's state (``updated``; the single-device step writes it once per step:
    ``shardcheck.steps.reference``), or draws from its RNG streams (``drawn``; ``model`` is named)."""
    if not (updated or drawn) or not isinstance(candidate, str) or candidate in FULL_BATCH_FORWARD:
        return
    how, draws = _PER_SHARD.get(candidate, _IN_SHARD_MAP)
    # named by the strategy, not by check_parity: a limitation of this strategy, not bad input to the whole run
    if drawn:
        raise ValueError(draws_refusal(fn, type(model).__name__, drawn, candidate, f"{how}, {draws}"))
    if candidate not in _PER_SHARD:
        how += " and does not carry that state out"
    raise ValueError(
        f"{candidate}: cannot run this model: its forward pass writes non-parameter state ({', '.join(updated)}), "
        f"once a step in the single-device step, and {candidate} {how}{_batch_stats_clause(model)}; check it "
        f"with gspmd or your own step ({fn}, strategy {candidate!r})"
    )


_PER_TASK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per task, ``{key: value}`` of the setup's probes on its initial model and first batch (the row coupling at a
shard count, the loss's traced compute dtype): the same at every check of the task (tiny-lm's accumulation
probe took ~30 ms of a warm check's setup)."""


def _memo(task: Task, key: tuple, cached: bool, build):
    """``build()``, once per task and ``key`` where ``cached`` (the check runs on the task's own initial model)."""
    memo = _PER_TASK.setdefault(task, {}) if cached else {}
    if key not in memo:
        memo[key] = build()
    return memo[key]


def _admitted(fn, task: Task, model, batch, cached: bool) -> tuple[list[str], list[str], bool]:
    """``(updated, drawn, weighted)`` of :func:`~shardcheck.task.check_model` on ``model`` and ``batch`` (the
    non-parameter state the forward pass writes, the RNG streams it draws from, whether the loss is weighted),
    once per task where ``cached`` (the task's own initial model and first batch: its clone, the loss traced and
    run, the state read before and after took ~10 ms of a warm check's setup, issue #35). What it raises is raised
    at every check: a refusal is never kept."""

    def build():
        updated: list[str] = []
        drawn: list[str] = []
        weighted = check_model(fn, model, task.loss_fn, batch, updated=updated, drawn=drawn, batch_stats=True)
        return tuple(updated), tuple(drawn), weighted

    updated, drawn, weighted = _memo(task, ("admitted",), cached, build)
    return list(updated), list(drawn), weighted


def _coupled(task: Task, model, batch, s: int, compute_eps: float, in_float32: bool, cached: bool):
    """:func:`~shardcheck.parity.harness.row_coupling.coupled_rows` of the task's loss, once per task where
    ``cached`` (``model`` is the task's own initial model, or its float32 probe)."""
    terms = task.terms(batch)
    key = ("coupling", s, compute_eps, in_float32)
    return _memo(task, key, cached, lambda: coupled_rows(task.loss_fn, model, batch, s, compute_eps, terms))


def _probe_eps(task: Task, probe, batch, graphdef32, compute_eps: float, cached: bool) -> float:
    """The compute rounding of the row-coupling probe: 0 for the float32 probe (``graphdef32``), unless the
    model casts in its own code, which the probe keeps (the eps of the probe's traced matmul operands; trial 38:
    a loss refused as coupling the rows at float32's tolerance); ``compute_eps`` where no layer could be lifted
    to float32 (the probe is the model itself)."""
    if graphdef32 is None:
        return compute_eps
    own = _memo(task, ("traced probe",), cached, lambda: traced_compute_dtype(task.loss_fn, probe, batch))
    return 0.0 if own is None or own.itemsize >= 4 else float(jnp.finfo(own).eps)


def _rows_coupled(
    fn,
    strategies,
    built,
    model,
    graphdef32,
    task: Task,
    batch,
    cached: bool = False,
    compute_eps: float = 0.0,
) -> bool:
    """Whether the task's loss couples the rows of ``batch`` (:mod:`~shardcheck.parity.harness.row_coupling`),
    probed in float32 compute (``graphdef32``, the model's float32-compute graph, where it computes in a lower
    precision: the bfloat16 rounding of the loss would hide a weak coupling such as trial 14's load-balancing
    loss over the whole batch's routing) at the candidate's shard count, only at low-precision compute (the
    tolerance's split; ``False`` in float32); each named strategy that computes the loss per shard is refused
    where it does (:func:`_check_rows`).

    Raises:
        ValueError: as :func:`~shardcheck.parity.harness.row_coupling.check_rows_separable`.
    """
    probe = float32_model(model, graphdef32)
    eps = _probe_eps(task, probe, batch, graphdef32, compute_eps, cached)
    in_float32 = graphdef32 is not None and eps == 0.0
    for strategy, side in zip(strategies, built, strict=True):
        _check_rows(fn, strategy, side, probe, task, batch, eps, in_float32=in_float32, cached=cached)
    if graphdef32 is None:  # float32 compute: the tolerance splits no loss, nothing more to probe
        return False
    noise_s = _noise_shards(built[0].num_shards, batch)
    return noise_s > 1 and _coupled(task, probe, batch, noise_s, eps, in_float32, cached) is not None


def refuse_rows_coupled(fn: str, strategy: str, task: Task, model, num_shards: int) -> None:
    """The refusal a check gives a named strategy that computes the loss per shard where the task's loss
    couples the rows of its first batch, for a caller that runs no check (``train``: trial 59 ran fsdp on a
    load-balancing loss over the whole batch and read "drift exceeded tolerance" as a sharding bug), probed as
    a check probes it (in float32 where the model computes in a lower precision).

    Raises:
        RowCouplingError: as :func:`~shardcheck.parity.harness.row_coupling.check_rows_separable`.
    """
    if strategy in FULL_BATCH_FORWARD or num_shards < 2:
        return
    batch = task.batches[0]
    precision = _precision(fn, task, model, batch, None, {}, cached=False)[1]
    graphdef32 = float32_compute(*nnx.split(model, nnx.Param, ...)) if precision.compute_eps > 0 else None
    built = Candidate(strategy, lambda *a: None, num_shards=num_shards)
    _rows_coupled(fn, (strategy,), (built,), model, graphdef32, task, batch, False, precision.compute_eps)


def _check_rows(
    fn,
    strategy,
    built: Candidate | None,
    model,
    task: Task,
    batch,
    compute_eps: float,
    in_float32: bool = False,
    cached: bool = False,
) -> None:
    """A named strategy that computes the loss per shard, refused where the task's loss couples the rows of a
    batch (:mod:`~shardcheck.parity.harness.row_coupling`: a contrastive loss); nothing for a user's step, the
    full-batch strategies or one shard. ``in_float32``: ``model`` is the float32 probe of a model that computes
    in a lower precision (the refusal says its losses are float32's). ``cached``: ``model`` is the task's own
    initial model (or its probe), probed once a task (:func:`_coupled`)."""
    if not isinstance(strategy, str) or strategy in FULL_BATCH_FORWARD or built is None:
        return
    s = built.num_shards
    if s and s > 1:
        coupled = _coupled(task, model, batch, s, compute_eps, in_float32, cached)
        check_rows_separable(fn, strategy, coupled, s, in_float32)


def _batch_stats_clause(model) -> str:
    """Where the model holds ``nnx.BatchStat`` variables (BatchNorm in training mode): why a strategy that runs
    the forward pass per shard cannot check it at all, beside the writes it drops."""
    if model is None or not jax.tree.leaves(nnx.state(model, nnx.BatchStat)):
        return ""
    return (
        ", so its batch statistics (nnx.BatchStat: BatchNorm) would be computed over part of the batch, not the "
        "full batch (docs/reduction_cases.md C7): a GSPMD step computes the full batch's, a shard_map step of your "
        "own syncs them over the batch axes (axis_name)"
    )


def _check_view(fn: str, cand: Candidate, optimizer, cand_opt) -> None:
    """A candidate stepping an optimizer of its own (``make_optimizer``) whose state is not laid out as the task
    optimizer's needs a ``view_optimizer`` to read it as the task's (``optax.MultiSteps`` keeps it under
    ``inner_opt_state`` and counts micro-steps); without one its state and counter cannot be compared.

    Raises:
        TypeError: no ``view_optimizer`` and the state's leaf paths differ, naming one of each and the fix.
    """
    if cand.view_optimizer is not None:
        return
    from shardcheck.parity.comparison.live import flatten_state
    from shardcheck.parity.diagnosis.form import optimizer_layout

    def paths(opt) -> set[str]:
        state = nnx.state(opt)  # an optimizer without state (plain SGD) holds no "opt_state"
        return set(flatten_state(state["opt_state"])) if "opt_state" in state else set()

    theirs, mine = paths(optimizer), paths(cand_opt)
    if mine == theirs or len(mine & theirs) * 2 > len(theirs):
        # most leaves where the task's are: the same optimizer with some leaves placed otherwise (a
        # multi_transform's labels, a mask: trial 11), which the comparison names as leaves one side lacks
        return
    lacks = sorted(theirs - mine)[:1] or ["(none)"]
    view = (
        "view_optimizer=lambda opt: (its state as the task optimizer's, the update count), e.g. for "
        "optax.MultiSteps: lambda o: (nnx.state(o)['opt_state']['inner_opt_state'], o.opt_state.gradient_step[...])"
    )
    other = _other_transformation(theirs, mine)
    fix = (
        f"{other}, so its state and update count cannot be compared: build the candidate's optimizer as the "
        "task's is built (no view reads one transformation's state as another's, and the task's holds state the "
        f"candidate's lacks); where it wraps the task's optimizer instead, give the Candidate {view}"
        if optimizer_layout(theirs - mine)
        else f"{other}, so its state and update count cannot be compared; give the Candidate {view}"
    )
    raise TypeError(
        f"{fn}: candidate {cand.name!r} steps an optimizer of its own (make_optimizer) whose state is not laid "
        f"out as the task optimizer's (it lacks opt_state {lacks[0]}; it holds {len(mine)} state leaves, the "
        f"task's {len(theirs)}){fix}"
    )


def _other_transformation(theirs: set[str], mine: set[str]) -> str:
    """Where the task's optimizer state or the candidate's holds an optax wrapper's own state the other lacks
    (:func:`~shardcheck.parity.diagnosis.form.optimizer_layout`), that said plainly: the candidate's optimizer is
    another transformation (trial 42: optax.chain(tx, optax.apply_every(2)) in place of the task's
    optax.MultiSteps(tx, 2) was refused with the view's fix alone); ``""`` otherwise."""
    from shardcheck.parity.diagnosis.form import optimizer_layout

    task, cand = optimizer_layout(theirs - mine), optimizer_layout(mine - theirs)
    if not task and not cand:
        return ""
    said = [f"the task's holds {task}" if task else "", f"the candidate's holds {cand}" if cand else ""]
    return (
        f": the candidate's optimizer is another transformation than the task's ({'; '.join(x for x in said if x)}"
        ", which the other lacks), not the task's with other labels or a mask"
    )


class StrategyRefusal(ValueError):
    """A built-in strategy cannot place the task's state on the mesh (an annotation naming an axis the mesh lacks,
    a dimension its axes do not split evenly): that strategy's alone, where the strategies that replicate the
    state may still check the task (``shardcheck verify`` gives it its row; trial 56).

    Attributes:
        strategy: the refusing strategy's registered name.
    """

    def __init__(self, message: str, strategy: str):
        super().__init__(message)
        self.strategy = strategy


def _check_strategy(fn, candidate, cand: Candidate, model, optimizer, mesh, data, weighted: bool) -> None:
    """A named strategy's own checks of the model and optimizer, and of its placement (a refusal of the
    placement is a :class:`StrategyRefusal`); the batches of a registered strategy must split into S equal shards. (A user's
    step may ignore the model's annotations: where they name an axis the mesh lacks, its error says so if it
    raises: :func:`~shardcheck.parity.harness.candidates.run_step`.)"""
    named = isinstance(candidate, str)
    if named:
        strategy = STRATEGIES[candidate]
        if strategy.check is not None:
            strategy.check(fn, model, optimizer)
        if strategy.placement == "fsdp":  # the annotations and the mesh's axes must fit (no state is changed)
            placed = mesh_for(fn, strategy, cand.num_shards, mesh)
            try:
                state_specs(candidate, model, optimizer, placed, fn=fn)
            except ValueError as err:
                raise StrategyRefusal(str(err), candidate) from err
    if cand.num_shards is not None and (named or cand.name in STRATEGIES):
        for batch in data:
            check_divisible(fn, batch, cand.num_shards, weighted=weighted)


def check_reference(fn, reference):
    if not callable(reference):
        raise TypeError(
            f"{fn}: reference must be None (the task's single-device step), a mesh strategy's name, an in-place "
            "step or a recording (a shardcheck.Recording, or an .npz path from `shardcheck record`), got "
            f"{type(reference).__name__} {reference!r}"
        )


def _check_weights_accepted(fn, cand: Candidate, data):
    if getattr(cand.step, "takes_weights", True) or not any(
        len(b) == 3 for b in data if isinstance(b, tuple)
    ):
        return
    i = next(i for i, b in enumerate(data) if isinstance(b, tuple) and len(b) == 3)
    raise TypeError(
        f"{fn}: batch {i} carries weights but candidate {cand.name!r} takes no weights= argument; add a "
        "weights=None keyword to it, or pass (x, y) batches"
    )
