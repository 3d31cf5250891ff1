"""What a parity run admits, checked before any step runs, and the run built from it.

:func:`check_options` (tolerances, ``accept_weak``, the mesh, the shard count), the model (the admission rule
of the Task, :func:`shardcheck.task.check_model`, C7), the task's batches, the reference and the candidate; :func:`_setup` builds the
:class:`~shardcheck.parity.state._Run` from copies of the initial state: nothing of the caller's changes.
"""

from __future__ import annotations

from flax import nnx

from shardcheck import _validate
from shardcheck.mesh import check_mesh, data_shards
from shardcheck.parity.candidates import as_candidate, check_step_signature
from shardcheck.parity.leaf_tolerance import _check_leaf_tolerance, _leaf_names
from shardcheck.parity.precision import Precision, float32_compute
from shardcheck.parity.state import _copy_state, _Run
from shardcheck.steps import STRATEGIES, Candidate
from shardcheck.steps.registry import mesh_for
from shardcheck.steps.sharded import state_specs
from shardcheck.task import Task, check_divisible, check_model


def _check_tolerances(fn, rtol, atol):
    for label, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0
        ):
            raise ValueError(f"{fn}: {label} must be a number >= 0, got {value!r}")


def _task_batches(fn: str, task: Task, steps: int | None) -> list:
    if steps is None:
        return list(task.batches)
    steps = _validate.check_int(fn, "steps", steps)
    if steps > len(task.batches):
        raise ValueError(
            f"{fn}: steps={steps} but the task holds only {len(task.batches)} batch(es); pass more"
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
    return num_shards


def _setup(
    fn, candidate, task, *, steps, num_shards, mesh, reference, name, dtypes, leaf_tolerance, initial_state
):
    """Validate everything and build the run; nothing runs and nothing of the caller's changes."""
    model, optimizer, data = _initial(fn, task, reference, steps, initial_state)
    cand = as_candidate(fn, candidate, task, num_shards, mesh, name)
    weighted = check_model(fn, model, task.loss_fn, data[0])
    _check_weights_accepted(fn, cand, data)
    _check_strategy(fn, candidate, cand, model, optimizer, mesh, data, weighted)
    ref_model, ref_opt = _copy_state(model, optimizer)
    cand_model, cand_opt = _copy_state(model, optimizer)
    if cand.make_optimizer is not None:
        cand_opt = cand.make_optimizer(cand_model, cand_opt)
    kwargs = {"mesh": mesh} if cand.pass_mesh else {}
    precision = Precision.of(model, fn=fn, **dtypes)
    overrides = _check_leaf_tolerance(fn, leaf_tolerance, _leaf_names(model, optimizer))
    # the model's structure is fixed over the run: its float32-compute graph is built once
    graphdef32 = float32_compute(*nnx.split(model, nnx.Param, ...)) if precision.compute_eps > 0 else None
    run = _Run(
        task,
        ref_model,
        ref_opt,
        reference,
        cand,
        cand_model,
        cand_opt,
        kwargs,
        weighted,
        precision,
        overrides,
        graphdef32,
    )
    return run, data


def _initial(fn, task, reference, steps, initial_state):
    """The run's initial ``(model, optimizer)`` (``initial_state``, else fresh from the task) and its batches,
    after the task and the reference are checked."""
    if not isinstance(task, Task):
        raise TypeError(
            f"{fn}: task must be a shardcheck.Task (or, in the (model, optimizer, batches) form, an nnx.Module), got "
            f"{type(task).__name__}; build one with shardcheck.Task(model=..., optimizer=..., loss_fn=..., batches=...)"
        )
    if reference is not None:
        check_reference(fn, reference)
        check_step_signature(fn, "reference", reference, 3, False)
    if initial_state is None:
        model = task.new_model(fn)
        optimizer = task.new_optimizer(model)
    else:
        model, optimizer = initial_state
    return model, optimizer, _task_batches(fn, task, steps)


def _check_strategy(fn, candidate, cand: Candidate, model, optimizer, mesh, data, weighted: bool) -> None:
    """A named strategy's own checks of the model and optimizer, and of its placement; the batches of a
    registered strategy must split into S equal shards."""
    named = isinstance(candidate, str)
    if named:
        strategy = STRATEGIES[candidate]
        if strategy.check is not None:
            strategy.check(fn, model, optimizer)
        if strategy.placement == "fsdp":  # the annotations and the mesh's axes must fit (no state is changed)
            state_specs(candidate, model, optimizer, mesh_for(fn, strategy, cand.num_shards, mesh), fn=fn)
    if cand.num_shards is not None and (named or cand.name in STRATEGIES):
        for batch in data:
            check_divisible(fn, batch, cand.num_shards, weighted=weighted)


def check_reference(fn, reference):
    if not callable(reference):
        raise TypeError(
            f"{fn}: reference must be None (the task's single-device step) or an in-place step, got "
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
