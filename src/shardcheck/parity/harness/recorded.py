"""Recorded runs: a run's per-step digests, saved small enough to commit, and a replay compared with them.

:func:`record_run` runs a strategy (or a user's step) on a task for N steps and keeps, after every step, the
digest of every leaf (:mod:`shardcheck.parity.comparison.leaf_digest`: shape, dtype, sharding, L2 norm, ``max|x|``, the update
size of each parameter, 8 fixed-index samples and a sha256) of the loss, the gradients (when the step returns
them), the parameters, the optimizer state and the integer counters, and which replicated leaves' copies differ
across the devices (``meta["replicas"]``, :func:`replica_evidence`: a digest hashes one copy of each slice).
:meth:`Recording.save` writes them as one
``.npz`` (NumPy only, no pickles) with a JSON metadata string; :func:`load_recording` reads one back and refuses a
file that is not one, or that another task, mesh or data made (:func:`check_replayable`).

A recording is a kind of reference: ``check_parity(candidate, task, reference=recording)``
(:mod:`shardcheck.parity.harness.replay`; ``shardcheck verify --against FILE``) replays the candidate with
:func:`record_run`, whose step call is the harness's own (:func:`~shardcheck.parity.harness.candidates.run_step`)
and whose admission is the harness's (:mod:`shardcheck.parity.harness.setup`), and compares the two runs digest
by digest (``shardcheck.parity.comparison.digest``) within the parity harness's own derived tolerances: across
machines and XLA versions never bitwise; the hashes only say "bitwise identical" where every one matched. The
comparison's records are the live check's, diagnosed by the same rules.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import platform
import zipfile
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardcheck import _validate
from shardcheck.parity.comparison import leaf_digest as _digest
from shardcheck.parity.comparison.live import (
    device_snapshot,
    flatten_state,
    replica_mismatches,
    replicated_leaves,
)
from shardcheck.parity.comparison.model_state import PREFIX as MODEL_PREFIX
from shardcheck.parity.comparison.model_state import floating_arrays, loss_access, loss_counters, model_state
from shardcheck.parity.comparison.rng_counts import rng_count_arrays
from shardcheck.parity.diagnosis.topology import mismatch_axes
from shardcheck.parity.harness.candidates import as_candidate, run_step
from shardcheck.parity.harness.optimizer_rerun import checks_step, pre_update, recorded_update_check
from shardcheck.parity.harness.row_coupling import float32_model
from shardcheck.parity.harness.setup import (
    _check_rows,
    _check_state_carried,
    _check_strategy,
    _memo,
    _task_batches,
    check_options,
)
from shardcheck.parity.harness.true_gradients import (
    Peaks,
    keep_least,
    keep_noise,
    rounding_noise,
    true_gradient_digest,
)
from shardcheck.parity.harness.true_gradients import keep as keep_true_gradients
from shardcheck.parity.tolerance import matmul
from shardcheck.parity.tolerance.loss_drift import LossDrift
from shardcheck.parity.tolerance.precision import Precision, float32_compute, traced_compute_dtype
from shardcheck.parity.tolerance.propagation import normalized_leaves, update_signature
from shardcheck.steps import STRATEGIES, Candidate
from shardcheck.steps.registry import mesh_for
from shardcheck.steps.sharded_init import sharded_training_state
from shardcheck.task import Task, check_model

FORMAT = "shardcheck-recording"
"""The ``format`` field of a recording's metadata."""

VERSION = 1
"""The recording format this shardcheck writes and reads."""

KINDS = ("loss", "grad", "opt_state", "param", "state", "counter")
"""The kinds of a recorded leaf, in the order a step computes them: the first failing leaf of a step is the first
of these kinds (the worst leaf of it)."""

_BLOCKS = ("initial", "steps")
_FIELDS = ("present", "sharding", "norm", "max", "update", "samples", "sha256")


@dataclasses.dataclass(frozen=True)
class Digests:
    """The digests of L leaves at R points: the initial state (R = 1) or the steps (R = T).

    Attributes:
        present: ``(R, L)`` bool: the leaf was digested there (a step's gradients only when it returned them).
        sharding: ``(R, L)`` str: each leaf's ``PartitionSpec`` text (``_digest.spec_text``).
        norm: ``(R, L)`` float64: the L2 norm (float32 arithmetic on the devices).
        max: ``(R, L)`` float64: ``max|x|`` (exact).
        update: ``(R, L)`` float64: ``max|x_t - x_{t-1}|`` of the parameters (float32 arithmetic), NaN elsewhere.
        samples: ``(R, L, 8)`` float64: the elements at ``Recording.sample_index`` (NaN where none).
        sha256: ``(R, L, 32)`` uint8: the hash of this process's shards' bytes in index order.
    """

    present: np.ndarray
    sharding: np.ndarray
    norm: np.ndarray
    max: np.ndarray
    update: np.ndarray
    samples: np.ndarray
    sha256: np.ndarray

    @staticmethod
    def of(rows: Sequence[Mapping[str, _digest.LeafDigest]], names: Sequence[str]) -> Digests:
        """The rectangular arrays of ``rows`` (one ``{name: LeafDigest}`` per point) over ``names``."""
        r, n, k = len(rows), len(names), _digest.SAMPLES
        out = Digests(
            np.zeros((r, n), bool),
            np.full((r, n), "", dtype=object),
            np.full((r, n), np.nan),
            np.full((r, n), np.nan),
            np.full((r, n), np.nan),
            np.full((r, n, k), np.nan),
            np.zeros((r, n, _digest.HASH_BYTES), np.uint8),
        )
        for i, row in enumerate(rows):
            for j, name in enumerate(names):
                d = row.get(name)
                if d is None:
                    continue
                out.present[i, j] = True
                out.sharding[i, j] = d.sharding
                out.norm[i, j], out.max[i, j], out.update[i, j] = d.norm, d.max, d.update
                out.samples[i, j], out.sha256[i, j] = d.samples, d.sha256
        return dataclasses.replace(out, sharding=out.sharding.astype(str))


@dataclasses.dataclass(frozen=True)
class Recording:
    """A recorded run: the digests of every leaf at every step, and what made them.

    Attributes:
        meta: the JSON metadata: ``format``, ``version``, ``task``, ``run`` (the strategy's name or the user step's),
            ``run_kind`` (``"strategy"`` or ``"candidate"``), ``num_shards``, ``micro_batches`` (k of a step with an
            optimizer of its own, which it steps once per k micro-batches; ``None`` or absent otherwise), ``mesh`` (``{axis: size}`` or
            ``None``), ``steps``, ``fingerprint`` (sha256 of ``state_leaves`` and ``batches``' shapes),
            ``state_leaves`` (``[name, shape, dtype]`` of the task's parameters, optimizer state and counters),
            ``batches`` (per step its leaves' ``[path, shape, dtype]`` and the sha256 of its data), ``terms`` (the
            reduction length of each batch, for the tolerance), ``tolerance_dtype``, ``settings`` (the caller's:
            optimizer, lr, seed ... when known), ``versions`` (jax, jaxlib, flax, optax, shardcheck),
            ``platform``, ``matmul_precision`` (the precision of the run's float32 matmuls:
            ``shardcheck.parity.tolerance.matmul``; absent from recordings made before it was stored: float32),
            ``compute_dtype`` (the least precise compute dtype of the model's layers, read as a live check reads
            it; absent from older recordings: the replay's own stands),
            ``normalized`` (the parameters whose update the task's optimizer normalizes, :func:`normalized_params`;
            absent from older recordings: read as every parameter), ``drawn`` (the RNG streams the forward pass
            draws from, ``["rngs.noise"]``, whose counts are recorded as ``"counter model.rngs.noise.count"``;
            absent from older recordings: no count compared), ``floating_read`` and ``floating_written`` (the
            dotted paths of the model's floating state the task's loss reads and its forward pass writes,
            :func:`~shardcheck.parity.comparison.model_state.loss_access`; ``None`` where undecidable; absent
            from older recordings: the replayed run's stand), ``counters_touched`` (the dotted paths of the
            model's integer state the task's loss reads or writes,
            :func:`~shardcheck.parity.comparison.model_state.loss_counters`; ``None`` where undecidable; absent
            from older recordings: every counter counts as the forward pass's).
        names: the L leaf names: ``"loss"``, ``"grad <path>"``, ``"param <path>"``, ``"opt_state <path>"``,
            ``"counter <path>"`` (integer leaves; ``"counter step"`` the optimizer's step).
        shapes: each leaf's shape; dtypes: each leaf's dtype name.
        sample_index: ``(L, 8)`` int64: the flat indices each leaf's samples are taken at (``-1``: none).
        initial: the :class:`Digests` of the state before step 0 (R = 1).
        steps: the :class:`Digests` after each step (R = T).
    """

    meta: dict
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    sample_index: np.ndarray
    initial: Digests
    steps: Digests

    @property
    def num_steps(self) -> int:
        """T, the recorded steps."""
        return int(self.steps.present.shape[0])

    def to_bytes(self) -> bytes:
        """The ``.npz`` file's bytes (compressed; every array numeric or str, no pickles). The metadata's
        ``checksum`` is the sha256 of every other array and of the rest of the metadata (:func:`checksum`), so a
        damaged or edited digest is refused on loading rather than read as another run."""
        arrays = {
            "names": np.array(self.names, dtype=str),
            "sample_index": self.sample_index,
        }
        leaves = [[n, list(s), d] for n, s, d in zip(self.names, self.shapes, self.dtypes, strict=True)]
        arrays["leaves"] = np.array(json.dumps(leaves))
        for block in _BLOCKS:
            for field in _FIELDS:
                arrays[f"{block}_{field}"] = getattr(getattr(self, block), field)
        meta = {k: v for k, v in self.meta.items() if k != "checksum"}
        meta["checksum"] = checksum(meta, arrays)
        arrays["meta"] = np.array(json.dumps(meta, sort_keys=True))
        buffer = io.BytesIO()
        np.savez_compressed(buffer, **arrays)
        return buffer.getvalue()

    def save(self, path: str | Path) -> int:
        """Write the recording to ``path`` (whole, through a temp file and a rename); returns its size in bytes.

        Raises:
            TypeError: ``path`` not a str or ``os.PathLike``.
            ValueError: as :func:`check_out_path`: a directory, a name not ending in ``.npz``, an existing file
                that is not a recording (never overwritten); a run that went non-finite (a NaN or an infinity in
                its loss, gradients, parameters or optimizer state at some step: no reference from there, as
                ``shardcheck record`` refuses it; :func:`~shardcheck.parity.harness.non_finite.refusal` names the
                step and leaves, and ``record_run(..., steps=t)`` keeps the finite steps before it). A step whose
                loss and gradients alone are not finite, its parameters exactly as they were, is one its optimizer
                skipped (``optax.apply_if_finite``), and is saved.
            OSError: the file cannot be written (no permission, a missing folder's parent a file).
        """
        from shardcheck._io import write_atomic
        from shardcheck.parity.harness.non_finite import first_non_finite, refusal

        check_out_path("Recording.save", path)
        diverged = first_non_finite(self)
        if diverged is not None:
            raise ValueError(
                refusal("Recording.save", diverged, str(path), keep="record_run(..., steps={t})")
            )
        data = self.to_bytes()
        try:
            write_atomic(Path(path), data)
        except OSError as err:
            raise OSError(f"Recording.save: {str(path)!r} cannot be written: {err.strerror or err}") from err
        return len(data)


def is_recording_file(path: Path) -> bool:
    """Whether ``path`` is an ``.npz`` holding a recording's arrays (its contents not checked)."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False
    return {"meta.npy", "names.npy", "steps_norm.npy"} <= names


def check_out_path(fn: str, path, shown: str | None = None) -> None:
    """Refuse a path a recording must not be written to, before any work: not a str or path, a directory, a name
    not ending in ``.npz``, or an existing file that is not a recording (a source file, a data set: never
    overwritten; an older recording is).

    Raises:
        TypeError: ``path`` not a str or ``os.PathLike``.
        ValueError: one line naming ``shown`` (default: the path) and the fix.
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(
            f"{fn}: path must be a str or os.PathLike, got {type(path).__name__}; pass e.g. 'run.npz'"
        )
    target = Path(path)
    shown = f"path {str(path)!r}" if shown is None else shown
    if target.is_dir():
        raise ValueError(
            f"{fn}: {shown} is a directory; pass a file path such as {str(target / 'run.npz')!r}"
        )
    if target.suffix != ".npz":
        raise ValueError(
            f"{fn}: {shown} does not end in .npz (a recording is an .npz file); pass e.g. "
            f"{str(target.with_suffix('.npz'))!r}"
        )
    if target.exists() and not is_recording_file(target):
        raise ValueError(
            f"{fn}: {shown} exists and is not a shardcheck recording, so it is not overwritten; pass "
            "another path"
        )


def checksum(meta: Mapping, arrays: Mapping[str, np.ndarray]) -> str:
    """sha256 (hex) of ``meta`` without its ``checksum`` (sorted JSON) and of every array but ``meta`` (by name:
    its dtype, shape and bytes)."""
    h = hashlib.sha256(
        json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True).encode()
    )
    for key in sorted(k for k in arrays if k != "meta"):
        a = np.ascontiguousarray(arrays[key])
        h.update(f"{key} {a.dtype.str} {a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ recording


def _kind(a) -> str:
    """``"counter"`` for an integer (or boolean) optimizer-state leaf, else ``"opt_state"``."""
    dtype = getattr(a, "dtype", None)
    try:
        integer = np.dtype(dtype).kind in "iub"
    except TypeError:  # a PRNG key's dtype
        integer = False
    return "counter" if integer else "opt_state"


def state_leaves(model: nnx.Module, optimizer: nnx.Optimizer, view=None) -> dict[str, Any]:
    """``{name: leaf}`` of the parameters, the optimizer state and the counters (names as :class:`Recording`'s).

    ``view``: a candidate's ``view_optimizer`` (``optimizer -> (state as the task's optimizer's, update
    count)``), where it steps an optimizer of its own: its state and count are recorded as the task's optimizer's
    would be (``"opt_state 0.mu.w"``, ``"counter step"``), what a live check compares. Works on concrete and
    abstract (``nnx.eval_shape``) state alike.
    """
    out = {f"param {p}": a for p, a in flatten_state(nnx.state(model, nnx.Param)).items()}
    if view is not None:
        state, count = view(optimizer)
        out["counter step"] = jnp.asarray(count, optimizer.step[...].dtype)  # an nnx.Optimizer's step dtype
        return out | {f"{_kind(a)} {p}": a for p, a in flatten_state(state).items()}
    for path, a in flatten_state(nnx.state(optimizer)).items():
        if path == "step":
            out["counter step"] = a
            continue
        path = path.removeprefix("opt_state.")
        out[f"{_kind(a)} {path}"] = a
    return out


def _leaf_list(leaves: Mapping[str, Any]) -> list[list]:
    return [[name, [int(d) for d in np.shape(a)], str(jnp.dtype(a.dtype))] for name, a in leaves.items()]


def _batch_facts(batch) -> dict:
    """A batch's leaves ``[path, shape, dtype]`` and the sha256 of its data (host arrays, C order)."""
    h = hashlib.sha256()
    shapes = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        a = np.asarray(leaf)
        shapes.append([jax.tree_util.keystr(path), list(a.shape), str(a.dtype)])
        h.update(a.tobytes())  # C order
    return {"leaves": shapes, "sha256": h.hexdigest()}


def fingerprint(leaves: list[list], batches: list[dict]) -> str:
    """sha256 (hex) of the state's leaves (names, shapes, dtypes) and the batches' shapes and dtypes."""
    shapes = [b["leaves"] for b in batches]
    return hashlib.sha256(json.dumps([leaves, shapes]).encode()).hexdigest()


def task_facts(fn: str, task: Task, data: Sequence) -> dict:
    """The metadata that identifies a task's run before it starts: the state's leaves (from the abstract state,
    nothing allocated), the batches' shapes and data hashes, the reduction lengths, the fingerprint and the
    tolerance dtype (the parameters' least precise floating dtype, float32 when that is less precise)."""
    from shardcheck.memory.state import abstract_training_state

    model, optimizer = abstract_training_state(fn, task)
    leaves = _leaf_list(state_leaves(model, optimizer))
    batches = [_batch_facts(b) for b in data]
    params = [jnp.dtype(d) for n, _, d in leaves if n.startswith("param ")]
    params = [d for d in params if jnp.issubdtype(d, jnp.floating)] or [jnp.dtype(jnp.float32)]
    least = max(params, key=lambda d: float(jnp.finfo(d).eps))
    if jnp.finfo(least).eps > jnp.finfo(jnp.float32).eps:
        least = jnp.dtype(jnp.float32)  # low-precision parameters accumulate in float32 (precision.py)
    return {
        "task": task.name,
        "state_leaves": leaves,
        "batches": batches,
        "terms": [task.terms(b) for b in data],
        "fingerprint": fingerprint(leaves, batches),
        "tolerance_dtype": str(least),
    }


def _versions() -> dict:
    from shardcheck import __version__

    out = {"shardcheck": __version__}
    for package in ("jax", "jaxlib", "flax", "optax"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out


def _platform(mesh=None) -> dict:
    """Where the run ran: the mesh's devices (a CPU mesh on a GPU host records ``cpu``), else the default
    device's platform; ``host_backend`` is JAX's default backend."""
    from shardcheck.devices import _host_platform, _platform_devices, preferred_platform

    if mesh is not None:
        devices = list(mesh.devices.flat)
    else:
        devices = _platform_devices(preferred_platform())
    device = devices[0]
    return {
        "backend": device.platform,
        "host_backend": _host_platform(),
        "device_kind": device.device_kind,
        "devices": len(devices),
        "processes": jax.process_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def _start(fn, task, candidate, steps, num_shards, mesh, name):
    """``(model, optimizer, batches, Candidate, mesh, drawn)`` of a recorded run, after every check; the state of
    a mesh strategy is created directly in its placement (never whole on one device); ``drawn``: the RNG streams
    the forward pass draws from (``"rngs.noise"``: :func:`~shardcheck.task.check_model`)."""
    if not isinstance(task, Task):
        raise TypeError(f"{fn}: task must be a shardcheck.Task, got {type(task).__name__}")
    data = _task_batches(fn, task, steps)
    strategy = STRATEGIES.get(candidate) if isinstance(candidate, str) else None
    if strategy is not None and num_shards is not None:
        mesh = mesh_for(fn, strategy, num_shards, mesh) if strategy.uses_mesh else mesh
    cand = as_candidate(fn, candidate, task, num_shards, mesh, name)
    if strategy is not None and strategy.uses_mesh:
        model, optimizer = sharded_training_state(fn, task, candidate, mesh)
    else:
        model = task.new_model(fn)
        optimizer = task.new_optimizer(model)
    # the non-parameter state the forward pass writes and the RNG streams it draws: refused as the live check does
    updated: list[str] = []
    drawn: list[str] = []
    weighted = check_model(fn, model, task.loss_fn, data[0], updated=updated, drawn=drawn, batch_stats=True)
    _check_strategy(fn, candidate, cand, model, optimizer, mesh, data, weighted)
    _check_state_carried(fn, candidate, updated, drawn, model)
    # probed in float32 compute, as a live check probes it (setup._rows_coupled)
    graphdef32 = float32_compute(*nnx.split(model, nnx.Param, ...))
    _check_rows(
        fn, candidate, cand, float32_model(model, graphdef32), task, data[0], 0.0, graphdef32 is not None
    )
    if cand.make_optimizer is not None:
        optimizer = cand.make_optimizer(model, optimizer)
    return model, optimizer, data, cand, mesh, tuple(drawn)


def _step_leaves(loss, grads, model, optimizer, view=None, drawn=()) -> dict[str, Any]:
    """A step's leaves: the loss, the gradients, the state (through ``view``: :func:`state_leaves`), the
    integer model state the forward pass writes (``"counter model.calls"``) and the count of each RNG stream it
    draws from (``drawn``: ``"counter model.rngs.noise.count"``), compared exactly as live."""
    leaves = {} if loss is None else {"loss": loss}
    if grads is not None:
        leaves.update({f"grad {p}": g for p, g in flatten_state(grads).items()})
    written = {f"counter {MODEL_PREFIX}{p}": a for p, a in model_state(model).items()}
    written |= {f"counter {MODEL_PREFIX}{s}.count": c for s, c in rng_count_arrays(model, drawn).items()}
    return leaves | state_leaves(model, optimizer, view) | floating_leaves(model) | written


def replica_evidence(leaves: Mapping[str, Any]) -> dict[str, Any]:
    """Whether the copies of each replicated leaf of a step agree across this process's devices, as a live check
    compares them (:func:`~shardcheck.parity.comparison.live.replica_mismatches`, bitwise): a digest hashes one
    copy of each slice, so a step that writes a replicated leaf on some devices only (an EMA written on device 0,
    ``check_vma=False``) would hash as the recording's.

    Args:
        leaves: ``{name: array}`` of one step (:func:`_step_leaves`: ``"param <path>"``, ``"grad <path>"``, ...).

    Returns:
        ``{"leaves": [...], "grads": [...], "axes": [...]}``: the parameters, optimizer-state, model-state and
        counter leaves whose copies differ (in ``leaves``' order); the gradients whose copies differ, only where
        none of those does (a live check reads a failing step's returned gradients so); the mesh axes the copies
        differ along (:func:`~shardcheck.parity.diagnosis.topology.mismatch_axes`); ``compared`` and
        ``devices``: how many of the state leaves (not the gradients) hold copies on several devices, and across
        how many devices (:func:`~shardcheck.parity.comparison.live.replicated_leaves`). Empty lists where every
        copy agrees, or on one device.
    """
    arrays = {n: _digest.as_array(a) for n, a in leaves.items() if n != "loss"}
    state = {n: a for n, a in arrays.items() if not n.startswith("grad ")}
    differ = replica_mismatches(state)
    named = [n for n in state if n in differ]
    grads = {n: a for n, a in arrays.items() if n.startswith("grad ")} if not named else {}
    differ_g = replica_mismatches(grads) if grads else set()
    named_g = [n for n in grads if n in differ_g]
    axes = sorted({ax for n in named or named_g for ax in mismatch_axes(arrays[n])})
    compared, devices = replicated_leaves(state)
    return {"leaves": named, "grads": named_g, "axes": axes, "compared": compared, "devices": devices}


def floating_leaves(model: nnx.Module) -> dict[str, Any]:
    """``{"state model.<path>": array}``: the model's floating state beside its parameters (a frozen weight in a
    Variable class of one's own), recorded with its update size as a parameter is, so that a replay compares it
    (:mod:`shardcheck.parity.comparison.model_state`)."""
    return {f"state {MODEL_PREFIX}{p}": a for p, a in floating_arrays(model).items()}


def _run_name(candidate, cand: Candidate) -> tuple[str, str]:
    """The recorded run: a strategy by its registered name (what a replay runs), a user step by ``name``."""
    if isinstance(candidate, str):
        return candidate, "strategy"
    return cand.name, "candidate"


def record_run(
    task: Task,
    candidate: str | Candidate | Any,
    *,
    steps: int | None = None,
    num_shards: int | None = None,
    mesh=None,
    name: str | None = None,
    settings: Mapping[str, Any] | None = None,
    matmul_precision: str | None = None,
    true_gradients: bool = False,
    update_checks: list | None = None,
    compute_dtype=None,
) -> Recording:
    """Run ``candidate`` on ``task`` for ``steps`` steps and digest every leaf after each one.

    The state starts fresh: for a registered mesh strategy (``dp``, ``fsdp``, ``gspmd``, ``multiprocess``)
    created directly in its placement on ``mesh`` (:func:`~shardcheck.steps.sharded_init.sharded_training_state`:
    never whole on one device), else ``task.new_model()`` and ``task.new_optimizer`` (wrapped by a Candidate's
    ``make_optimizer``). Each step is the strategy's step
    (``STRATEGIES[name].build(task.loss_fn, S, mesh).step(model, optimizer, batch)``, which returns the loss and
    the gradients it applied) or the user's (its loss, and its gradients when it returns ``{"loss", "grads"}``).
    Digested (:mod:`shardcheck.parity.comparison.leaf_digest`): the initial state, then after every step the loss, the gradients,
    every parameter (with its update size), every optimizer-state leaf and every integer counter (a Candidate's
    own optimizer through its ``view_optimizer``, as the task's optimizer's state and count, what a live check
    compares), and every integer model state the forward pass writes (``"counter model.calls"``).

    Args:
        task: the :class:`~shardcheck.Task`.
        candidate: a registered strategy's name (needs ``num_shards`` or ``mesh``), a
            :class:`~shardcheck.Candidate`, or a user step ``(model, optimizer, batch[, mesh])`` updating both in
            place (as :func:`~shardcheck.check_parity` takes it).
        steps: how many of the task's batches to run (default: all).
        num_shards: S, the batch shards (default: the mesh's batch shards).
        mesh: the mesh of a mesh strategy (default: the first S devices), passed to a step that takes ``mesh``.
        name: a user step's name in the recording (default: the step function's); a strategy is recorded by its
            registered name, the one a replay runs.
        settings: JSON-able facts of the run to keep in the metadata (``optimizer``, ``lr``, ``seed`` ...):
            a replay whose settings differ from these is told so (``settings_differ``).
        matmul_precision: the precision of the run's float32 matmuls, stored in the metadata (``"float32"``,
            ``"tf32"``, ``"bfloat16"``; default: what the backend uses for the task's step:
            ``shardcheck.parity.tolerance.matmul``); a replay is compared within the looser of the two runs'.
        true_gradients: where the step returns no gradients, also keep ``max|g|`` and the L2 norm of the task's
            own gradient before each step (:mod:`shardcheck.parity.harness.true_gradients`, one more forward and
            backward pass a step) in ``meta["true_gradients"]``: what tells a parameter whose gradient is at
            rounding level, as a live check reads it from the reference's (a replay asks for it); and at every
            step the least of each parameter's elementwise largest ``|g|`` so far (``"least"``: a leaf only part of
            whose gradient is at rounding level), from the gradients the step returns, else the task's; and at
            a compute dtype coarser than float32, at every step each parameter's true gradient's ``max|g|``
            with every layer computing in float32 (``"true32"``: within ``atol_t`` of 0, its gradient is at
            rounding level) and its gradient's compute noise (``"noise"``, the live check's measure, what such a
            gradient is compared within: :func:`~shardcheck.parity.harness.true_gradients.rounding_noise`); and
            the live check's loss drift of each step from the run's own gradients and state
            (``meta["loss_drift"]``, :class:`~shardcheck.parity.tolerance.loss_drift.LossDrift`), which the
            digest comparison adds to the loss's tolerance.
        update_checks: a list to collect the update check of the steps in (a replay passes one): at each step
            until one fails it, the task's optimizer rerun on the gradients the step returned and its state
            before the step, against its state after it, at the optimizer's own rounding
            (:func:`~shardcheck.parity.harness.optimizer_rerun.recorded_update_check`); the first failing step's
            ``(step, leaves, arrays)`` is appended. ``None``: not checked.
        compute_dtype: the compute dtype the tolerance assumes, in place of the one read from the model's layers
            as a live check reads it (:meth:`~shardcheck.parity.tolerance.precision.Precision.of`: the least
            precise layer ``dtype``); stored as ``meta["compute_dtype"]``: a replay is compared within the looser
            of the two runs' compute rounding.

    Returns:
        The :class:`Recording` (in memory; :meth:`Recording.save` writes it).

    Raises:
        TypeError: ``task`` not a Task; a candidate that is no name, Candidate or step of the right signature; a
            step returning no scalar loss, None or ``{"loss", "grads"}``.
        ValueError: as :func:`~shardcheck.check_parity` before any step: an unknown strategy, ``steps`` beyond the
            task's batches, a batch that does not split into S shards, a model with batch statistics or random
            draws with a strategy that runs the forward pass per shard or per micro-batch.
        TypeError: ``settings`` not a mapping of str to JSON values.
        CandidateError: the step raised (the original error is its ``__cause__``).
    """
    fn = "record_run"
    settings = _check_settings(fn, settings)
    matmul_precision = matmul.check_policy(fn, matmul_precision)
    _check_name(name)
    num_shards = check_options(fn, rtol=None, atol=None, accept_weak=False, mesh=mesh, num_shards=num_shards)
    model, optimizer, data, cand, mesh, drawn = _start(fn, task, candidate, steps, num_shards, mesh, name)
    # the floating state the loss reads and the state its forward pass writes, the counters it touches (before
    # any step)
    touched = _loss_touches(task.loss_fn, model, data[0])
    policy, compute = _precision(fn, task, model, data[0], mesh, matmul_precision, compute_dtype)
    kwargs = {"mesh": mesh} if cand.pass_mesh else {}
    indices: dict[str, np.ndarray] = {}

    def digest(leaves, before):
        for leaf_name, a in leaves.items():
            if leaf_name not in indices:
                indices[leaf_name] = _digest.sample_indices(leaf_name, tuple(np.shape(a)))
        return _digest.digest_leaves(leaves, before, indices)

    # a wrapped optimizer as the task's, as live; the floating model state beside the parameters
    first = state_leaves(model, optimizer, cand.view_optimizer) | floating_leaves(model)
    shapes = _leaf_list(first)
    rows, truth, least, noise, replicas = [], {}, {}, {}, []
    returned = isinstance(candidate, str)  # a registered strategy returns the gradients it applied
    peaks = Peaks() if true_gradients else None
    drift = LossDrift(task.optimizer) if true_gradients else None  # the live check's loss drift, by step
    initial = digest(first, {})
    for t, batch in enumerate(data):
        before = {f"param {p}": a for p, a in device_snapshot(nnx.state(model, nnx.Param)).items()}
        before |= {n: a for n, a in device_snapshot(floating_leaves(model)).items()}
        if true_gradients and not returned:  # before the step, until it is seen to return gradients
            truth[t] = true_gradient_digest(task.loss_fn, model, batch, peaks)
        if true_gradients and _coarse(compute):  # what tells a gradient at rounding level at low precision
            noise[t] = rounding_noise(task.loss_fn, model, batch, jnp.dtype(compute))
        stepped = (fn, cand, model, optimizer, batch, kwargs, t)
        loss, grads = _checked_step(stepped, task, compute, update_checks, drift)  # the harness's step call
        returned = grads is not None
        if returned:
            truth.pop(t, None)
        if peaks is not None and (t in truth or returned):  # the task's gradient where taken, else the step's
            least[t] = (peaks.least if t in truth else peaks.raise_by(flatten_state(grads))), peaks.sampled
        leaves = _step_leaves(loss, grads, model, optimizer, cand.view_optimizer, drawn)
        shapes += [s for s in _leaf_list(leaves) if s[0] not in {x[0] for x in shapes}]
        rows.append(digest(leaves, before))
        replicas.append(replica_evidence(leaves))  # each step's copies compared across this process's devices
    recording = _recording(fn, task, data, candidate, cand, mesh, (initial, rows, shapes, indices), settings)
    recording.meta.update(touched, matmul_precision=policy, compute_dtype=compute, drawn=list(drawn))
    recording.meta.update(_optimizer_facts(task, model), replicas=replicas)
    recording.meta.update({} if drift is None else {"loss_drift": drift.values})
    _keep_gradients(recording.meta, len(data), truth, least, noise)
    return recording


def _loss_touches(loss_fn, model, batch) -> dict:
    """What the task's loss touches of the model's state, as the recording's metadata keeps it (sorted dotted
    paths, ``None`` where undecidable): ``floating_read`` and ``floating_written``
    (:func:`~shardcheck.parity.comparison.model_state.loss_access`), ``counters_touched`` (the integer state it
    reads or writes, :func:`~shardcheck.parity.comparison.model_state.loss_counters`)."""
    reads, writes = loss_access(loss_fn, model, batch)
    found = {
        "floating_read": reads,
        "floating_written": writes,
        "counters_touched": loss_counters(loss_fn, model, batch),
    }
    return {k: None if v is None else sorted(v) for k, v in found.items()}


def _check_name(name) -> None:
    """Refuse a ``name`` that is not a non-empty str (TypeError)."""
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise TypeError(
            f"record_run: name must be a non-empty str (the run's name in the recording), got {name!r}"
        )


def _checked_step(
    stepped: tuple, task: Task, compute, update_checks: list | None, drift: LossDrift | None = None
):
    """``(loss, grads)`` of the harness's step call (``stepped``: :func:`run_step`'s arguments), with the update
    check of the step appended to ``update_checks`` where it fails, until one has, at the steps
    :func:`~shardcheck.parity.harness.optimizer_rerun.checks_step` checks (the state is copied before those only)
    (:func:`~shardcheck.parity.harness.optimizer_rerun.recorded_update_check`; ``None``: not checked), and the
    step's loss drift added to ``drift`` (:class:`~shardcheck.parity.tolerance.loss_drift.LossDrift`, from the
    state before the step and the gradients it returned; ``None``: not taken)."""
    fn, cand, model, optimizer, batch, kwargs, t = stepped
    checking = (
        update_checks is not None and not update_checks and checks_step(t, nnx.state((model, optimizer)))
    )
    copied = checking or drift is not None
    pre = pre_update(model, optimizer, cand.view_optimizer) if copied else None
    loss, grads = run_step(fn, cand, model, optimizer, batch, kwargs, t)
    if checking:
        failed = recorded_update_check(t, task, pre, grads, model, optimizer, cand.view_optimizer, compute)
        update_checks += [failed] if failed is not None else []
    if drift is not None:
        drift.step(t, task.terms(batch), pre, grads)
    return loss, grads


def _keep_gradients(meta: dict, steps: int, truth: dict, least: dict, noise: dict) -> None:
    """Store what :func:`record_run` kept of the gradients by step (``true_gradients``) in ``meta``: the task's
    own gradient's digests, the peaks' least and samples, the compute noise."""
    for t, found in truth.items():
        keep_true_gradients(meta, t, steps, found)
    for t, (found, sampled) in least.items():
        keep_least(meta, t, steps, found, sampled)
    for t, found in noise.items():
        keep_noise(meta, t, steps, found)


def _coarse(compute: str) -> bool:
    """Whether the compute dtype named ``compute`` is coarser than float32 (bfloat16, float16)."""
    return float(jnp.finfo(jnp.dtype(compute)).eps) > float(jnp.finfo(jnp.float32).eps)


def _precision(fn: str, task: Task, model, batch, mesh, matmul_precision, compute_dtype) -> tuple[str, str]:
    """``(matmul policy, compute dtype name)`` of a recorded run, as a live check reads them
    (:func:`~shardcheck.parity.tolerance.matmul.resolve`, :meth:`~shardcheck.parity.tolerance.precision.
    Precision.of`: the least precise layer ``dtype``, or ``compute_dtype`` where given).

    Raises:
        TypeError, ValueError: ``compute_dtype`` not a floating dtype, or more precise than the model's layers.
    """
    policy = matmul.resolve(fn, matmul_precision, task.loss_fn, model, batch, mesh)[0]
    traced = traced_compute_dtype(task.loss_fn, model, batch)
    precision = Precision.of(model, compute_dtype=compute_dtype, matmul=policy, fn=fn, traced=traced)
    return policy, precision.compute_dtype.name


def normalized_params(task: Task, model: nnx.Module) -> list[str]:
    """The parameters (dotted paths) whose update the task's optimizer normalizes
    (:func:`~shardcheck.parity.tolerance.propagation.normalized_leaves`), probed on stand-ins of the parameters
    (each dimension cut to 4 at most: the tree, ranks and dtypes the optimizer's masks and labels read, no copy of
    the model's state): where some of a leaf's gradient is rounding noise, a replay allows those elements an
    lr-sized update only under such an optimizer (``meta["normalized"]``). Probed once per task and stand-in
    structure (a warm accumulation check of the tiny-lm spent ~35 ms of ~450 in the probe, at every check)."""
    return list(_probed(task, model, "normalized", lambda tx, p: sorted(normalized_leaves(tx, p))))


def _probed(task: Task, model: nnx.Module, name: str, probe):
    """``probe(task.optimizer, stand_in)`` on stand-ins of ``model``'s parameters (ones, each dimension cut to 4
    at most; ``model`` real or abstract), once per task, ``name`` and stand-in structure."""
    shapes = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(tuple(min(int(d), 4) for d in a.shape), a.dtype),
        nnx.state(model, nnx.Param),
    )
    key = (name, jax.tree.structure(shapes), tuple(jax.tree.leaves(shapes)))
    stand_in = functools.partial(jax.tree.map, lambda s: jnp.ones(s.shape, s.dtype), shapes)
    return _memo(task, key, True, lambda: probe(task.optimizer, stand_in()))


def _optimizer_facts(task: Task, model: nnx.Module) -> dict:
    """What a recording keeps of the task's optimizer: the parameters whose update it normalizes
    (``meta["normalized"]``), its update of a probe gradient (``meta["optimizer"]``) and the ``max_norm`` of its
    ``optax.clip_by_global_norm`` (``meta["global_clip"]``, ``None`` without one: what a replay's scale evidence
    reads, a binding clip mapping g and S g to one update)."""
    from shardcheck.parity.diagnosis.hypotheses import clip_norm_of

    return {
        "normalized": normalized_params(task, model),
        "optimizer": optimizer_signature(task, model),
        "global_clip": clip_norm_of(task.optimizer),
    }


def optimizer_signature(task: Task, model: nnx.Module) -> dict[str, float]:
    """The task's optimizer's :func:`~shardcheck.parity.tolerance.propagation.update_signature` on stand-ins of
    the parameters (as :func:`normalized_params`): kept in a recording (``meta["optimizer"]``) and compared with
    the replay's by its diagnosis (:func:`optimizer_change`). Probed once per task."""
    return dict(_probed(task, model, "optimizer", update_signature))


OPTIMIZER_RTOL = 1e-3
"""How far two runs' :func:`optimizer_signature` sizes may differ, relative, and be the same optimizer: far above
float32 rounding of one update on another machine, far below a changed learning rate."""


def optimizer_change(was: Mapping | None, now: Mapping | None) -> str | None:
    """How the recorded optimizer signature ``was`` differs from this run's ``now``: the parameter whose probe
    update differs most and the ratio, or ``None`` where they agree (or either run keeps none: a recording made
    before the signature was kept)."""
    if not was or not now:
        return None
    if was.get("advances") != now.get("advances"):
        return (
            f"its first nonzero update comes after {int(was['advances'])} zero-gradient step(s), this task's after "
            f"{int(now['advances'])} (another warm-up or schedule)"
        )
    far = {
        p: (w, now[p])
        for p, w in was.items()
        if p != "advances" and p in now and abs(now[p] - w) > OPTIMIZER_RTOL * max(abs(w), abs(now[p]))
    }
    if not far:
        return None
    p, (w, n) = max(far.items(), key=lambda kv: abs(kv[1][1] - kv[1][0]) / max(abs(kv[1][0]), abs(kv[1][1])))
    ratio = f"{n / w:.4g} x the recorded one" if w else f"{n:.3g} where the recorded one is 0"
    return f"its update of a probe gradient at param {p} is {ratio}"


def _check_settings(fn: str, settings) -> dict:
    """``settings`` as a dict of JSON values (the metadata is JSON), or one line naming the fix."""
    if settings is None:
        return {}
    rule = "a mapping of str to JSON values (str, numbers, bools, None, lists, dicts), e.g. {'lr': 0.01}"
    if not isinstance(settings, Mapping) or not all(isinstance(k, str) for k in settings):
        raise TypeError(f"{fn}: settings must be {rule}, got {type(settings).__name__}")
    try:
        json.dumps(dict(settings), allow_nan=False)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{fn}: settings must be {rule}: {err}") from None
    return dict(settings)


def _recording(fn, task, data, candidate, cand, mesh, digests, settings) -> Recording:
    initial, rows, shapes, indices = digests
    order = {n: i for i, n in enumerate(KINDS)}
    shapes = sorted(shapes, key=lambda s: order[s[0].split(" ", 1)[0]])  # stable: each kind in its own order
    names = [s[0] for s in shapes]
    run, run_kind = _run_name(candidate, cand)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        **task_facts(fn, task, data),
        "run": run,
        "run_kind": run_kind,
        "num_shards": cand.num_shards,
        # a step with its own optimizer (accumulation) steps it once per k = num_shards micro-batches
        "micro_batches": cand.num_shards if cand.make_optimizer is not None else None,
        "mesh": None if mesh is None else {str(k): int(v) for k, v in mesh.shape.items()},
        "steps": len(data),
        "settings": settings,
        "versions": _versions(),
        "platform": _platform(mesh),
    }
    return Recording(
        meta=meta,
        names=tuple(names),
        shapes=tuple(tuple(s[1]) for s in shapes),
        dtypes=tuple(s[2] for s in shapes),
        sample_index=np.stack([indices[n] for n in names]),
        initial=Digests.of([initial], names),
        steps=Digests.of(rows, names),
    )


# -------------------------------------------------------------------------------------------------- loading


def _cli(fn: str) -> bool:
    """Whether the caller is a command (``"shardcheck verify"``): its messages name flags, else arguments."""
    return fn.startswith("shardcheck ")


def _not_a_recording(fn: str, shown: str, why: str) -> ValueError:
    # never suggests writing over the file: it may be the user's own of another kind
    fix = "shardcheck record ... --out RUN.npz" if _cli(fn) else "record_run(...).save('RUN.npz')"
    return ValueError(f"{fn}: {shown} is not a shardcheck recording ({why}); record one with {fix}")


def _damaged(fn: str, shown: str, why: str) -> ValueError:
    return ValueError(f"{fn}: {shown} is a damaged shardcheck recording ({why}); record it again")


def _read_npz(fn: str, path, shown: str) -> dict[str, np.ndarray]:
    """Every array of the ``.npz`` at ``path`` (no pickles); ``shown``: how messages name it.

    Raises:
        ValueError: a missing file, or one NumPy cannot read as an ``.npz`` without pickles.
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(
            f"{fn}: path must be a str or os.PathLike naming the .npz Recording.save wrote, got "
            f"{type(path).__name__}"
        )
    if not Path(path).is_file():
        raise ValueError(
            f"{fn}: {shown} does not exist or is not a file; pass the .npz file "
            f"{'shardcheck record --out' if _cli(fn) else 'shardcheck record --out or record_run(...).save(path)'} "
            "wrote"
        )
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            truncated = f.read(4) == b"PK\x03\x04"  # a zip's first member, its directory (at the end) gone
        if truncated:
            raise _damaged(fn, shown, "a truncated .npz archive")
        raise _not_a_recording(fn, shown, "not an .npz archive")
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except Exception as err:  # BadZipFile, a pickled array, a truncated member ...
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        if is_recording_file(Path(path)):
            raise _damaged(fn, shown, f"cannot be read: {why}") from None
        raise _not_a_recording(fn, shown, f"cannot be read as .npz: {why}") from None


def _meta(fn: str, shown: str, arrays: dict) -> dict:
    if "meta" not in arrays:
        raise _not_a_recording(fn, shown, "no metadata")
    try:
        meta = json.loads(str(arrays["meta"][()]))
    except (ValueError, TypeError, IndexError):
        raise _not_a_recording(fn, shown, "its metadata is not JSON") from None
    if not isinstance(meta, dict):
        raise _not_a_recording(fn, shown, "its metadata is not a JSON object")
    if meta.get("format") != FORMAT:
        raise _not_a_recording(fn, shown, f"its format is {meta.get('format')!r}")
    if meta.get("version") != VERSION:
        raise ValueError(
            f"{fn}: {shown} is a recording of format version {meta.get('version')!r}; this shardcheck reads version "
            f"{VERSION}; record it again with this version"
        )
    if meta.get("checksum") != checksum(meta, arrays):
        raise _damaged(fn, shown, "its contents do not match its checksum: edited, truncated or corrupted")
    return meta


def _digests(arrays: dict, block: str, rows: int, leaves: int) -> Digests:
    k, h = _digest.SAMPLES, _digest.HASH_BYTES
    shapes = {"samples": (rows, leaves, k), "sha256": (rows, leaves, h)}
    kinds = {
        "present": "b",
        "sharding": "U",
        "sha256": "u",
        "samples": "f",
        "norm": "f",
        "max": "f",
        "update": "f",
    }
    out = {}
    for field in _FIELDS:
        a = arrays[f"{block}_{field}"]
        if a.shape != shapes.get(field, (rows, leaves)) or a.dtype.kind != kinds[field]:
            raise KeyError(f"{block}_{field}")
        out[field] = a
    return Digests(**out)


def load_recording(
    path: str | Path,
    *,
    fn: str = "load_recording",
    name: str | None = None,
    task: Task | None = None,
    mesh=None,
    num_shards=None,
    steps=None,
) -> Recording:
    """The :class:`Recording` saved at ``path``; with ``task``, also checked replayable (:func:`check_replayable`).

    Args:
        path: the ``.npz`` :meth:`Recording.save` wrote.
        fn: how error messages name the caller (``"shardcheck verify"``).
        name: how they name the file (``"--against run.npz"``; default: its path).
        task, mesh, num_shards, steps: the replay's, to refuse a recording of another run before any step
            (``num_shards`` default: the mesh's batch shards, as :func:`record_run`'s).

    Returns:
        The recording.

    Raises:
        TypeError: ``path`` not a str or path, ``task`` not a Task, ``steps`` not an int.
        ValueError: one line naming the file and the fix: a missing or unreadable file, one that is not a
            shardcheck recording or is damaged (truncated, corrupted or edited: its checksum), another format
            version, ``steps`` < 1; with ``task``, as :func:`check_replayable`.
    """
    if task is not None and not isinstance(task, Task):
        raise TypeError(
            f"{fn}: task must be a shardcheck.Task (the replay's, e.g. load_task('tiny-lm')), got "
            f"{type(task).__name__}"
        )
    if steps is not None:
        steps = _validate.check_int(fn, "steps", steps)
    shown = str(path) if name is None else name
    arrays = _read_npz(fn, path, shown)
    meta = _meta(fn, shown, arrays)
    try:
        names = tuple(str(n) for n in arrays["names"])
        leaves = json.loads(str(arrays["leaves"][()]))
        rows = int(meta["steps"])
        recording = Recording(
            meta=meta,
            names=names,
            shapes=tuple(tuple(int(d) for d in s) for _, s, _ in leaves),
            dtypes=tuple(str(d) for _, _, d in leaves),
            sample_index=arrays["sample_index"],
            initial=_digests(arrays, "initial", 1, len(names)),
            steps=_digests(arrays, "steps", rows, len(names)),
        )
        if [n for n, _, _ in leaves] != list(names) or recording.sample_index.shape != (
            len(names),
            _digest.SAMPLES,
        ):
            raise KeyError("leaves")
    except (KeyError, ValueError, TypeError) as err:
        raise _damaged(fn, shown, f"{str(err).strip(repr(''))} is missing or malformed") from None
    if task is not None:
        check_replayable(recording, task, fn=fn, path=shown, mesh=mesh, num_shards=num_shards, steps=steps)
    return recording


def _flag(fn: str, cli: str, python: str) -> str:
    """How a message names a setting: the command's flag, or the library function's argument."""
    return cli if _cli(fn) else python


def _mesh_text(axes: Mapping[str, int] | None, num_shards) -> str:
    if not axes:
        return f"no mesh (S={num_shards})"
    return ",".join(f"{k}={v}" for k, v in axes.items()) + f" (S={num_shards})"


def _first_difference(recorded: list, now: list, what: str) -> str:
    """The first leaf where two ``[name, shape, dtype]`` lists differ, in words."""
    mine = {leaf[0]: leaf for leaf in now}
    theirs = {leaf[0]: leaf for leaf in recorded}
    for leaf in recorded:
        if leaf[0] not in mine:
            return f"{what} {leaf[0]!r} is recorded but not in this run"
        if mine[leaf[0]] != leaf:
            return f"{what} {leaf[0]!r} was {tuple(leaf[1])} {leaf[2]}, is {tuple(mine[leaf[0]][1])} {mine[leaf[0]][2]}"
    extra = next(leaf[0] for leaf in now if leaf[0] not in theirs)
    return f"{what} {extra!r} is in this run but not recorded"


_STATE_FIELDS = {
    "trace": "momentum",
    "mu": "first moment",
    "nu": "second moment",
    "sum_of_squares": "squared-gradient sum",
    "ema": "moving average",
    "count": "step count",
}
"""What an optax state field holds, where its name says it (:func:`optimizer_difference`)."""


def _state_fields(leaves: list, params: list[str]) -> dict[str, int]:
    """``{field: leaves}`` of the optimizer-state and counter leaves of a ``[name, shape, dtype]`` list: each
    ``opt_state`` leaf's path less the parameter path it ends in (``"0.trace"``), each counter's whole path
    (``"0.count"``), in order; ``counter step`` (the harness's own) left out."""
    fields: dict[str, int] = {}
    for leaf in leaves:
        kind, _, path = leaf[0].partition(" ")
        if kind == "opt_state":
            field = next((path[: -len(p) - 1] for p in params if path.endswith("." + p)), path)
        elif kind == "counter" and path != "step":
            field = path
        else:
            continue
        fields[field] = fields.get(field, 0) + 1
    return fields


def _fields_text(fields: Mapping[str, int]) -> str:
    """``"0.trace (momentum, 16 leaves)"``, each field of :func:`_state_fields` in words, joined."""
    if not fields:
        return "no state"
    out = []
    for field, count in fields.items():
        gloss = _STATE_FIELDS.get(field.rsplit(".", 1)[-1])
        n = f"{count} leaf" if count == 1 else f"{count} leaves"
        out.append(f"{field} ({gloss}, {n})" if gloss else f"{field} ({n})")
    return out[0] if len(out) == 1 else ", ".join(out[:-1]) + " and " + out[-1]


def optimizer_difference(recorded: list, now: list) -> str | None:
    """Where two state structures (``[name, shape, dtype]`` lists) hold the same parameters and differ only in
    the optimizer's state: what each optimizer keeps, in words (``"the recording's optimizer keeps 0.trace
    (momentum, 16 leaves), this run's keeps 0.mu (first moment, 16 leaves) and 0.nu (second moment, 16 leaves):
    another optimizer or another optax chain than the recorded run's (the 16 parameters alike)"``); ``None`` where
    the parameters differ too (another model), or the optimizers' fields are the same (their shapes or dtypes
    differ: :func:`_first_difference` says which)."""
    params = [leaf for leaf in recorded if leaf[0].startswith("param ")]
    if params != [leaf for leaf in now if leaf[0].startswith("param ")]:
        return None
    paths = sorted((leaf[0].removeprefix("param ") for leaf in params), key=len, reverse=True)
    was, mine = _state_fields(recorded, paths), _state_fields(now, paths)
    if was == mine:
        return None
    n = f"{len(params)} parameter" + ("" if len(params) == 1 else "s")
    return (
        f"the recording's optimizer keeps {_fields_text(was)}, this run's keeps {_fields_text(mine)}: another "
        f"optimizer or another optax chain than the recorded run's (the {n} alike)"
    )


def settings_diff(was: Mapping | None, now: Mapping | None, skip: tuple[str, ...] = ()) -> list[str]:
    """``["optimizer 'adam' -> 'sgd'", "batch_size 8 -> default", ...]``: the settings both runs record
    (``record_run(settings=)``) with different values, in the recorded order, less ``skip`` (``None``, a setting
    left at its default, reads ``default``; an optimizer or ``lr`` of ``None``, which only a task file's run
    records, reads ``the task file's own``)."""
    was, now = was or {}, now or {}

    def shown(k, v):
        if v is None:
            return "the task file's own" if k in ("optimizer", "lr") else "default"
        return repr(v)

    return [
        f"{k} {shown(k, was[k])} -> {shown(k, now[k])}"
        for k in was
        if k in now and k not in skip and was[k] != now[k]
    ]


def _settings_words(was: Mapping | None, now: Mapping | None) -> str:
    """``" (the settings differ from the recording's: ...)"``, or ``""``; ``candidate`` (a spec) not counted."""
    diff = settings_diff(was, now, skip=("candidate",))
    return f" (the settings differ from the recording's: {', '.join(diff)})" if diff else ""


def check_replayable(
    recording: Recording,
    task: Task,
    *,
    fn: str,
    path,
    mesh=None,
    num_shards=None,
    steps=None,
    settings: Mapping | None = None,
):
    """Refuse, before any step, a replay that cannot be compared with ``recording``.

    In this order, what the run is before where it runs: more steps than recorded; fewer batches than steps;
    another task (both the state structure and the batch shapes differ); other batch shapes; another state
    structure (the fingerprint: leaf names, shapes, dtypes); other batch data (its sha256); then another shard
    count S, or another mesh (when both runs have one: a single-device strategy's replay compares with a mesh
    strategy's recording at the same S), so that a recording of another task on another mesh is refused as
    another task, not told a ``--mesh`` that cannot make it replay. A task's name is how it was spelled (a file
    path, ``Task(name=)``): it refuses nothing, and a refusal names both tasks when their names differ.

    Args:
        recording: the recording; task: the replay's task.
        fn: how messages name the caller; path: how they name the file.
        mesh, num_shards, steps: the replay's (``num_shards`` None: the mesh's batch shards; ``steps`` None: the
            recorded number).
        settings: the replay's ``record_run(settings=)``, when known: the settings that differ from the
            recording's are named in a refusal (``optimizer 'adam' -> 'sgd'``).

    Raises:
        ValueError: one line naming the file, what differs and the fix.
    """
    meta = recording.meta
    # a task's name is how it was spelled (a file path, a Task's name=): the same task under another spelling
    # replays; another task is refused below by its batches, state or data, naming both
    named = (
        ""
        if meta["task"] == task.name
        else f" (it records task {meta['task']!r}, this run's is {task.name!r})"
    )
    num_shards = check_options(fn, rtol=None, atol=None, accept_weak=False, mesh=mesh, num_shards=num_shards)
    steps = _replay_steps(fn, path, recording, task, steps, named)
    now = task_facts(fn, task, list(task.batches[:steps]))
    differ = _settings_words(meta.get("settings"), settings) + named
    state = meta["fingerprint"] != fingerprint(now["state_leaves"], meta["batches"])
    for t in range(steps):
        if meta["batches"][t]["leaves"] != now["batches"][t]["leaves"] and state:  # another model and data
            raise _another_task(
                fn, path, meta, now, t, named, _settings_words(meta.get("settings"), settings)
            )
        if meta["batches"][t]["leaves"] != now["batches"][t]["leaves"]:
            raise ValueError(
                f"{fn}: {path} recorded batch {t} as {_batch_text(meta['batches'][t]['leaves'])}, this run's is "
                f"{_batch_text(now['batches'][t]['leaves'])}{differ}; replay with the recorded batch size, "
                "sequence length and data, or record again"
            )
    if state:
        optimizer = optimizer_difference(meta["state_leaves"], now["state_leaves"])
        if optimizer is not None:
            raise ValueError(
                f"{fn}: {path} records another optimizer state: {optimizer}{differ}; replay with the recorded "
                "run's optimizer (the same transformation and optax chain), or record this task again with this one"
            )
        why = _first_difference(meta["state_leaves"], now["state_leaves"], "leaf")
        raise ValueError(
            f"{fn}: {path} records another model or optimizer state: {why}{differ}; replay with the recorded "
            "settings, or record this task again"
        )
    for t in range(steps):
        if meta["batches"][t]["sha256"] != now["batches"][t]["sha256"]:
            raise ValueError(
                f"{fn}: {path} recorded other data at batch {t} (its sha256 differs){differ}: another "
                f"{_flag(fn, '--seed', 'seed')}, data set or task file; replay with the recorded data, or record "
                "again"
            )
    _check_mesh(fn, path, meta, mesh, num_shards)


def _check_mesh(fn: str, path, meta: Mapping, mesh, num_shards: int) -> None:
    """Refuse a replay on another shard count S or another mesh than the recording's (:func:`check_replayable`'s
    last refusal: the task is the recorded one, so the flag it names can make the run replay, and a task's other
    spelling is not said: trial 50 read it as the cause)."""
    axes = None if mesh is None else {str(k): int(v) for k, v in mesh.shape.items()}
    # a run without a mesh (a single-device strategy) compares with a mesh's at the same S; two meshes must agree
    if num_shards == meta["num_shards"] and not (axes and meta["mesh"] and axes != meta["mesh"]):
        return
    was, now = _mesh_text(meta["mesh"], meta["num_shards"]), _mesh_text(axes, num_shards)
    if meta["mesh"] and axes == meta["mesh"]:  # the mesh given, another S asked for
        flag = _flag(fn, f"--mesh {was.split(' ')[0]} alone", f"num_shards={meta['num_shards']} (or None)")
    elif meta["mesh"]:
        flag = _flag(fn, f"--mesh {was.split(' ')[0]}", f"a mesh of {was.split(' ')[0]}")
    else:
        flag = _flag(fn, f"--devices {meta['num_shards']}", f"num_shards={meta['num_shards']}")
    raise ValueError(
        f"{fn}: {path} was recorded on mesh {was}, not {now}; replay it with {flag}, or record again"
    )


def _another_task(
    fn: str, path, meta: Mapping, now: Mapping, t: int, named: str, settings: str
) -> ValueError:
    """The refusal of a recording whose model or optimizer state and batches both differ from the task's: another
    task, said first (not a batch size to change)."""
    why = _first_difference(meta["state_leaves"], now["state_leaves"], "leaf")
    return ValueError(
        f"{fn}: {path} records another task{named}: another model or optimizer state ({why}) and other batches "
        f"(batch {t} recorded as {_batch_text(meta['batches'][t]['leaves'])}, this run's is "
        f"{_batch_text(now['batches'][t]['leaves'])}){settings}; replay it with the task it records, or record "
        "this task"
    )


def _replay_steps(fn: str, path, recording: Recording, task: Task, steps, named: str) -> int:
    """The replay's step count (``steps``, or the recorded number when None); refuses more than recorded or more
    than the task's batches."""
    steps = recording.num_steps if steps is None else steps
    if steps > recording.num_steps:
        raise ValueError(
            f"{fn}: {path} holds {recording.num_steps} step(s), not {steps}; pass "
            f"{_flag(fn, '--steps ', 'steps=')}{recording.num_steps} or fewer, or record more"
        )
    if steps > len(task.batches):
        raise ValueError(
            f"{fn}: {path} holds {steps} step(s), but the task has {len(task.batches)} batch(es){named}; pass "
            f"{_flag(fn, '--steps ', 'steps=')}{len(task.batches)} or fewer, or give the task more batches"
        )
    return steps


def _batch_text(leaves: list) -> str:
    """A batch's ``[[path, shape, dtype], ...]`` in words: ``['tokens'] 16x32 int32, ['mask'] 16x32 float32``."""
    return ", ".join(f"{p} {'x'.join(map(str, s)) or 'scalar'} {d}" for p, s, d in leaves)


__all__ = ["Digests", "Recording", "check_replayable", "load_recording", "record_run", "state_leaves"]
