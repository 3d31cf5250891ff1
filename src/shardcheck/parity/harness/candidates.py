"""What the harness compares against what: a named strategy, a :class:`Candidate`, or a user's own step.

A user step has the NNX signature ``step(model, optimizer, batch) -> loss`` (``step(model, optimizer, batch,
mesh)`` when it takes a mesh and one is given), updates both in place and returns the pre-update loss, ``None``,
or an object / mapping with ``loss`` (and optionally ``grads``, compared leaf by leaf with the reference's).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import re
import traceback
from collections.abc import Callable, Mapping

import jax
import numpy as np
from flax import nnx

from shardcheck.steps import CANDIDATES, STRATEGIES, Candidate, get_strategy, mesh_for
from shardcheck.task import Task


def accepts(fn: Callable, name: str, position: int) -> bool:
    """Whether ``fn`` takes keyword ``name`` or a positional argument at ``position`` (0-based)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    params = list(sig.parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params) or name in sig.parameters:
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) > position or any(p.kind is p.VAR_POSITIONAL for p in params)


def check_step_signature(fn: str, label: str, step: Callable, arity: int, with_mesh: bool) -> None:
    """``step`` must accept ``arity`` positional arguments (plus ``mesh=`` when ``with_mesh``).

    Raises:
        TypeError: naming ``label``, the signature found and the two accepted forms.
    """
    try:
        sig = inspect.signature(step)
    except (TypeError, ValueError):
        return  # builtins and some C callables have no signature: let the call decide
    try:
        sig.bind(*([None] * arity), **({"mesh": None} if with_mesh else {}))
    except TypeError as err:
        name = getattr(step, "__name__", type(step).__name__)
        args = "model, optimizer, batch" if arity == 3 else "model, optimizer, x, y"
        forms = (  # a reference runs on one device: no mesh is ever given it (trial 55)
            f"({args}) and update model and optimizer in place: a reference step runs on one device, with no mesh "
            "(a step that takes a mesh is a candidate)"
            if label == "reference"
            else f"({args}), or ({args}, mesh) with mesh= given, and update model and optimizer in place"
        )
        raise TypeError(
            f"{fn}: {label} {name}{sig} cannot be called as {label}({args}{', mesh=mesh' if with_mesh else ''}) "
            f"({err}); it must take {forms}"
        ) from None
    _check_order(fn, label, step, sig, arity)


STEP_ORDER = ("model", "optimizer", "batch")


def _check_order(fn: str, label: str, step: Callable, sig: inspect.Signature, arity: int) -> None:
    """A 3-argument step whose first three parameters are named ``model``, ``optimizer`` and ``batch`` in another
    order is refused naming the order it is called in (trial 58 D: ``(batch, model, optimizer)`` was called
    with the model as its batch and read ``never_stepped``).

    Raises:
        TypeError: the names in another order.
    """
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in sig.parameters.values() if p.kind in positional][:3]
    if arity != 3 or sorted(names) != sorted(STEP_ORDER) or names == list(STEP_ORDER):
        return
    name = getattr(step, "__name__", type(step).__name__)
    raise TypeError(
        f"{fn}: {label} {name}{sig} names its parameters ({', '.join(names)}), but a step is called as "
        f"{label}(model, optimizer, batch), positionally; reorder its parameters to (model, optimizer, batch)"
    )


def strategy_candidate(task_or_loss, name: str, *, num_shards: int, mesh=None) -> Candidate:
    """One of shardcheck's registered strategies as a :class:`Candidate` for a task.

    Args:
        task_or_loss: a :class:`~shardcheck.Task` or its ``loss_fn``.
        name: a key of :data:`shardcheck.steps.STRATEGIES`.
        num_shards: S >= 1.
        mesh: the mesh of a mesh strategy (default: the first S devices).

    Returns:
        The :class:`Candidate`.

    Raises:
        ValueError: unknown ``name``, fewer devices than S, a mesh of another size.
    """
    fn = "strategy_candidate"
    from shardcheck import _validate

    num_shards = _validate.check_num_shards(fn, num_shards)
    strategy = get_strategy(fn, name)
    loss_fn = task_or_loss.loss_fn if isinstance(task_or_loss, Task) else task_or_loss
    return strategy.build(loss_fn, num_shards, mesh_for(fn, strategy, num_shards, mesh))


class _Hook:
    """A candidate's ``make_optimizer`` or ``view_optimizer`` whose exceptions name the candidate, the hook and
    the step (:func:`run_step` sets ``step`` before each step: ``None`` until the first)."""

    def __init__(self, fn: str, name: str, hook: str, call: Callable):
        self.fn, self.name, self.hook = fn, name, hook
        self.call = call.call if isinstance(call, _Hook) else call
        self.step: int | None = None

    def __call__(self, *args):
        try:
            return self.call(*args)
        except Exception as err:
            when = "before step 0" if self.step is None else f"at step {self.step}"
            what = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
            kind = TypeError if isinstance(err, TypeError) else ValueError
            raise kind(
                f"{self.fn}: {self.hook} of the candidate {self.name!r} raised {type(err).__name__} {when}"
                f"{': ' + what if what else ''}; fix {self.hook} (the original error, with its traceback, is "
                "this one's __cause__)"
            ) from err


def _with_hooks(fn: str, cand: Candidate, name: str) -> Candidate:
    """``cand`` with its optimizer hooks wrapped in :class:`_Hook` (their errors name ``name``, the hook and the
    step)."""
    hooks = {
        hook: _Hook(fn, name, hook, getattr(cand, hook))
        for hook in ("make_optimizer", "view_optimizer")
        if getattr(cand, hook) is not None
    }
    return dataclasses.replace(cand, **hooks) if hooks else cand


def as_candidate(fn, candidate, task: Task, num_shards, mesh, name) -> Candidate:
    """A :class:`Candidate` from a strategy name, a Candidate, or a user step (signature checked); its
    ``make_optimizer`` / ``view_optimizer`` raise a ValueError or TypeError naming the candidate, the hook and the
    step (the hook's own error its ``__cause__``)."""
    cand = _as_candidate(fn, candidate, task, num_shards, mesh, name)
    # its errors name the user's Candidate by its own name (a command line names every candidate "candidate")
    return _with_hooks(fn, cand, candidate.name if isinstance(candidate, Candidate) else cand.name)


def _as_candidate(fn, candidate, task: Task, num_shards, mesh, name) -> Candidate:
    if isinstance(candidate, Candidate):
        if not callable(candidate.step):
            raise TypeError(
                f"{fn}: Candidate {candidate.name!r} has step of type {type(candidate.step).__name__}; it must be "
                "a callable (model, optimizer, batch) -> loss"
            )
        if num_shards is not None and candidate.num_shards is None:
            candidate = dataclasses.replace(candidate, num_shards=num_shards)
        return dataclasses.replace(candidate, name=name) if name else candidate
    if isinstance(candidate, str):
        if candidate not in STRATEGIES:
            get_strategy(fn, candidate)
        if num_shards is None:
            raise ValueError(f"{fn}: strategy {candidate!r} needs num_shards=S; pass e.g. num_shards=2")
        strategy = get_strategy(fn, candidate)
        c = strategy.build(task.loss_fn, num_shards, mesh_for(fn, strategy, num_shards, mesh))
        return dataclasses.replace(c, name=name or c.name, builtin=True)
    if not callable(candidate):
        raise TypeError(
            f"{fn}: candidate must be a strategy name ({', '.join(CANDIDATES)}), a Candidate or a callable "
            f"(model, optimizer, batch) -> loss, got {type(candidate).__name__}"
        )
    pass_mesh = mesh is not None and accepts(candidate, "mesh", 3)
    check_step_signature(fn, "candidate", candidate, 3, pass_mesh)
    return Candidate(
        name or getattr(candidate, "__name__", "candidate"), candidate, num_shards, pass_mesh=pass_mesh
    )


def _is_scalar_like(out) -> bool:
    return isinstance(out, jax.Array | np.ndarray | np.generic | float | int) and np.ndim(out) == 0


GRADS_NAMES = frozenset({"gradients", "gradient", "grad"})
"""Keys of a returned mapping that name gradients under another name than ``'grads'``: refused by
:func:`unpack` where ``'grads'`` is absent (other keys, metrics such as ``'accuracy'``, are ignored)."""


class StepReturnError(TypeError):
    """A step ran and returned what :func:`unpack` cannot read; ``step`` is the 0-based step. A ``TypeError``
    (what :func:`~shardcheck.check_parity` raises for it), told apart so that ``shardcheck verify`` gives the
    candidate an ERROR row, as for a step that raised, and prints the other rows (trial 51)."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


def unpack(out, who: str = "the candidate step", step: int = 0, fn: str = "check_parity") -> tuple:
    """``(loss, grads)`` from a step's return value; ``fn`` is the public function named in an error.

    Raises:
        StepReturnError: (a ``TypeError``) ``out`` is not a scalar loss, ``None``, or a mapping / object with
            ``loss`` (itself a scalar or ``None``); a mapping that holds gradients under another name
            (:data:`GRADS_NAMES`, e.g. ``'gradients'``) and no ``'grads'``.
    """
    if out is None:
        return None, None
    if _is_scalar_like(out):
        return out, None
    rule = (
        "it must return the scalar pre-update loss, None, or an object or mapping with 'loss' (a scalar) and "
        "optionally 'grads'"
    )
    if isinstance(out, Mapping):
        if "loss" not in out:
            raise StepReturnError(
                f"{fn}: {who} returned a mapping without 'loss' (keys {sorted(map(str, out))}) "
                f"at step {step}; {rule}",
                step,
            )
        near = sorted(k for k in map(str, out) if k in GRADS_NAMES)
        if "grads" not in out and near:  # trial 50: {"loss", "gradients"} read as a step that returned none
            raise StepReturnError(
                f"{fn}: {who} returned a mapping with {near[0]!r} but no 'grads' at step {step}: its "
                f"gradients would not be compared; return them as {{'loss': loss, 'grads': grads}}",
                step,
            )
        loss, grads = out.get("loss"), out.get("grads")
    elif hasattr(out, "loss") and not isinstance(out, str | bytes | np.ndarray | jax.Array):
        loss, grads = out.loss, getattr(out, "grads", None)
    else:
        shape = f" of shape {np.shape(out)}" if hasattr(out, "shape") else ""
        raise StepReturnError(
            f"{fn}: {who} returned {type(out).__name__}{shape} at step {step}; {rule}", step
        )
    if loss is not None and not _is_scalar_like(loss):
        raise StepReturnError(
            f"{fn}: {who} returned loss of type {type(loss).__name__}"
            f"{f' and shape {np.shape(loss)}' if hasattr(loss, 'shape') else ''} at step {step}; {rule}",
            step,
        )
    return loss, grads


def _split_hint(rows: int, s: int, mesh) -> str:
    """The likely cause of a step that raised on a batch of ``rows`` rows that S = ``s`` does not divide: the
    devices of the mesh where the batch is split over all of them (or the mesh is not known), else the batch
    shards, named by the mesh's batch axes and its device count (``data=3,model=2``: 3 shards of 6 devices)."""
    if mesh is None or mesh.size == s:
        return (
            f"the batch's {rows} rows do not split over the {s} devices of the mesh: a likely cause; give a "
            "batch size divisible by the device count, or fewer devices"
        )
    from shardcheck.mesh import batch_axes

    axes = batch_axes(mesh)
    named = f"axis {axes[0]}" if len(axes) == 1 else f"axes {' x '.join(axes)}"
    sizes = f"a size of {named} that" if len(axes) == 1 else f"sizes of {named} whose product"
    return (
        f"the batch's {rows} rows do not split into the {s} batch shards ({named} of the mesh's {mesh.size} "
        f"devices): a likely cause; give a batch size divisible by {s}, or fewer batch shards ({sizes} divides "
        f"{rows})"
    )


_PLACEMENT_WORDS = re.compile(
    r"mesh|axis|axes|PartitionSpec|\bP\(|[Ss]harding|shard_map|divisible|Resource", re.IGNORECASE
)


def _about_placement(err: Exception) -> bool:
    """Whether a step's error speaks of placement (a mesh, an axis, a ``PartitionSpec``, a sharding, an uneven
    split): only then may the model's annotations be its likely cause (:func:`_annotation_hint`). An error on the
    axes a ``jax.shard_map`` value varies over (:func:`_varying_hint`) is not one."""
    if isinstance(err, KeyError):
        return True
    text = str(err)
    return _VARYING.search(text) is None and _PLACEMENT_WORDS.search(text) is not None


# jax.shard_map's varying-axes types in an error: "... at path [0]['l1']['bias'] has type float32[64]{V:data} ...",
# on either branch's side: "... at path [0]['head']['bias'] has type float32[2,4] but the corresponding output of
# false_fun has type float32[2,4]{V:data}" (trial 42: optax.MultiSteps's lax.cond, its update branch varying)
_VARYING = re.compile(
    r"at path (\S+) has type (?:(\S+?)\{V:([\w,]+)\}"
    r"|\S+ but the corresponding output of \w+ has type (\S+?)\{V:([\w,]+)\})"
)


def _varying_found(text: str) -> list[tuple[str, str, str]]:
    """``(path, type, axes)`` of each value :data:`_VARYING` finds varying in ``text``, in its order."""
    return [(m[1], m[2] or m[4], m[3] or m[5]) for m in _VARYING.finditer(text)]


def _varying_hint(err: Exception) -> str:
    """Where a step's error shows values that vary over a mesh axis inside ``jax.shard_map`` where they must
    not (check_vma's ``{V:data}``: two ``lax.cond`` branches, such as ``optax.apply_if_finite``'s, or an output
    spec ``P()``), that in words: a value computed per device and never reduced over that axis (trial 29: a
    head's gradient left out of the psum over 'data' read as an annotation the mesh lacks); else ``""``."""
    found = _varying_found(str(err))
    if not found:
        return ""
    path, kind, axes = found[0]
    over = ", ".join(repr(a) for a in axes.split(","))
    more = f" ({len(found)} values)" if len(found) > 1 else ""
    return (
        f"values vary over {over} inside the step's jax.shard_map where they must not{more}, e.g. {path} "
        f"({kind}{{V:{axes}}}): a value computed per device and never reduced over {over} (a gradient without "
        f"its psum or pmean over {over}); reduce it before the optimizer reads it"
    )


def _names_other_shape(err: Exception, batch) -> bool:
    """Whether the error names the full shape of the array it failed on (JAX's "... (full shape: (3, 32))") and
    no leaf of ``batch`` has it: an uneven split of a parameter (trial 28: a stacked (3, 32) LayerNorm bias over
    fsdp=3), not of the batch's rows."""
    found = re.search(r"full shape: \(([\d, ]*)\)", str(err))
    if found is None:
        return False
    shape = tuple(int(d) for d in found.group(1).replace(" ", "").split(",") if d)
    return all(tuple(np.shape(x)) != shape for x in jax.tree.leaves(batch))


def _annotation_hint(model, mesh) -> str:
    """Where ``model``'s sharding annotations name an axis ``mesh`` lacks (a misspelt ``--mesh`` axis) or split a
    dimension unevenly over its axes (256 rows over a ``model`` axis of 3), that mismatch in words
    (:func:`~shardcheck.steps.sharded.check_annotations_fit`), else ``""``: the likely cause of a step that
    places the state by its annotations and raised. A step that ignores them runs on such a mesh."""
    from shardcheck.steps.sharded import check_annotations_fit

    if mesh is None:
        return ""
    try:
        check_annotations_fit("", model, mesh)
    except ValueError as err:
        return str(err).removeprefix(": ")
    return ""


# an uneven split in JAX's words: "... is partitioned 3 times, but the dimension size is 32 (... should evenly
# divide the shape)", IndivisibleError, "not divisible by"
_UNEVEN = re.compile(r"divisib|evenly divide|partitioned \d+ times|Indivisible", re.IGNORECASE)


def _annotation_cause(err: Exception, model, mesh) -> str:
    """:func:`_annotation_hint` where ``err`` is about what it says: an annotation naming an axis the mesh
    lacks only beside an error that names that axis (quoted, or as JAX's "Resource axis: model of P(...)"), an
    uneven split only beside an error about an uneven split (:data:`_UNEVEN`); else ``""``. Trial 42: every error
    of a step on data=4 that never placed the state by its annotations (Flax's "Cannot extract graph node from
    different trace level", a jax.shard_map out_specs replication error, optax.MultiSteps's lax.cond "branches
    must have equal output types") read "leaf 'members.head.kernel' is annotated P('model', None, None) but the
    mesh has no axis 'model'" first."""
    if not _about_placement(err):
        return ""
    hint = _annotation_hint(model, mesh)
    if not hint:
        return ""
    text = f"{type(err).__name__}: {err}"
    lacking = {a for _, _, missing in _annotations_lacking(model, mesh) for a in missing}
    if lacking:  # the hint names an axis the mesh lacks: only where the error names it too
        named = any(re.search(rf"(['\"]){re.escape(a)}\1|\baxis:? {re.escape(a)}\b", text) for a in lacking)
        keyed = isinstance(err, KeyError) and bool(err.args) and err.args[0] in lacking
        return hint if named or keyed else ""
    return hint if _UNEVEN.search(text) else ""


def _named_axis(err: Exception) -> tuple[str, str | None] | None:
    """The mesh axis a step's error names, with the ``PartitionSpec`` it names it in where the error says one
    (JAX: "Resource axis: data of P('data',) is not found in mesh: ('batch',)" -> ``("data", "P('data',)")``;
    ``jax.shard_map``: "in_specs argument must refer to an axis marked as manual ... in_specs[1] refers to 'data'";
    the step's own ``mesh.shape['data']``: ``KeyError: 'data'``), else ``None``."""
    text = str(err)
    found = re.search(r"Resource axis: (\w+) of (.*?) is not found in mesh", text)
    if found is not None:
        return found.group(1), found.group(2)
    found = re.search(
        r"must refer to an axis marked as manual .*?(?:in|out)_specs\[\d+\] refers to '(\w+)'", text, re.S
    )  # jax.shard_map's own wording for its in_specs / out_specs (trial 13: --mesh batch=4)
    if found is None and isinstance(err, KeyError) and len(err.args) == 1 and isinstance(err.args[0], str):
        found = re.fullmatch(
            r"(\w+)", err.args[0]
        )  # the step's own mesh.shape['data'] (trial 25: --mesh dta=4)
    return None if found is None else (found.group(1), None)


NOT_ADDRESSABLE = "represents addressable devices"
"""What ``jax.device_put`` says of a sharding over other processes' devices it cannot place onto (a PRNG key
array, an array committed to one device)."""


def _process_hint(err: Exception) -> str:
    """Where the step's ``jax.device_put`` was refused a sharding over other processes' devices in a run of
    several processes (``shardcheck launch``, trial 61: a step placing its model's state, whose ``nnx.Rngs`` keys
    device_put refuses), how to place it; ``""`` otherwise."""
    if jax.process_count() < 2 or NOT_ADDRESSABLE not in str(err):
        return ""
    return (
        "the step places arrays with jax.device_put on a mesh that spans several processes, which refuses a PRNG "
        "key array (the model's nnx.Rngs) or an array committed to one device: place the state and the batch "
        "with shardcheck.distributed.place_host_tree(tree, shardings), as the built-in strategies do: it "
        "builds each process's shards from its own copy, keys included (docs/distributed.md)"
    )


def _batch_key_hint(err: Exception, batch) -> str:
    """Where a step raised ``KeyError`` on a key its batch (a mapping) lacks, from a line that does not read the
    mesh or an axis: that key and the batch's own keys; else ``""`` (trial 60: ``batch["image"]`` on a batch of
    ``x``, ``label``, ``mask`` read as "the step names mesh axis 'image' ... give the mesh that axis")."""
    if not (isinstance(err, KeyError) and len(err.args) == 1 and isinstance(err.args[0], str)):
        return ""
    if not isinstance(batch, Mapping) or err.args[0] in batch:
        return ""
    frames = traceback.extract_tb(err.__traceback__)
    line = (frames[-1].line or "") if frames else ""
    if "mesh" in line or "axis" in line:  # the step's own mesh.shape['data'] (trial 25): _mesh_axis_hint's
        return ""
    keys = ", ".join(sorted(repr(k) for k in batch))
    return (
        f"the step reads key {err.args[0]!r}, which the batch lacks (its keys: {keys}): read the batch by the "
        "keys the task's batches hold, or give them that key"
    )


def _mesh_axis_hint(err: Exception, mesh, model=None) -> str:
    """Where a step's error names an axis the mesh lacks (:func:`_named_axis`), that axis, the spec the error
    names it in and the fix in words, then, where ``model``'s annotations also name axes the mesh lacks, the
    first of them; a leaf annotated with the very axis the error names is said as that leaf's annotation (its
    placement is likely what raised). Else ``""`` (the annotations' own mismatch is :func:`_annotation_hint`'s).

    Trial 27: a batch placed by ``P('data')`` on ``--mesh foo=4`` raised "Resource axis: data of P('data',)",
    and the hint named the annotation ``P('expert', None, None)`` of another leaf instead."""
    named = _named_axis(err)
    if named is None or mesh is None or named[0] in mesh.axis_names:
        return ""
    axis, spec = named
    axes = tuple(mesh.axis_names)
    lacking = _annotations_lacking(model, mesh)
    same = [(path, s) for path, s, missing in lacking if axis in missing]
    if same:  # the error is the placement of an annotated leaf (or of one annotated alike)
        path, s = same[0]
        return (
            f"leaf {path!r} is annotated {s} but the mesh has no axis {axis!r} (its axes: {axes}); build the mesh "
            f"with that axis (e.g. --mesh {axis}=2 among its axes, or {axis}=1 to keep the annotation and split nothing) or change the annotation"
        )
    hint = (
        f"the step names mesh axis {axis!r}, and the mesh has {axes}: give the mesh that axis (--mesh "
        f"{axis}={mesh.size}, or a mesh whose axes include {axis!r}), or name the mesh's axes in the step"
        + (f"'s {spec}" if spec else "")
    )
    if lacking:  # the model's annotations would fail next: said after the error's own axis
        path, s, missing = lacking[0]
        k = len(lacking) - 1
        more = f" (and {k} more {'leaf' if k == 1 else 'leaves'})" if k else ""
        hint += (
            f"; the model's annotations also name axes the mesh lacks: leaf {path!r} is annotated {s}, naming "
            f"{', '.join(map(repr, missing))}{more}"
        )
    return hint


def _annotations_lacking(model, mesh) -> list:
    """:func:`~shardcheck.steps.sharded.annotations_missing_axes` of ``model`` (none without a model, or where
    its annotations cannot be read: a hint only)."""
    if model is None:
        return []
    from shardcheck.steps.sharded import annotations_missing_axes

    try:
        return annotations_missing_axes(model, mesh)
    except Exception:  # noqa: BLE001 - the hint only: a model whose annotations cannot be read names none
        return []


def _state_shape_hint(model, optimizer) -> str:
    """Where the optimizer a candidate's ``make_optimizer`` made holds state shaped otherwise than its own
    transformation's ``init`` makes (Adafactor's factored moments copied into a ``factored=False`` one with
    ``nnx.update``, which accepts them unchecked), the first such leaf in words, else ``""``: the likely cause of
    its step raising (e.g. ``lax.cond`` "branches must have equal output types"). Shapes only (``jax.eval_shape``).
    """
    from shardcheck.parity.comparison.live import flatten_state
    from shardcheck.parity.diagnosis.grouping import n_leaves

    tx, state = getattr(optimizer, "tx", None), nnx.state(optimizer)
    if tx is None or "opt_state" not in state:
        return ""
    try:
        made = jax.eval_shape(tx.init, nnx.as_pure(nnx.state(model, getattr(optimizer, "wrt", nnx.Param))))
    except Exception:  # noqa: BLE001 - a transformation that cannot init abstractly: no hint
        return ""
    held = {k: np.shape(v) for k, v in flatten_state(nnx.as_pure(state["opt_state"])).items()}
    want = {k: tuple(v.shape) for k, v in flatten_state(made).items()}
    differ = [
        (k, held.get(k), want.get(k)) for k in sorted(set(held) | set(want)) if held.get(k) != want.get(k)
    ]
    if not differ:
        return ""
    k, has, wants = differ[0]
    says = lambda x: "no such leaf" if x is None else str(tuple(x))  # noqa: E731
    return (
        f"the optimizer made by make_optimizer holds state shaped otherwise than its transformation makes "
        f"({n_leaves(len(differ))}, e.g. opt_state {k}: {says(has)} held, {says(wants)} from its init): a likely "
        "cause; state copied in from the task's optimizer (nnx.update accepts any shape) must come from an "
        "optimizer configured alike (Adafactor's factored, min_dim_size_to_factor), or start from its own init"
    )


_REPLICATION = re.compile(
    r"out_specs(\[\d+\]) is (P\([^)]*\)) which implies .*? replicated across mesh axis '(\w+)'"
)


def _traced_hint(err: Exception) -> str:
    """Where a step's error is one of a traced step's own mistakes that reads as something else, that mistake in
    words (trial 42), else ``""``: Flax's "Cannot extract graph node from different trace level" (a model,
    optimizer or Variable made outside the ``jax.jit`` / ``jax.shard_map`` the step traces, used inside it, or
    one trace deeper, inside the function ``jax.value_and_grad`` differentiates: trial 53; merged there without a
    copy, a scanned model's RNG counts raised it again, trial 61), or
    ``jax.shard_map``'s "out_specs which require replication" (a value returned as replicated that varies over
    an axis)."""
    text = str(err)
    if "Cannot extract graph node from different trace level" in text:
        return (
            "a Flax object made outside the function the step traces (jax.jit, jax.shard_map) is used inside it: "
            "the model or optimizer captured by that function, not passed in; pass its state in (nnx.split "
            "outside, nnx.merge inside) or use nnx.jit / nnx.shard_map, which carry it. The same holds one trace "
            "deeper: a model merged inside jax.shard_map and captured by the function jax.grad / "
            "jax.value_and_grad differentiates (or a jax.lax.scan body) is used in that inner trace. Use "
            "nnx.value_and_grad on the model merged in the body, which carries what the forward pass writes (an "
            "RNG stream's count under Dropout or nnx.scan, a BatchNorm's statistics); with jax.value_and_grad, "
            "merge a copy inside the differentiated function (nnx.merge(graphdef, params, rest, copy=True)) and "
            "return the state it writes to nnx.update it after"
        )
    found = _REPLICATION.search(text)
    if found is not None and _gathers(err):
        at, spec, axis = found.groups()
        return (
            f"the step's jax.shard_map returns as replicated over {axis!r} (out_specs{at} {spec}) a value its "
            "function builds with jax.lax.all_gather: all_gather's output is typed varying under check_vma though "
            "its copies agree; return it with check_vma=False, or reduce or pcast it as JAX's message says (or, "
            f"where the value returned is not the gathered one, a value computed per device and never reduced over "
            f"{axis!r}: a loss or gradient without its pmean or psum over {axis!r})"
        )
    if found is not None:
        at, spec, axis = found.groups()
        return (
            f"the step's jax.shard_map returns as replicated over {axis!r} (out_specs{at} {spec}) a value computed "
            f"per device and never reduced over {axis!r} (a loss or gradient without its pmean or psum over "
            f"{axis!r}); reduce it before returning it, or give it a spec that splits it over {axis!r}"
        )
    return ""


_MAPPED = re.compile(r"shard_map applied to the function '(\w+)'")

SAME_LINES_KEPT = 3
"""How many of a run of lines alike (one per leaf: ``out_specs[...]['kernel'] is P() which implies ...``)
:func:`jax_text` keeps before saying how many more there are."""


_ALIKE = re.compile(r"\[[^\]]*\]|'[^']*'|\d+")


def jax_text(err: Exception) -> str:
    """``str(err)`` with each run of consecutive lines that differ only in their brackets, quotes and numbers cut
    to its first :data:`SAME_LINES_KEPT` and ``"... and N more lines like these"`` (trial 58 D: ``jax.shard_map``'s
    replication error repeated one bullet per leaf, about 50, after shardcheck's hint)."""
    out: list[str] = []
    for _, alike in itertools.groupby(str(err).split("\n"), key=lambda line: _ALIKE.sub("", line)):
        run = list(alike)
        more = len(run) - SAME_LINES_KEPT
        out += run if more <= 1 else [*run[:SAME_LINES_KEPT], f"... and {more} more lines like these"]
    return "\n".join(out)


def _gathers(err: Exception) -> bool:
    """Whether the function ``err`` (``jax.shard_map``'s replication error) names, found among the locals of the
    frames its traceback passed through (the user's step that defined it), calls ``jax.lax.all_gather`` in its
    source; ``False`` where it cannot be found or read."""
    found = _MAPPED.search(str(err))
    if found is None:
        return False
    name, tb = found.group(1), err.__traceback__
    while tb is not None:
        fn = tb.tb_frame.f_locals.get(name) or tb.tb_frame.f_globals.get(name)
        if callable(fn):
            try:
                return "all_gather" in inspect.getsource(fn)
            except (OSError, TypeError):
                return False
        tb = tb.tb_next
    return False


def _raised(cand: Candidate, err: Exception, t: int, cause: str) -> str:
    """Who raised what where: ``"the candidate step 'my_step' raised TypeError at step 0 (hint)"``; a built-in
    strategy's (``Candidate.builtin``) is shardcheck's own, not the user's candidate (trial 46: ``shardcheck
    record`` of the default fsdp step read "the candidate step 'fsdp' raised TypeError"): ``"shardcheck's
    built-in step 'fsdp' raised TypeError at step 0 (hint; a limitation or a bug of shardcheck's fsdp step, not a
    fault of your model or step)"``."""
    if not cand.builtin:
        return f"the candidate step {cand.name!r} raised {type(err).__name__} at step {t}{cause}"
    hint = f"{cause[2:-1]}; " if cause else ""
    return (
        f"shardcheck's built-in step {cand.name!r} raised {type(err).__name__} at step {t} ({hint}a limitation or "
        f"a bug of shardcheck's {cand.name} step, not a fault of your model or step)"
    )


def run_step(
    fn: str, cand: Candidate, model, optimizer, batch, kwargs: Mapping, t: int, step: Callable | None = None
) -> tuple:
    """One step of ``cand`` on ``(model, optimizer)`` in place: ``(loss, grads)``, either ``None`` when the step
    does not return it (:func:`unpack`). The one step call of the harness's loop and of a recorded run
    (:func:`~shardcheck.parity.harness.recorded.record_run`); ``fn`` names the caller in its errors. ``step``:
    called in place of ``cand.step`` (the same step on the pair's Variables found once), with its errors.

    Raises:
        CandidateError: the step raised (the original error is its ``__cause__``), with the likely cause first
            where the harness sees one (a batch whose rows do not split into the batch shards of the mesh; the
            model's annotations naming an axis the mesh lacks; the state of the optimizer ``make_optimizer`` made
            shaped otherwise than its transformation's init: :func:`_state_shape_hint`).
        TypeError: as :func:`unpack`.
    """
    from shardcheck.parity.report import CandidateError
    from shardcheck.task import batch_size

    for hook in (cand.make_optimizer, cand.view_optimizer):
        if isinstance(hook, _Hook):
            hook.step = t  # what its error names
    try:
        out = (cand.step if step is None else step)(model, optimizer, batch, **kwargs)
    except Exception as err:
        s, rows = cand.num_shards, batch_size(batch)
        batch_error = not _names_other_shape(
            err, batch
        )  # an error on a leaf of another shape: not the batch's
        hint = _split_hint(rows, s, kwargs.get("mesh")) if s and s > 1 and rows % s and batch_error else ""
        if hint and _about_placement(
            err
        ):  # the annotations may not split either (trial 40: fsdp=3 on dims of 16)
            also = _annotation_cause(err, model, kwargs.get("mesh"))
            hint += f"; and {also}" if also else ""
        # the axis the error names first (trial 27), then the annotations' own mismatch (an uneven split), only
        # for an error about placement (trial 29: an unreduced gradient's lax.cond TypeError read as one)
        hint = (
            hint
            or _varying_hint(err)
            or _traced_hint(err)
            or _batch_key_hint(err, batch)
            or _process_hint(err)
            or _mesh_axis_hint(err, kwargs.get("mesh"), model)
            or _annotation_cause(err, model, kwargs.get("mesh"))
        )
        hint = hint or (_state_shape_hint(model, optimizer) if cand.make_optimizer is not None else "")
        if s and s > 1 and rows % s and not batch_error:  # trial 43: an annotation's uneven split (fsdp=3 on
            # dims of 16) raised first, and the batch's 16 rows do not split over 6 devices either: both named
            split = _split_hint(rows, s, kwargs.get("mesh"))
            hint = f"{hint}; and {split}" if hint else split
        # the likely cause first: a JAX error's own text can run to several lines
        cause = f" ({hint})" if hint else ""
        raise CandidateError(f"{fn}: {_raised(cand, err, t, cause)}: {jax_text(err)}", t, hint) from err
    who = f"the candidate step {cand.name!r}" if fn == "check_parity" else f"the {cand.name!r} step"
    return unpack(out, who, t, fn=fn)


def step_jaxpr(cand: Candidate, model, optimizer, batch, kwargs: Mapping):
    """One abstract trace of the user's step ``cand.step(model, optimizer, batch, **kwargs)`` on copies of
    ``(model, optimizer)`` (``jax.make_jaxpr``: nothing computed, neither side changed), as a ``ClosedJaxpr``;
    ``None`` for a built-in strategy, a candidate that makes its own optimizer, or a step that does not trace
    (one that reads a value on the host: ``float(loss)``)."""
    if cand.builtin or cand.make_optimizer is not None:
        return None
    graphdef, state = nnx.split((model, optimizer))

    def pure(state):
        m, o = nnx.merge(graphdef, state, copy=True)
        cand.step(m, o, batch, **kwargs)
        return nnx.state((m, o))

    try:
        return jax.make_jaxpr(pure)(state)
    except Exception:  # noqa: BLE001  (a step that cannot be traced abstractly: nothing read from it)
        return None
