"""The memory measured: the strategy's real step compiled and run once, XLA's figures and the live arrays.

XLA's ``memory_analysis()`` of the partitioned executable gives argument, output, alias and temp bytes of one
device (``CompiledMemoryStats``, see the JAX docs of ``jax.stages.Compiled.memory_analysis``); after one real
step on a fresh model, the ``shard.data.nbytes`` of every addressable shard of every state array is added up per
device. The estimate beside it (:func:`~shardcheck.memory.estimate_memory`) places the state on the same mesh by
the same rule, so the two agree exactly on the persistent state (``accuracy_ratio == 1.0``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import jax
import jax.numpy as jnp
from flax import nnx

from shardcheck import _validate
from shardcheck.memory.estimate import estimate_memory
from shardcheck.memory.layouts import MESH_STRATEGIES, check_strategy, one_device, run_mesh
from shardcheck.memory.lowering import data_sharding, lower_step, memory_stats, run_lowered
from shardcheck.memory.state import optimizer_transform
from shardcheck.mesh import FSDP_AXIS, check_mesh
from shardcheck.partitioning import LAYOUTS, STRATEGIES
from shardcheck.task import Task

MEASURED = MESH_STRATEGIES[:-1]
"""What can be measured: every strategy an estimate places but ``"placed"``."""


@dataclasses.dataclass(frozen=True)
class MemoryMeasurement:
    """What one compiled step of a strategy really uses per device, beside the estimate.

    XLA's figures come from ``jax.stages.Compiled.memory_analysis()`` (``CompiledMemoryStats``) of the
    SPMD-partitioned executable, so they are per device. The live-state figures add up
    ``shard.data.nbytes`` over ``array.addressable_shards`` of every model and optimizer array after one real
    step.

    Attributes:
        strategy: the strategy measured (:data:`MEASURED`), or the name of a user's step.
        num_devices: devices of the mesh the step ran on (1 for ``"replicated"``).
        argument_bytes: XLA ``argument_size_in_bytes``: every input buffer of one device (state and data).
        output_bytes: XLA ``output_size_in_bytes`` (new state, the loss, and XLA's tuple index tables).
        alias_bytes: XLA ``alias_size_in_bytes``: outputs written into donated inputs (0 without donation).
        temp_bytes: XLA ``temp_size_in_bytes``: scratch buffers (gradients, activations, gathered parameters).
        generated_code_bytes: XLA ``generated_code_size_in_bytes``.
        peak_bytes: ``argument_bytes + output_bytes - alias_bytes + temp_bytes``, an upper bound of the live
            bytes of one device during the step (XLA's own ``peak_memory_in_bytes`` omits temp on CPU).
        reported_peak_bytes: XLA's ``peak_memory_in_bytes`` as reported, or -1 where not available.
        data_argument_bytes: bytes of this device's blocks of ``x`` and ``y`` (of every leaf of a task's batch)
            among the arguments.
        state_argument_bytes: ``argument_bytes - data_argument_bytes``: the model and optimizer state
            passed in.
        state_bytes_per_device: live state bytes on each device of the mesh, in mesh order, after one step.
        state_bytes: the largest of ``state_bytes_per_device``.
        estimated_persistent_bytes: :attr:`MemoryEstimate.persistent_bytes` for the same strategy and S.
        accuracy_ratio: ``estimated_persistent_bytes / state_bytes`` (1.0: the estimate is exact). Where
            :attr:`placement_differs` is not empty it compares two layouts, not the estimate's error.
        placement_differs: a user's step (:func:`measure_step`): each persistent leaf whose placement after the
            step holds other bytes per device than the layout the estimate assumes: a parameter as ``"moe.w_in:
            P() holds 8192 B a device (the estimate's P('expert', None, None): 2048 B)"``, then the optimizer
            state (``"optimizer state 0.mu.moe.w_in: ..."``), the model's non-parameter state (``"model state
            ema.head1/kernel: ..."``) and the step counter; ``()`` where they agree (or for a strategy's own step).
        placement_bytes: the bytes per device the leaves of :attr:`placement_differs` hold beyond (negative:
            short of) the estimate's layout, summed: what of ``state_bytes - estimated_persistent_bytes`` the
            placement explains.
        placement_note: that sum in one sentence, by kind of leaf (``""`` where :attr:`placement_differs` is
            empty): ``"29 leaves placed otherwise than the estimate assumes hold 5664 B a device more than its
            layout (7 parameters: 336 B; 7 optimizer-state leaves: 336 B; 15 model-state leaves: 4992 B), of the
            5664 B between the live state (19984 B) and the estimate (14320 B)"``.
    """

    strategy: str
    num_devices: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    peak_bytes: int
    reported_peak_bytes: int
    data_argument_bytes: int
    state_argument_bytes: int
    state_bytes_per_device: tuple[int, ...]
    state_bytes: int
    estimated_persistent_bytes: int
    accuracy_ratio: float
    placement_differs: tuple[str, ...] = ()
    placement_bytes: int = 0
    placement_note: str = ""

    def to_json(self) -> dict:
        """The fields as a JSON-ready dict (tuples as lists)."""
        out = dataclasses.asdict(self)
        out["state_bytes_per_device"] = list(self.state_bytes_per_device)
        out["placement_differs"] = list(self.placement_differs)
        return out


def _device_bytes(tree, devices) -> tuple[int, ...]:
    """Bytes of every array's addressable shards, summed per device, in the order of ``devices``."""
    acc = {d: 0 for d in devices}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            acc[shard.device] = acc.get(shard.device, 0) + shard.data.nbytes
    return tuple(acc[d] for d in devices)


def _block_bytes(batch, device) -> int:
    """Bytes of ``device``'s blocks of every leaf of a placed batch."""
    return sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(batch)
        for shard in leaf.addressable_shards
        if shard.device == device
    )


def _measurement(strategy, compiled, data_bytes, model, optimizer, devices, estimate) -> MemoryMeasurement:
    stats = memory_stats(compiled)
    per_device = _device_bytes(nnx.state((model, optimizer)), devices)
    measured = max(per_device)
    return MemoryMeasurement(
        strategy=strategy,
        num_devices=len(devices),
        data_argument_bytes=data_bytes,
        state_argument_bytes=stats["argument_bytes"] - data_bytes,
        state_bytes_per_device=per_device,
        state_bytes=measured,
        estimated_persistent_bytes=estimate.persistent_bytes,
        accuracy_ratio=estimate.persistent_bytes / measured,
        **stats,
    )


def _task_mesh(fn: str, mesh, axis_name: str) -> jax.sharding.Mesh:
    """The task form's mesh: ``mesh`` as given, else every device on one axis ``axis_name``."""
    from shardcheck.mesh import make_mesh

    return make_mesh(None, axis_name) if mesh is None else check_mesh(fn, mesh)


def _check_task(fn, task: Task, strategy, mesh, model, optimizer, weighted) -> None:
    """The task's model and first batch fit the strategy and mesh (raises before any state changes)."""
    from shardcheck.steps.registry import STRATEGIES as REGISTRY
    from shardcheck.task import check_model

    batch = task.batches[0]
    # the loss's output checked on batch 0; random draws and batch statistics change no byte: accepted
    if weighted is None:
        weighted = check_model(fn, model, task.loss_fn, batch, drawn=[], batch_stats=True)
    if not one_device(strategy):
        _check_batch_shards(fn, batch, mesh, weighted)
    layout = LAYOUTS.get(strategy)
    registered = REGISTRY.get(layout.strategy if layout is not None else strategy)
    if registered is not None and registered.check is not None:
        registered.check(fn, model, optimizer)


def _check_batch_shards(fn: str, batch, mesh, weighted: bool) -> None:
    """``batch`` splits evenly over the mesh's batch axes (:func:`~shardcheck.mesh.data_shards`), not over every
    device (trial 59: ``--mesh data=2,model=2,tensor=3`` read "num_shards=12 is more shards than examples")."""
    from shardcheck.mesh import batch_axes, data_shards
    from shardcheck.task import check_divisible

    s = data_shards(mesh)
    axes = " x ".join(repr(a) for a in batch_axes(mesh))
    by = f"the {s} batch shards of mesh axes {axes}"
    check_divisible(fn, batch, s, weighted=weighted, by=by, counts="batch shard counts")


def _measure_task(fn, task: Task, strategy, mesh, weighted=None) -> MemoryMeasurement:
    """``measure_memory`` of a task on ``mesh``; ``weighted`` (the loss form) is given when it was checked already."""
    check_strategy(fn, strategy, MEASURED)
    model = task.new_model(fn)
    optimizer = task.new_optimizer(model)
    _check_task(fn, task, strategy, mesh, model, optimizer, weighted)
    estimate = estimate_memory(task, mesh=mesh, strategy=strategy)
    lowered, args, treedef = lower_step(strategy, task.loss_fn, model, optimizer, task.batches[0], mesh)
    compiled = run_lowered(lowered, args, treedef, model, optimizer)
    devices = tuple(run_mesh(strategy, mesh).devices.flat)
    return _measurement(
        strategy, compiled, _block_bytes(args[1], devices[0]), model, optimizer, devices, estimate
    )


def _user_step_compiled(step, model, optimizer, batch, mesh, pass_mesh: bool, fn: str = "measure_step"):
    """The compiled executable of a user's step, lowered on the state it placed (after its first run).

    A step with ``.lower`` (``jax.jit`` / ``nnx.jit`` of ``(model, optimizer, batch)``) is lowered itself; any
    other is traced whole under one ``jax.jit`` of ``(state, batch) -> (loss, new state)`` (its own jitted
    functions inline into it), so XLA's figures are those of the step as one program.
    """
    extra = (mesh,) if pass_mesh else ()
    if callable(getattr(step, "lower", None)):
        try:
            return step.lower(model, optimizer, batch, *extra).compile()
        except TypeError:
            pass  # not a jit of (model, optimizer, batch): trace it whole
    graphdef, state = nnx.split((model, optimizer))

    def whole(state, batch):
        m, o = nnx.merge(graphdef, state)
        loss = step(m, o, batch, *extra)
        return getattr(loss, "loss", loss), nnx.state((m, o))

    try:
        return jax.jit(whole).lower(state, batch).compile()
    except ValueError as err:  # a step that enters jax.set_mesh itself: JAX refuses it inside a trace
        if "set_mesh" not in str(err) or "outside of" not in str(err):
            raise
    with _mesh_set_around_trace(fn, mesh):
        return jax.jit(whole).lower(state, batch).compile()


@contextlib.contextmanager
def _mesh_set_around_trace(fn: str, mesh: jax.sharding.Mesh):
    """Trace a step that enters ``with jax.set_mesh(mesh):`` itself (the Flax NNX sharding guide's idiom).

    ``jax.set_mesh`` raises inside ``jax.jit`` ("can only be used outside of jax.jit", JAX's docstring of
    ``jax.set_mesh``): a trace may not change the mesh its program is traced under. Here the mesh is set around
    the trace, so the step's own ``jax.set_mesh`` of an equal mesh inside it changes nothing and, in this thread
    and for the length of the trace only, enters as a no-op (its exit restores the mesh set around the trace).
    ``jax.set_mesh`` outside this thread behaves as JAX defines it. ``with mesh:`` needs none of this (JAX allows
    it in a trace). The class behind ``jax.set_mesh`` is patched for the trace because JAX offers no public way to
    trace such a step whole.

    Raises:
        ValueError: the step sets another mesh than ``mesh`` while it is traced (naming both).
    """
    cls = jax.set_mesh
    original = cls.__init__
    owner = threading.get_ident()

    def enter_in_trace(self, other):
        if threading.get_ident() != owner:
            original(self, other)
            return
        if other != mesh:
            raise ValueError(
                f"{fn}: the step sets the mesh {other} with jax.set_mesh, but mesh={mesh}; pass {fn} the mesh "
                f"the step runs on{_axis_types_hint(other, mesh)}"
            )
        self.prev_abstract_mesh, self.prev_mesh = mesh.abstract_mesh, mesh  # what __exit__ sets back

    with jax.set_mesh(mesh):
        cls.__init__ = enter_in_trace
        try:
            yield
        finally:
            cls.__init__ = original


def _axis_types_hint(other, mesh) -> str:
    """``": the same devices and axes, typed (Explicit, Explicit) by the step: jax.make_mesh(..., axis_types=
    (AxisType.Explicit,) * 2)"`` where the two meshes differ only in their axis types (trial 38: an
    explicit-sharding step measured on ``shardcheck.make_mesh``'s Auto axes), else ``""``."""
    if getattr(other, "axis_names", None) != mesh.axis_names or getattr(other, "devices", None) is None:
        return ""
    if other.devices.shape != mesh.devices.shape or not (other.devices == mesh.devices).all():
        return ""
    types = tuple(t.name for t in other.axis_types)
    if len(set(types)) == 1:
        made = f"axis_types=(AxisType.{types[0]},) * {len(types)}"
    else:
        made = f"axis_types=({', '.join(f'AxisType.{t}' for t in types)})"
    return (
        f": the same devices and axes, typed ({', '.join(types)}) by the step: build it with "
        f"jax.make_mesh(..., {made})"
    )


def measure_step(step, task: Task, mesh: jax.sharding.Mesh, *, strategy: str = "gspmd") -> MemoryMeasurement:
    """The memory of any step of a task on ``mesh``, a user's own jitted step included.

    ``step`` is a registered strategy's name (``"dp"``, ``"fsdp"``, ``"gspmd"``, or a memory layout: as
    ``measure_memory(task, strategy=step, mesh=mesh)``) or a user's step ``step(model, optimizer, batch[, mesh])``
    that updates ``model`` and ``optimizer`` in place, as ``shardcheck verify --candidate`` takes it (the example
    ``examples/annotated_lm.py:step`` places the state from its annotations with ``nnx.get_named_sharding`` and
    runs an ``nnx.jit`` step). The user's step runs once on a fresh ``task.model()`` with ``task.optimizer`` on the
    task's first batch (placed over every mesh axis), then the live bytes of every device are read from the
    arrays' ``addressable_shards``, and the step is compiled again on the state as it left it
    (:func:`_user_step_compiled`) for XLA's per-device argument, output, alias and temp bytes. A step may set
    its mesh itself, ``with jax.set_mesh(mesh):`` as the Flax NNX sharding guide writes it or ``with mesh:``, as
    ``check_parity`` runs it: the mesh is then set around that trace (:func:`_mesh_set_around_trace`).

    Args:
        step: a strategy name or a callable as above.
        task: the :class:`~shardcheck.Task`.
        mesh: the device mesh (:func:`shardcheck.mesh.make_mesh`).
        strategy: for a user's step, the placement the estimate beside it assumes: ``"gspmd"`` (the model's
            annotations, else the FSDP rule; what a GSPMD step placed by ``nnx.get_named_sharding`` holds),
            ``"dp"``, ``"fsdp"``, ...; ``"placed"`` estimates from the shardings the step left (equal by
            construction).

    Returns:
        A :class:`MemoryMeasurement`: bytes per device, ``accuracy_ratio = estimate / measured live bytes``.

    Raises:
        TypeError: ``step`` neither a name nor a callable, ``task`` not a Task, ``mesh`` not a Mesh, a step whose
            signature takes neither 3 nor 4 arguments.
        ValueError: an unknown strategy, a first batch that does not split over ``mesh.size`` devices, a step
            that sets another mesh than ``mesh`` with ``jax.set_mesh`` (a model with batch statistics or a random
            forward pass is measured: neither changes a byte of the step's memory).
    """
    return _measure_step("measure_step", step, task, mesh, strategy)


def _measure_step(fn: str, step, task: Task, mesh, strategy: str) -> MemoryMeasurement:
    """:func:`measure_step`, its errors naming ``fn``: the function the user called (``measure_memory(step, task,
    mesh)`` is measured here too; trial 38's refusal named measure_step)."""
    from shardcheck.parity.harness.candidates import accepts, check_step_signature
    from shardcheck.task import check_model

    if not isinstance(task, Task):
        raise TypeError(f"{fn}: task must be a shardcheck.Task, got {type(task).__name__}")
    check_mesh(fn, mesh)
    if isinstance(step, str):
        return _measure_task(fn, task, step, mesh)
    if not callable(step):
        raise TypeError(
            f"{fn}: step must be a strategy name ({', '.join(MESH_STRATEGIES[:-1])}) or a callable "
            f"step(model, optimizer, batch[, mesh]), got {type(step).__name__}"
        )
    if strategy not in MESH_STRATEGIES:
        raise ValueError(f"{fn}: strategy={strategy!r} is unknown; use one of {', '.join(MESH_STRATEGIES)}")
    pass_mesh = accepts(step, "mesh", 3)
    check_step_signature(fn, "step", step, 3, pass_mesh)
    model = task.new_model(fn)
    optimizer = task.new_optimizer(model)
    batch = task.batches[0]
    # random draws and batch statistics change no byte of the step's memory
    weighted = check_model(fn, model, task.loss_fn, batch, drawn=[], batch_stats=True)
    _check_batch_shards(fn, batch, mesh, weighted)
    if strategy != "placed":
        estimate = estimate_memory(task, mesh=mesh, strategy=strategy)
    batch = jax.device_put(batch, data_sharding(mesh))
    step(model, optimizer, batch, *((mesh,) if pass_mesh else ()))
    if strategy == "placed":
        estimate = estimate_memory(model, optimizer, mesh=mesh, strategy="placed")
    differs = ((), 0, ()) if strategy == "placed" else _placement_differs(estimate, model, optimizer, mesh)
    compiled = _user_step_compiled(step, model, optimizer, batch, mesh, pass_mesh, fn)
    first = mesh.devices.flat[0]
    measured = _measurement(
        getattr(step, "__name__", "step"),
        compiled,
        _block_bytes(batch, first),
        model,
        optimizer,
        tuple(mesh.devices.flat),
        estimate,
    )
    entries, gap, kinds = differs
    note = _placement_note(entries, gap, kinds, measured) if entries else ""
    return dataclasses.replace(measured, placement_differs=entries, placement_bytes=gap, placement_note=note)


_PLACED_KINDS = (
    ("params", "", "parameter", "parameters"),
    ("optimizer", "optimizer state ", "optimizer-state leaf", "optimizer-state leaves"),
    ("model_state", "model state ", "model-state leaf", "model-state leaves"),
    ("step", "step counter ", "step counter", "step counters"),
)
"""The persistent kinds of leaf :func:`_placement_differs` compares, in order: the estimate's category, how an
entry names it, and its noun (one, several)."""


def _placement_differs(estimate, model, optimizer, mesh) -> tuple[tuple[str, ...], int, tuple]:
    """The persistent leaves (parameters, optimizer state, the model's non-parameter state, the step counter)
    whose placement as a user's step left them holds other bytes per device than the ``estimate``'s layout
    (:attr:`MemoryMeasurement.placement_differs`; trial 27: a step that replicated every leaf beside annotations
    over 'expert' read as an estimate 26% off; trial 37: an EMA of the parameters the step kept replicated where
    the estimate splits it, 4992 B of a 5664 B gap, went unnamed beside 336 B of biases).

    Returns:
        ``(entries, bytes, kinds)``: the entries; the bytes per device they hold beyond the estimate's layout,
        summed; ``(noun, count, bytes)`` per kind of leaf with an entry, in :data:`_PLACED_KINDS` order.
    """
    placed = estimate_memory(model, optimizer, mesh=mesh, strategy="placed")
    assumed = {(e.category, e.path): e for e in estimate.leaves}
    out, gap, kinds = [], 0, []
    for category, prefix, one, several in _PLACED_KINDS:
        count = extra = 0
        for e in placed.leaves:
            a = assumed.get((category, e.path)) if e.category == category else None
            if a is None or a.per_device_bytes == e.per_device_bytes:
                continue
            out.append(
                f"{prefix}{e.path}: {e.spec} holds {e.per_device_bytes} B a device (the estimate's {a.spec}: "
                f"{a.per_device_bytes} B)"
            )
            count, extra = count + 1, extra + e.per_device_bytes - a.per_device_bytes
        if count:
            kinds.append((one if count == 1 else several, count, extra))
            gap += extra
    return tuple(out), gap, tuple(kinds)


def _placement_note(entries: tuple[str, ...], gap: int, kinds: tuple, measured: MemoryMeasurement) -> str:
    """:attr:`MemoryMeasurement.placement_note`: what the leaves placed otherwise hold beyond the estimate's
    layout, by kind, beside the gap between the live state and the estimate."""
    more = f"{gap} B a device more than" if gap >= 0 else f"{-gap} B a device less than"
    parts = "; ".join(f"{count} {noun}: {extra} B" for noun, count, extra in kinds)
    total = measured.state_bytes - measured.estimated_persistent_bytes
    leaves = "1 leaf" if len(entries) == 1 else f"{len(entries)} leaves"
    return (
        f"{leaves} placed otherwise than the estimate assumes hold {more} its layout ({parts}), of the {total} B "
        f"between the live state ({measured.state_bytes} B) and the estimate ({measured.estimated_persistent_bytes} B)"
    )


def _model_task(fn: str, model: nnx.Module, optimizer: nnx.Optimizer, x, y) -> Task:
    """The seeds' task of a model and its optimizer: MSE on ``(x, y)``, fresh copies of the model's arrays."""
    from shardcheck.losses import mse_batch_loss

    graphdef, state = nnx.split(model)
    return Task(
        model=lambda: nnx.merge(graphdef, jax.tree.map(jnp.copy, state)),
        optimizer=optimizer_transform(fn, optimizer),
        loss_fn=mse_batch_loss,
        batches=[(x, y)],
        name="model",
    )


def _measure_model(fn, model, optimizer, x, y, strategy, mesh) -> MemoryMeasurement:
    """``measure_memory(model, optimizer, x, y, ...)``: validated as the seeds' steps validate, then measured as
    the task of :func:`_model_task` (the caller's model and optimizer are not touched)."""
    from shardcheck import mesh as mesh_lib

    check_strategy(fn, strategy, STRATEGIES)
    x, y = _validate.check_batch(fn, x, y)
    _validate.check_model(fn, model, x, y)
    _validate.check_params_only(fn, model)
    _validate.check_optimizer(fn, optimizer, model)
    if mesh is None:
        mesh = mesh_lib.make_mesh()
    num_shards = mesh_lib.check_mesh_axis(fn, mesh, "data")
    if not one_device(strategy):
        _validate.check_batch_divisible(fn, x.shape[0], num_shards, "data")
    return _measure_task(fn, _model_task(fn, model, optimizer, x, y), strategy, mesh)


def measure_memory(
    model: nnx.Module | Task,
    optimizer: nnx.Optimizer | None = None,
    x=None,
    y=None,
    *,
    strategy: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    axis_name: str | None = None,
) -> MemoryMeasurement:
    """Compile the real step of ``strategy`` on ``mesh``, run it once on a fresh copy, and read its memory.

    Three forms:

    * ``measure_memory(task, strategy=..., mesh=...)``: the task's own step on its first batch, on a fresh
      ``task.model()`` with ``nnx.Optimizer(model, task.optimizer, wrt=nnx.Param)``. ``mesh`` may have several
      axes (``make_mesh({"data": 2, "fsdp": 4})``): the batch is split over all of them and the state placed as
      :func:`~shardcheck.memory.estimate_memory` places it (the model's annotations, else the FSDP rule).
    * ``measure_memory(model, optimizer, x, y, strategy=..., mesh=...)``: the seeds' MSE task of a model of
      ``nnx.Param`` only, on a mesh with a ``"data"`` axis; ``model`` and ``optimizer`` are left as they were.
    * ``measure_memory(step, task, mesh)``: any step of a task, a user's own jitted step included
      (:func:`measure_step`; ``strategy=`` is then the placement the estimate beside it assumes).

    The step lowered is the strategy's own (:func:`~shardcheck.memory.lower_step`): the registry's reference
    step on the mesh's first device for ``"replicated"``, its ``jax.shard_map`` steps for ``"dp"`` / ``"fsdp"``,
    its GSPMD step for ``"gspmd"``, the memory-only GSPMD step of :mod:`shardcheck.memory.layouts` for
    ``"zero1"`` / ``"zero2"``.

    Args:
        model: a :class:`~shardcheck.Task` (then pass no optimizer, x or y), or an ``nnx.Module`` holding only
            ``nnx.Param`` variables (real arrays, not abstract).
        optimizer: ``nnx.Optimizer(model, tx, wrt=nnx.Param)``; any optax ``tx``.
        x: ``(B, D)`` float inputs; B must divide by the mesh size.
        y: ``(B, K)`` float targets.
        strategy: ``"replicated"``, ``"dp"``, ``"zero1"``, ``"zero2"``, ``"fsdp"``; a task also ``"gspmd"``.
        mesh: the device mesh; default every device on one axis (``"data"`` for a model, ``axis_name`` for a
            task). Only its first device for ``"replicated"``.
        axis_name: the task form's default mesh axis (default ``"fsdp"``, the axis ``num_shards=`` estimates
            place on); the model form takes none.

    Returns:
        A :class:`MemoryMeasurement` in bytes per device, with the estimate of the persistent state beside it
        and ``accuracy_ratio = estimate / measured``.

    Raises:
        TypeError: ``model``, ``optimizer``, ``mesh`` or the data of the wrong type; an optimizer or data passed
            with a Task; no ``strategy``.
        ValueError: unknown ``strategy``; a model with non-Param state; bad data; a batch that does not split
            evenly over the mesh; a mesh without the axis; a task whose registered strategy refuses it
            (``Strategy.check``); an annotation the mesh cannot honour. Nothing is changed when an error is raised.
    """
    fn = "measure_memory"
    if isinstance(optimizer, Task):  # measure_memory(step, task, mesh): any step, a user's own included
        return _measure_step(fn, model, optimizer, mesh if x is None else x, strategy or "gspmd")
    if strategy is None:
        raise TypeError(f"{fn}: strategy= is missing; pass one of {', '.join(MEASURED)}")
    if isinstance(model, Task):
        if optimizer is not None or x is not None or y is not None:
            raise TypeError(
                f"{fn}: with a Task pass no optimizer, x or y; its own optimizer and first batch are measured"
            )
        check_strategy(fn, strategy, MEASURED)
        return _measure_task(fn, model, strategy, _task_mesh(fn, mesh, axis_name or FSDP_AXIS))
    if axis_name not in (None, "data"):
        raise ValueError(
            f"{fn}: axis_name={axis_name!r} applies to the task form; the (model, optimizer, x, y) form measures "
            "on a mesh axis 'data'"
        )
    return _measure_model(fn, model, optimizer, x, y, strategy, mesh)


def _check_devices(fn: str, num_shards: int) -> None:
    """Enough devices for ``num_shards`` on the platform a mesh would use (:func:`shardcheck.devices.select_devices`:
    the default backend's, else the CPU devices beside it); its error says what will work."""
    from shardcheck.devices import select_devices

    select_devices(num_shards, what=f"num_shards={num_shards}", fn=fn)


def measure_task_strategies(
    task: Task, *, num_shards: int, strategies=STRATEGIES, axis_name: str = FSDP_AXIS
) -> dict[str, MemoryMeasurement]:
    """:func:`measure_memory` of a task for each strategy: what ``shardcheck memory --task ... --measure`` runs.

    The mesh is one axis ``axis_name`` (default ``"fsdp"``) of the first ``num_shards`` devices, the mesh
    ``estimate_memory(task, num_shards=S)`` places on, so the model's annotations naming ``"fsdp"`` hold; each
    strategy steps a fresh ``task.model()`` once on ``task.batches[0]``.

    Returns:
        ``{strategy: MemoryMeasurement}`` in the order of ``strategies``.

    Raises:
        TypeError: ``task`` not a :class:`~shardcheck.Task`, ``num_shards`` not an int.
        ValueError: unknown strategy, fewer devices than ``num_shards``, and the errors of
            :func:`measure_memory` (a first batch that does not split into ``num_shards`` equal shards, ...).
    """
    from shardcheck.mesh import make_mesh
    from shardcheck.task import check_model

    fn = "measure_task_strategies"
    if not isinstance(task, Task):
        raise TypeError(f"{fn}: task must be a shardcheck.Task, got {type(task).__name__}")
    num_shards = _validate.check_num_shards(fn, num_shards)
    for s in strategies:
        check_strategy(fn, s, MEASURED)
    _check_devices(fn, num_shards)
    mesh = make_mesh(num_shards, axis_name)
    # once for every strategy; random draws in the forward pass change no byte: accepted
    weighted = check_model(fn, task.new_model(fn), task.loss_fn, task.batches[0], drawn=[], batch_stats=True)
    return {s: _measure_task(fn, task, s, mesh, weighted) for s in strategies}


def measure_strategies(
    in_features: int,
    out_features: int,
    *,
    hidden: int | None = None,
    layers: int | None = None,
    param_dtype="float32",
    optimizer: str = "sgd",
    num_shards: int,
    batch_size: int,
    strategies=STRATEGIES,
    seed: int = 0,
) -> dict[str, MemoryMeasurement]:
    """:func:`measure_memory` of one fresh model for each strategy: what ``shardcheck memory --measure`` runs.

    The model is :func:`~shardcheck.memory.make_memory_model` (seed ``seed``) with ``nnx.Optimizer(model,
    make_tx(optimizer), wrt=nnx.Param)``, the batch standard-normal float32 ``x: (batch_size, D)``, ``y:
    (batch_size, K)`` from ``jax.random.key(seed)``, the mesh :func:`shardcheck.make_mesh` of the first
    ``num_shards`` devices.

    Returns:
        ``{strategy: MemoryMeasurement}`` in the order of ``strategies``.

    Raises:
        TypeError: ``num_shards`` not an int.
        ValueError: bad widths or dtype (:func:`~shardcheck.memory.make_memory_model`), unknown optimizer or
            strategy, fewer devices than ``num_shards``, ``batch_size`` < 1 or not divisible by ``num_shards``,
            and the errors of :func:`measure_memory`.
    """
    from shardcheck.memory.models import make_memory_model
    from shardcheck.mesh import make_mesh

    fn = "measure_strategies"
    num_shards = _validate.check_num_shards(fn, num_shards)
    for s in strategies:
        check_strategy(fn, s, STRATEGIES)
    tx = optimizer_transform(fn, optimizer)
    _check_devices(fn, num_shards)
    _validate.check_int(fn, "batch_size", batch_size, example="batch_size=8 * num_shards")
    if not all(one_device(s) for s in strategies):
        _validate.check_batch_divisible(fn, batch_size, num_shards, "data")
    model = make_memory_model(
        in_features, out_features, hidden=hidden, layers=layers, param_dtype=param_dtype, seed=seed
    )
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    kx, ky = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (batch_size, in_features), jnp.float32)
    y = jax.random.normal(ky, (batch_size, out_features), jnp.float32)
    mesh = make_mesh(num_shards)
    return {s: measure_memory(model, opt, x, y, strategy=s, mesh=mesh) for s in strategies}
