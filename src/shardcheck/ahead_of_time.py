"""The training step's memory ahead of time: compiled on abstract inputs at full scale, nothing allocated.

:func:`compile_ahead_of_time` lowers and compiles the real step of a strategy (the program it runs, through
:func:`shardcheck.memory.lower_step`) on ``jax.ShapeDtypeStruct`` state and batch carrying their target
``NamedSharding`` over as many (fake CPU) devices as the mesh has, and reads XLA's per-device figures;
:func:`largest_batch_that_fits` compiles it at a few batch sizes against a device's memory
(:mod:`shardcheck.device_memory`). A billion-parameter model is sized this way on a laptop: only shapes exist.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax

from shardcheck import _validate
from shardcheck.memory.estimate import estimate_memory
from shardcheck.memory.layouts import MESH_STRATEGIES, one_device
from shardcheck.memory.lowering import lower_step, memory_stats
from shardcheck.memory.state import abstract_training_state, itemsize
from shardcheck.mesh import batch_axes, check_mesh, data_shards
from shardcheck.task import Task

PyTree = Any

BACKEND_NOTE = {
    "cpu": (
        "compiled by XLA:CPU on fake CPU devices: argument, output and alias bytes are the step's state and batch "
        "and hold on any backend with the same shardings; temp is XLA:CPU's buffer assignment, an estimate of an "
        "accelerator's (GPU and TPU compilers fuse, schedule and pad differently: expect the same order of "
        "magnitude, not the same bytes)"
    ),
    "gpu": "compiled by XLA:GPU for this GPU model (on the GPU, or deviceless from its target description: "
    "no GPU needed): the figures are the target's own",
    "tpu": "compiled by XLA:TPU for this TPU model (on the TPU, or deviceless where libtpu compiles without one): "
    "the figures are the target's own (layouts padded to tiles)",
}
"""What the compiled figures mean, by the backend (``jax.Device.platform``) that compiled them."""


@dataclasses.dataclass(frozen=True)
class AheadOfTimeMemory:
    """Per-device memory of a step compiled ahead of time on abstract inputs (nothing allocated).

    The state and the batch are ``jax.ShapeDtypeStruct`` with their target ``NamedSharding``; XLA's
    ``memory_analysis()`` of the partitioned executable gives one device's figures
    (``jax.stages.Compiled.memory_analysis``). The peak splits exactly into
    ``persistent (params + model_state + optimizer + step) + other_state + batch + temporaries + outputs``.

    Attributes:
        strategy: the step compiled (:data:`MESH_STRATEGIES` but ``"placed"``).
        mesh_shape: ``(("data", 2), ("fsdp", 4))``.
        num_devices: devices the step runs on (1 for ``"replicated"``).
        batch_size: B, the global batch the step was compiled for (split over every mesh axis).
        backend: the platform that compiled it (``"cpu"``, ``"gpu"``, ``"tpu"``) and its device kind.
        backend_note: what that means for the figures (:data:`BACKEND_NOTE`).
        params_bytes, model_state_bytes, optimizer_bytes, step_bytes: the persistent state by category, per
            device (:func:`estimate_memory` with ``mesh=`` of the same placement).
        persistent_bytes: their sum.
        grads_bytes: the gradients' bytes per device in their placement; inside the step they are temporaries
            (counted in ``temp_bytes``), listed for reference.
        argument_bytes, output_bytes, alias_bytes, temp_bytes, generated_code_bytes: XLA's
            ``CompiledMemoryStats`` (``temp``: activations, gradients, gathered parameters, collective buffers).
        data_argument_bytes: one device's block of the batch: ``sum(prod(shape) / num_devices * itemsize)``.
        state_argument_bytes: ``argument_bytes - data_argument_bytes`` (== ``persistent_bytes`` when the
            estimate is exact).
        peak_bytes: ``argument_bytes + output_bytes - alias_bytes + temp_bytes``.
    """

    strategy: str
    mesh_shape: tuple[tuple[str, int], ...]
    num_devices: int
    batch_size: int
    backend: str
    backend_note: str
    params_bytes: int
    model_state_bytes: int
    optimizer_bytes: int
    step_bytes: int
    persistent_bytes: int
    grads_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    data_argument_bytes: int
    state_argument_bytes: int
    peak_bytes: int

    def breakdown(self) -> dict[str, int]:
        """The peak by part, bytes per device, summing to :attr:`peak_bytes` exactly.

        ``params``, ``model_state``, ``optimizer``, ``step`` (persistent), ``other_state`` (state arguments the
        estimate did not place: 0 when it is exact), ``batch``, ``temporaries`` (XLA temp), ``outputs``
        (outputs not written into donated inputs: ``output - alias``).
        """
        return {
            "params": self.params_bytes,
            "model_state": self.model_state_bytes,
            "optimizer": self.optimizer_bytes,
            "step": self.step_bytes,
            "other_state": self.state_argument_bytes - self.persistent_bytes,
            "batch": self.data_argument_bytes,
            "temporaries": self.temp_bytes,
            "outputs": self.output_bytes - self.alias_bytes,
        }

    def to_json(self) -> dict:
        """The fields and the breakdown as a JSON-ready dict."""
        out = dataclasses.asdict(self)
        out["mesh_shape"] = dict(self.mesh_shape)
        out["breakdown"] = self.breakdown()
        return out


def abstract_batch(fn: str, task: Task, batch_size: int | None = None) -> PyTree:
    """The task's first batch as ``jax.ShapeDtypeStruct``, its leading size set to ``batch_size`` (default: its own).

    Nothing is allocated: a batch of any size can be compiled for.
    """
    if batch_size is not None:
        _validate.check_int(fn, "batch_size", batch_size, example="batch_size=1024")
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(
            (int(batch_size) if batch_size is not None else a.shape[0], *a.shape[1:]), a.dtype
        ),
        task.batches[0],
    )


def _check_aot_args(fn, task, mesh, strategy, batch_size) -> None:
    if not isinstance(task, Task):
        raise TypeError(f"{fn}: task must be a shardcheck.Task, got {type(task).__name__}")
    check_mesh(fn, mesh)
    if strategy not in MESH_STRATEGIES[:-1]:
        raise ValueError(
            f"{fn}: strategy={strategy!r} is unknown; use one of {', '.join(MESH_STRATEGIES[:-1])}"
        )
    if batch_size is not None:
        s = data_shards(mesh)
        _validate.check_int(fn, "batch_size", batch_size, example=f"batch_size={8 * s}")
        if not one_device(strategy) and batch_size % s:
            near = s * max(1, round(batch_size / s))
            raise ValueError(
                f"{fn}: batch_size={batch_size} does not split into the mesh's {s} batch shards (the batch is "
                f"split over its axes {batch_axes(mesh)}); pass a multiple of {s}, e.g. {near}"
            )


def compile_ahead_of_time(
    task: Task, mesh: jax.sharding.Mesh, *, strategy: str = "fsdp", batch_size: int | None = None
) -> AheadOfTimeMemory:
    """Lower and compile the strategy's real step of ``task`` on abstract inputs, and read its memory per device.

    The state is ``nnx.eval_shape`` of the task's model and ``nnx.Optimizer`` (:func:`abstract_training_state`),
    the batch ``jax.ShapeDtypeStruct`` of the first batch's leaves with the leading size ``batch_size``
    (:func:`abstract_batch`); each gets its target ``NamedSharding`` (the placement of :func:`estimate_memory`
    with ``mesh=``; the batch split over the mesh's batch axes, :func:`shardcheck.mesh.batch_axes`), and the step of :func:`lower_step` is lowered and compiled
    for them. Nothing of the model or the batch is allocated, so a billion-parameter model compiles on a laptop
    over fake CPU devices (``jax_num_cpu_devices``). The figures equal those of compiling the same step with
    real arrays of the same shapes and shardings.

    Args:
        task: the :class:`~shardcheck.Task`.
        mesh: the mesh (:func:`shardcheck.mesh.make_mesh`); its devices may be fake CPU devices.
        strategy: ``"fsdp"`` (default), ``"gspmd"``, ``"dp"``, ``"zero1"``, ``"zero2"`` or ``"replicated"``.
        batch_size: the global batch B (a multiple of the mesh's batch shards); default the task's first batch's.

    Returns:
        An :class:`AheadOfTimeMemory`, bytes per device, with the backend that compiled it and what that means.

    Raises:
        TypeError: ``task`` or ``mesh`` of the wrong type, ``batch_size`` not an int.
        ValueError: an unknown strategy; ``batch_size`` < 1 or not a multiple of the batch shards; an annotation
            the mesh cannot honour; a backend that gives no ``memory_analysis()``.
    """
    fn = "compile_ahead_of_time"
    _check_aot_args(fn, task, mesh, strategy, batch_size)
    return _compile_prepared(_prepare(fn, task, mesh, strategy), batch_size)


def _prepare(fn: str, task: Task, mesh, strategy: str) -> tuple:
    """What every batch size's compile shares: ``(fn, task, mesh, strategy, model, optimizer, estimate)``.

    The abstract state (``nnx.eval_shape``) and the placement estimate do not depend on the batch: traced once,
    they serve every size compiled (each is a trace of the model, about as long as the step's own).
    """
    model, optimizer = abstract_training_state(fn, task)
    return fn, task, mesh, strategy, model, optimizer, estimate_memory(task, mesh=mesh, strategy=strategy)


def _compile_prepared(prepared: tuple, batch_size: int | None) -> AheadOfTimeMemory:
    """The step of ``prepared`` (:func:`_prepare`) lowered and compiled for ``batch_size`` rows."""
    fn, task, mesh, strategy, model, optimizer, estimate = prepared
    batch = abstract_batch(fn, task, batch_size)
    if not one_device(strategy):
        b, s = jax.tree.leaves(batch)[0].shape[0], data_shards(mesh)
        if b % s:
            raise ValueError(
                f"{fn}: the task's batch of {b} rows does not split into the mesh's {s} batch shards; pass "
                f"batch_size= a multiple of {s}"
            )
    lowered, _, _ = lower_step(strategy, task.loss_fn, model, optimizer, batch, mesh)
    stats = memory_stats(lowered.compile())
    return _aot_memory(strategy, mesh, batch, estimate, stats)


def _aot_memory(strategy, mesh, batch, estimate, stats) -> AheadOfTimeMemory:
    """The :class:`AheadOfTimeMemory` of one compile: the estimate's state by category and XLA's figures."""
    num_devices = 1 if one_device(strategy) else mesh.size
    shards = 1 if one_device(strategy) else data_shards(mesh)  # the batch is replicated over the model axes
    data = sum(math.prod(a.shape) // shards * itemsize(a.dtype) for a in jax.tree.leaves(batch))
    device = mesh.devices.flat[0]
    return AheadOfTimeMemory(
        strategy=strategy,
        mesh_shape=tuple((str(a), int(n)) for a, n in mesh.shape.items()),
        num_devices=num_devices,
        batch_size=int(jax.tree.leaves(batch)[0].shape[0]),
        backend=f"{device.platform} ({device.device_kind})",
        backend_note=BACKEND_NOTE.get(device.platform, f"compiled by XLA for {device.platform}"),
        params_bytes=estimate.params_bytes,
        model_state_bytes=estimate.model_state_bytes,
        optimizer_bytes=estimate.optimizer_bytes,
        step_bytes=estimate.step_bytes,
        persistent_bytes=estimate.persistent_bytes,
        grads_bytes=estimate.grads_bytes,
        argument_bytes=stats["argument_bytes"],
        output_bytes=stats["output_bytes"],
        alias_bytes=stats["alias_bytes"],
        temp_bytes=stats["temp_bytes"],
        generated_code_bytes=stats["generated_code_bytes"],
        data_argument_bytes=data,
        state_argument_bytes=stats["argument_bytes"] - data,
        peak_bytes=stats["peak_bytes"],
    )


def compile_batch_sizes(
    task: Task, mesh: jax.sharding.Mesh, sizes: list[int], *, strategy: str = "fsdp"
) -> dict[int, AheadOfTimeMemory]:
    """:func:`compile_ahead_of_time` at each batch size of ``sizes``, two compiled at once, the state traced once.

    The abstract state and its placement estimate are built once for all sizes; each size's step is traced,
    lowered and compiled on its own (XLA compiles outside the GIL, so two compiles share two cores). The figures
    are those of :func:`compile_ahead_of_time` at each size.

    Args:
        task, mesh, strategy: as :func:`compile_ahead_of_time`.
        sizes: global batch sizes (each a multiple of the mesh's batch shards); repeats are compiled once.

    Returns:
        ``{batch_size: AheadOfTimeMemory}`` for every size of ``sizes``.

    Raises:
        The errors of :func:`compile_ahead_of_time`, for the first size that raises.
    """
    fn = "compile_batch_sizes"
    sizes = list(dict.fromkeys(sizes))
    for b in sizes:
        _check_aot_args(fn, task, mesh, strategy, b)
    if not sizes:
        return {}
    prepared = _prepare(fn, task, mesh, strategy)
    if len(sizes) == 1:
        return {sizes[0]: _compile_prepared(prepared, sizes[0])}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(sizes, pool.map(lambda b: _compile_prepared(prepared, b), sizes), strict=True))


def first_probe_sizes(mesh: jax.sharding.Mesh, strategy: str = "fsdp") -> list[int]:
    """The batch sizes :func:`largest_batch_that_fits` compiles first: ``[n, 2n]``, ``n`` the batch shards.

    Compile them with the report's own size (:func:`compile_batch_sizes`) and pass their peaks as ``known``, so
    the search's first round runs beside the report's compile.
    """
    n = 1 if one_device(strategy) else data_shards(mesh)
    return [n, 2 * n]


MAX_ROWS_PER_SHARD = 2**16
"""The most rows per batch shard :func:`largest_batch_that_fits` compiles by default (65,536: a global batch of
``n * 65,536`` rows). Without a cap a small model's line through its first two peaks predicted 10^7-10^9 rows
for a 16 GiB device, and XLA compiled batches of that size for minutes, constant-folding per-row arrays (trial
49: an MLP with LayerNorm was killed after 120 s, "largest batch that fits: 386933968"). A cap that fits is
reported as a lower bound ("at least", :func:`search_bounds`)."""

SEARCH_SECONDS = 60.0
"""The CLI's wall-time budget of the largest-batch search after the report's compile, seconds: a round (one or
two compiles) starts only while the time spent so far plus the last round's time is within it (issue #35 asks for
an answer within a minute); an answer cut short is a bound, said so (:func:`search_bounds`)."""


def largest_batch_that_fits(
    task: Task,
    mesh: jax.sharding.Mesh,
    device_memory_bytes: int,
    *,
    strategy: str = "fsdp",
    max_compiles: int = 8,
    known: dict[int, int] | None = None,
    max_batch_size: int | None = None,
    time_budget_s: float | None = None,
    progress: Callable[[list[int], float], None] | None = None,
) -> tuple[int, dict[int, int]]:
    """The largest global batch whose step fits ``device_memory_bytes`` per device, found by compiling it.

    Batches are multiples of ``n``, the mesh's batch shards (:func:`shardcheck.mesh.data_shards`; one row per
    shard at least; ``n = 1`` for ``"replicated"``), up to ``max_batch_size``. The step is compiled ahead of time
    (:func:`compile_ahead_of_time`) at ``n`` and ``2n``. A step's peak is affine in the batch for a fixed program
    shape (the state is fixed; activations and the batch grow by the row), so the line through the two largest
    fitting peaks predicts the largest fitting multiple of ``n``; it is compiled with the next multiple above it
    (the cap alone, where the line crosses above the cap). Once a size fails, the line through the largest fitting
    and the smallest failing peak predicts again (regula falsi over multiples of ``n``), until the two are ``n``
    apart; the two sizes of each round compile at once (:func:`compile_batch_sizes`: XLA compiles outside the GIL,
    the abstract state is traced once), the size above left out when it could only confirm a failure, at most
    ``max_compiles`` compiles in all (``known`` peaks are not compiled again: the CLI compiles
    :func:`first_probe_sizes` beside the report's own size and passes them). The answer is exact within the
    sizes tried where the next multiple of ``n`` above it was compiled and does not fit; it is a lower bound where
    the cap fits, or the compile or time budget ran out first (:func:`search_bounds` tells which). The 1b tiny-lm
    for an H100 target (deviceless) takes 5 compiles in three rounds beside the report's own
    (tests/test_memory_aot.py replays its peaks).

    Args:
        task, mesh, strategy: as :func:`compile_ahead_of_time` (``mesh`` may be a target GPU's,
            :func:`shardcheck.gpu_target.target_mesh`).
        device_memory_bytes: one device's memory, bytes.
        max_compiles: the most compiles, >= 1.
        known: ``{batch_size: peak_bytes}`` already compiled for this task, mesh and strategy (e.g. the
            report's own compile), reused.
        max_batch_size: the largest global batch compiled (rows), rounded down to a multiple of ``n``, at least
            ``n``; default ``n *`` :data:`MAX_ROWS_PER_SHARD`.
        time_budget_s: wall seconds; a round starts only while the seconds spent plus the last round's are
            within it (the first round always runs). None: no time limit.
        progress: called before each round that compiles, with its sizes and the seconds spent so far.

    Returns:
        ``(batch_size, peaks)``: the largest fitting batch (0 when even ``n`` rows do not fit: the state alone,
        or one row's activations, is too large) and ``{batch_size: peak_bytes}`` of every size compiled (or
        known and used).

    Raises:
        The errors of :func:`compile_ahead_of_time`; ValueError: ``max_compiles`` < 1.
    """
    fn = "largest_batch_that_fits"
    _validate.check_int(fn, "max_compiles", max_compiles, example="max_compiles=8")
    n = 1 if one_device(strategy) else data_shards(mesh)
    cap = max(n, (max_batch_size or n * MAX_ROWS_PER_SHARD) // n * n)
    known = dict(known or {})
    peaks: dict[int, int] = {}
    clock = {"start": time.monotonic(), "round": 0.0, "compiles": 0}

    def compile_all(sizes: list[int]) -> None:
        """The peaks of ``sizes`` not known yet, two compiled at once (XLA compiles outside the GIL)."""
        todo = [b for b in dict.fromkeys(sizes) if b not in peaks and b not in known]
        todo = todo[: max_compiles - clock["compiles"]]
        peaks.update({b: known[b] for b in sizes if b in known})
        if todo:
            began = time.monotonic()
            if progress is not None:
                progress(todo, began - clock["start"])
            found = compile_batch_sizes(task, mesh, todo, strategy=strategy)
            peaks.update({b: found[b].peak_bytes for b in todo})
            clock["round"] = time.monotonic() - began
        clock["compiles"] += len(todo)

    def budget() -> bool:
        spent = time.monotonic() - clock["start"]
        in_time = time_budget_s is None or spent + clock["round"] <= time_budget_s
        return clock["compiles"] < max_compiles and in_time

    compile_all([b for b in first_probe_sizes(mesh, strategy) if b <= cap] if max_compiles > 1 else [n])
    compile_all([n])
    if peaks[n] > device_memory_bytes:
        return 0, {n: peaks[n]}
    while True:
        good = max(b for b, p in peaks.items() if p <= device_memory_bytes)
        bad = min((b for b, p in peaks.items() if p > device_memory_bytes and b > good), default=None)
        if (bad is not None and bad - good <= n) or good >= cap or not budget():
            return good, peaks
        sizes = [min(b, cap) for b in _next_sizes(peaks, good, bad, n, device_memory_bytes)]
        compile_all([b for b in dict.fromkeys(sizes) if b not in peaks])


def search_bounds(largest: int, peaks: dict[int, int], device_memory_bytes: int, step: int) -> dict:
    """Whether :func:`largest_batch_that_fits`'s answer is exact or a lower bound, for the report and ``--json``.

    Args:
        largest, peaks: its answer (rows) and ``{batch_size: peak_bytes}``.
        device_memory_bytes: the memory it searched for, bytes.
        step: ``n``, the batch shards (:func:`first_probe_sizes`'s first size).

    Returns:
        ``{"largest_batch_size": largest, "largest_batch_is_lower_bound": bool, "smallest_failing_batch_size":
        int | None}``: a lower bound unless ``largest`` is 0 or ``largest + step`` was compiled and does not fit
        (every size compiled fits: the cap or the budget stopped the search; or the budget stopped it between a
        fitting and a failing size more than ``step`` apart); the smallest compiled size above ``largest`` that
        does not fit, None where none was compiled.
    """
    failing = [b for b, p in peaks.items() if p > device_memory_bytes and b > largest]
    above = peaks.get(largest + step)
    exact = largest == 0 or (above is not None and above > device_memory_bytes)
    return {
        "largest_batch_size": largest,
        "largest_batch_is_lower_bound": not exact,
        "smallest_failing_batch_size": min(failing, default=None),
    }


def _next_sizes(peaks: dict[int, int], good: int, bad: int | None, n: int, memory: int) -> list[int]:
    """The next two batch sizes to compile: the multiple of ``n`` where a line from the largest fitting peak
    crosses ``memory``, and the multiple above it. When none fails yet the line is the steepest seen between
    consecutive fitting sizes (XLA:GPU rematerializes as a step nears its target's memory, which flattens the
    last peaks: their slope would overshoot); otherwise it runs through the smallest failing peak. The size above
    is left out when the crossing is the next multiple and even the latest slope (the flattest likely) has it
    fail: it would be compiled only to be discarded (a failing XLA:GPU compile is the slowest, remat trying)."""
    if bad is None:
        fit = [b for b in sorted(peaks) if peaks[b] <= memory]
        slopes = [(peaks[b] - peaks[a]) / (b - a) for a, b in zip(fit, fit[1:], strict=False)]
        slope = max(slopes, default=0.0)
        if slope <= 0:
            return [2 * good]
        guess = max(good + n, good + int((memory - peaks[good]) / slope / n) * n)
        if guess == good + n and slopes and peaks[good] + slopes[-1] * n > memory:
            return [
                guess
            ]  # even the latest slope says it fails: the size above it would be compiled for nothing
        return [guess, guess + n]
    slope = (peaks[bad] - peaks[good]) / (bad - good)
    guess = good + int((memory - peaks[good]) / slope / n) * n if slope > 0 else (good + bad) // (2 * n) * n
    guess = min(max(guess, good + n), bad - n)
    return [guess, guess + n] if guess + n < bad else [guess]
