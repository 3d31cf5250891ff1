"""Faults of a mesh's topology, read from the candidate's arrays and the per-leaf update ratios.

Three faults of sharded steps on meshes with several axes, or with a mix of split and replicated leaves, leave
signatures the generic rules cannot name:

* **A reduction over the wrong axes.** A hybrid step (batch over ``("data", "fsdp")``) that all-reduces the
  gradients over ``data`` only leaves copies of a "replicated" leaf that agree along ``data`` and differ along
  ``fsdp`` (:func:`mismatch_axes`): the axes along which they differ are the axes the reduction missed.
* **A replicated leaf reduced twice.** In ``jax.shard_map`` the gradient of a replicated (device-invariant)
  parameter comes back already ``psum``-ed over the axes it is replicated on (``docs/reduction_cases.md`` C2); a
  second, explicit ``psum`` multiplies exactly those leaves by the replica count while the split leaves stay
  right (:func:`leaf_factors` groups the leaves by their gradient factor).
* **A clipping norm counted once per replica.** ``sqrt(psum(sum of squares))`` over replicated gradients counts
  each leaf once per device, so the global norm is ``sqrt(R)`` too large and, whenever clipping is active, every
  gradient entering the optimizer is scaled by ``1/sqrt(R)`` (R the replica count: S for data parallel, the
  ``data`` axis's size for hybrid FSDP) (:func:`clip_factors`).

On a mesh with model axes (tensor / expert parallelism, :func:`axis_roles`) the batch is replicated over them, so
the same signatures have other causes, which the messages name with the affected leaves (:func:`name_leaves`):
copies that differ along ``model`` are a tensor-parallel partial sum never reduced (:func:`missed_axes_message`);
a factor equal to the size of ``model`` on some leaves is a replicated bias added before the psum over ``model``
(:func:`replicated_reduced_message`), on every leaf a sum over ``model`` (:func:`model_axis_factor`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from shardcheck.mesh import batch_axis_names
from shardcheck.parity.diagnosis.evidence import StepRecord
from shardcheck.parity.diagnosis.grouping import n_leaves


def mismatch_axes(a) -> tuple[str, ...]:
    """The mesh axes along which this process's copies of the same slice of ``a`` hold different bytes.

    For each axis, the addressable shards are grouped by their slice and their mesh coordinates on the *other*
    axes; the axis is reported when a group holds two different buffers (copies that differ only by their
    position along that axis). Empty for consistent copies, an array on one device, or one not on a mesh.
    """
    if not isinstance(a, jax.Array) or not isinstance(a.sharding, NamedSharding):
        return ()
    mesh = a.sharding.mesh
    if len(a.addressable_shards) < 2:
        return ()
    coords = {d: tuple(int(i) for i in np.argwhere(mesh.devices == d)[0]) for d in mesh.devices.flat}
    blocks = [
        (tuple((s.start, s.stop, s.step) for s in shard.index), coords[shard.device], shard.data)
        for shard in a.addressable_shards
    ]
    data = {id(b): np.asarray(b).tobytes() for _, _, b in blocks}
    varying = []
    for k, axis in enumerate(mesh.axis_names):
        groups: dict[tuple, set[bytes]] = {}
        for key, c, b in blocks:
            groups.setdefault((key, c[:k] + c[k + 1 :]), set()).add(data[id(b)])
        if any(len(g) > 1 for g in groups.values()):
            varying.append(axis)
    return tuple(varying)


def replica_counts(num_shards: int | None, mesh_shape: dict[str, int] | None) -> list[int]:
    """The replica counts a fault can involve: S, every axis size and product of axes (deduplicated, > 1)."""
    counts = set()
    if num_shards and num_shards > 1:
        counts.update(d for d in range(2, num_shards + 1) if num_shards % d == 0)
    for size in (mesh_shape or {}).values():
        if size > 1:
            counts.add(int(size))
    return sorted(counts, reverse=True)


def clip_factors(num_shards: int | None, mesh_shape: dict[str, int] | None) -> dict[float, int]:
    """``{1/sqrt(R): R}`` for the replica counts R of :func:`replica_counts` (R <= S, so never 1/S)."""
    return {1 / math.sqrt(r): r for r in replica_counts(num_shards, mesh_shape)}


def _param_of(path: str, params: Sequence[str]) -> str | None:
    """The parameter an optimizer-state path belongs to (``"0.mu.fc.kernel"`` -> ``"fc.kernel"``)."""
    best = None
    for p in params:
        if f".{path}".endswith(f".{p}") and (best is None or len(p) > len(best)):
            best = p
    return best


def leaf_factors(leaves, unresolved: Sequence[str] = (), grads: bool = True) -> dict[str, float]:
    """Each parameter's gradient factor candidate / reference at one step, from the most direct evidence.

    Per parameter: its exposed gradient's ratio; else its first moment's or momentum trace's (proportional to
    the gradient); else the square root of its second moment's (``nu``); else its update's (proportional to
    the gradient under SGD). Leaves whose reference change is within tolerance, or whose gradient is at rounding
    level (``unresolved``), carry no factor.

    Args:
        leaves: the step's :class:`~shardcheck.parity.diagnosis.evidence.LeafError` records.
        unresolved: the record's ``unresolved`` names (``"param PATH"``).
        grads: read the exposed gradients; ``False``: the factor of the gradient the optimizer was given (its
            state and updates only), for a step whose exposed gradients match (a clip applied after them).
    """
    noise = {u.split(" ", 1)[-1] for u in unresolved}
    params = [e.path for e in leaves if e.kind == "param" and e.path not in noise]
    seen = [e for e in leaves if e.reference_change is None or e.reference_change > e.tolerance]
    evidence: dict[str, dict[int, float]] = {p: {} for p in params}
    for e in seen:
        if e.ratio is None or not math.isfinite(e.ratio):
            continue
        if e.kind == "grad" and e.path in evidence:
            if grads:
                evidence[e.path][0] = e.ratio
        elif e.kind == "opt_state":
            p = _param_of(e.path, params)
            if p is None:
                continue
            if ".nu." in f".{e.path}.":
                if e.ratio > 0:
                    evidence[p].setdefault(2, math.sqrt(e.ratio))
            else:
                evidence[p].setdefault(1, e.ratio)
        elif e.kind == "param" and e.path in evidence:
            evidence[e.path][3] = e.ratio
    return {p: ev[min(ev)] for p, ev in evidence.items() if ev}


def factor_groups(factors: dict[str, float], rel: float) -> list[tuple[float, list[str]]]:
    """The leaves of ``factors`` (``{path: factor}``) grouped by factor: sorted by factor, a leaf joins the group
    before it when within ``rel`` of that group's first factor; ``[(median factor, paths)]`` in ascending order."""
    groups: list[list[tuple[float, str]]] = []
    for path, f in sorted(factors.items(), key=lambda kv: (kv[1], kv[0])):
        if groups and abs(f - groups[-1][0][0]) <= rel * abs(groups[-1][0][0]):
            groups[-1].append((f, path))
        else:
            groups.append([(f, path)])
    return [(float(np.median([f for f, _ in g])), sorted(p for _, p in g)) for g in groups]


def local_clip_message(step: int, groups: list[tuple[float, list[str]]], evidence: str) -> str:
    """The ``local_clip_norm`` message: the gradients match, the optimizer's factors differ by leaf group."""
    listed = "; ".join(f"x{f:.4g}: {name_leaves(paths)}" for f, paths in groups)
    return (
        f"At step {step} the exposed gradients match the reference's, but the gradient the optimizer was given "
        f"differs by a factor that differs between leaf groups ({evidence}: {listed}), every factor >= 1: each "
        "shard was clipped by its own local norm, norm(global) / norm(local) its factor (optax.clip_by_global_norm "
        "inside jax.shard_map, or a clip of an FSDP shard, sees only the device's part of the gradient). Compute "
        "the norm over the whole gradient before clipping: psum the squared norms of the local shards over the "
        "axes the gradient is split on (a replicated leaf counted once), take the square root, and clip every "
        "shard by that one coefficient."
    )


def clip_coefficient_message(step: int, f: float, evidence: str) -> str:
    """The ``clip_coefficient`` message: the gradients match, the optimizer's gradient is x ``f`` on every leaf."""
    if f > 1:
        norm = (
            "smaller than the global norm: a mean of per-rank norms (ranks holding different parts of the "
            "gradient: FSDP shards, different experts; R ranks whose parts have alike norms give about "
            "sqrt(R)), or a norm over part of the gradients"
        )
    else:
        norm = (
            "larger than the global norm: per-rank norms summed instead of their squares, or leaves counted "
            "more than once"
        )
    return (
        f"At step {step} the exposed gradients match the reference's, but {evidence} are {f:.4g} x the "
        f"reference's on every leaf: the gradient was scaled between the gradients and the optimizer, the clipping "
        f"coefficient differing from the global norm's by {f:.4g} (or another scale applied there). The norm was "
        f"not the global one: {1 / f:.4g} x the global norm where both clips bind, {norm}. Clip by the norm of the whole "
        "gradient: sqrt of the psum, over the axes the gradient is split on, of each device's sum of squares "
        "(a replicated leaf counted once), or optax.clip_by_global_norm on the global arrays."
    )


# ------------------------------------------------------------------------------- batch axes and model axes


def axis_roles(mesh_shape: dict[str, int] | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(batch axes, model axes)`` of a mesh ``{axis: size}`` (:func:`shardcheck.mesh.batch_axes`): the batch
    is split over the first and replicated over the second (tensor parallelism's ``model``)."""
    names = tuple(mesh_shape or {})
    batch = batch_axis_names(names)
    return batch, tuple(a for a in names if a not in batch)


# the names of a sequence (context) parallel axis: a step that places the batch P(batch axes, axis) splits the
# tokens over it, each device a block of positions (ring attention, context parallelism), not the model
SEQUENCE_AXIS_NAMES = ("seq", "sequence", "context", "cp", "sp", "length")


def sequence_axes(mesh_shape) -> tuple[str, ...]:
    """The model axes of ``mesh_shape`` (``{axis: size}``, size > 1) named as a sequence or context axis
    (:data:`SEQUENCE_AXIS_NAMES`, case-insensitive: ``"seq"``, ``"cp"``, ``"context"``...); ``()`` where none."""
    _, model = axis_roles(mesh_shape)
    shape = dict(mesh_shape or {})
    return tuple(a for a in model if str(a).lower() in SEQUENCE_AXIS_NAMES and int(shape[a]) > 1)


def name_leaves(names: Sequence[str], limit: int = 4) -> str:
    """Leaf names for a message: ``"a.x, a.y"``, or with more than ``limit`` their common prefix and the first
    ``limit``: ``"the 36 leaves under 'block' (block.down.bias, ... and 32 more)"``."""
    names = list(names)
    listed = ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
    if len(names) <= limit:
        return listed
    parts = [n.split(" ", 1)[-1].split(".") for n in names]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    # a module prefix, not an optimizer-state index ("0" of "0.mu.a.bias", which every state leaf lies under)
    under = f" under {'.'.join(common)!r}" if common and not common[0].isdigit() else ""
    return f"the {len(names)} leaves{under} ({listed})"


def model_axes_of_size(mesh_shape: dict[str, int] | None, r: int) -> tuple[str, ...]:
    """The model axes whose size is ``r`` (or all of them, when several multiply to ``r``)."""
    _, model = axis_roles(mesh_shape)
    sizes = dict(mesh_shape or {})
    single = tuple(a for a in model if sizes[a] == r)
    if single:
        return single
    return model if len(model) > 1 and math.prod(sizes[a] for a in model) == r else ()


def _axes_text(axes: Sequence[str]) -> str:
    return ", ".join(repr(a) for a in axes)


def model_axis_factor(f: float, num_shards: int | None, mesh_shape, close) -> tuple[str, str] | None:
    """``("summed", phrase)`` for a gradient factor that is the size M of a model axis: the gradients were
    summed over an axis the batch is replicated on (each of its M devices holds the same gradient); ``None``
    otherwise. ``close(a, b)`` compares two ratios."""
    _, model = axis_roles(mesh_shape)
    sizes = {int(mesh_shape[a]) for a in model} | {math.prod(int(mesh_shape[a]) for a in model)}
    for r in sorted(n for n in sizes if n > 1):
        axes = model_axes_of_size(mesh_shape, r) if close(f, r) else ()
        if axes:
            batch, _ = axis_roles(mesh_shape)
            named = _axes_text(axes)
            over_model = (
                f"psum-ed over {named} too, counted {r} times where every device along it holds the "
                f"same batch rows and so the same gradient (reduce the gradients over the batch axes {_axes_text(batch)} "
                f"only: the psum over {named} belongs to the row-parallel layer's output in the forward pass; a "
                f"step that splits the tokens over {named}, as sequence parallelism does, needs that psum for the "
                "leaves replicated over it, and this reading does not apply)"
            )
            own = f"a factor {r} of the step's own (a loss or gradient scaled by a count, such as the micro-batch count)"
            if set(axes) <= set(
                sequence_axes(mesh_shape)
            ):  # the tokens split over it, not the model (trial 45)
                return "summed", _sequence_factor(r, named, num_shards, own)
            if num_shards == r:  # a sum over the batch shards first: the commonest mistake of the two
                return (
                    "summed",
                    f"x{r}: a sum over the {r} batch shards for their mean; or, {r} being also the size of mesh "
                    f"axis {named}, the gradients {over_model}; or {own}",
                )
            return (
                "summed",
                f"x{r}: the size of mesh axis {named}, which splits the model, not the batch. Either the gradients were "
                f"{over_model}; "
                f"or {own} that only matches the axis's size",
            )
    return None


def _sequence_factor(r: int, named: str, num_shards: int | None, own: str) -> str:
    """:func:`model_axis_factor`'s phrase where the axes of size ``r`` are sequence axes (:func:`sequence_axes`):
    the per-block means summed over them, not the gradients of a model split."""
    also = f"; or a sum over the {r} batch shards for their mean" if num_shards == r else ""
    return (
        f"x{r}: the per-block means summed over {named} (a psum) where their mean (or a sum divided by the global "
        f"count) was due: by its name {named} splits the tokens, not the model (each device a block of positions, "
        f"the batch placed over the batch axes and {named}), so a step that divides each block's loss sum by its "
        f"own count and psums the gradients over {named} counts the tokens {r} times; psum the loss sums and the "
        f"token counts over every axis the batch is split over, then divide once{also}; or {own}"
    )


def sequence_forward_hint(head: str, axis: str) -> str:
    """The forward stage's readings where the model axis ``axis`` splits the sequence (:func:`sequence_axes`: a
    context-parallel step, each device a block of positions), after ``head`` (what a loss that differs on such a
    mesh says): a tensor-parallel layer's readings do not apply there (trial 45)."""
    return (
        f"{head}: by its name {axis!r} splits the sequence (context parallelism: each device a block of "
        "positions), e.g. a causal mask or positions taken from the local block (the offset "
        f"jax.lax.axis_index({axis!r}) * block missed), keys and values not gathered over {axis!r} (attention "
        "within the block only), a ring's jax.lax.ppermute sent the wrong way (the block received after j hops "
        "must be the one from (i - j) mod n), the next-token target lost at each block's boundary (targets "
        "shifted within the block), or a loss sum each block divides by its own count."
    )


def _sequence_missed(head: str, on_seq: Sequence[str], batch: Sequence[str], affected: str) -> str:
    """:func:`missed_axes_message` where the missed axes split the sequence (:func:`sequence_axes`): the
    gradients not psum-ed over them (trial 45: a step that reduced them over 'data' only)."""
    m, every = _axes_text(on_seq), (*batch, *on_seq)
    return (
        f"{head}: by its name {m} splits the tokens, not the model (a sequence / context axis: each device along "
        f"it holds a block of positions of the same rows), and the gradients were not psum-ed over {m}: each "
        "device's holds its own block's terms only (and those the other blocks send back through the gathered "
        f"keys and values). psum them over every axis the batch is split over (jax.lax.psum(g, {every!r})), then "
        f"divide by the global token count. If {m} splits the model instead, its devices hold partial results of "
        f"a tensor-parallel layer that were never summed over {m}.{affected}"
    )


def _owns(name: str, path: str) -> bool:
    """Whether the leaf ``name`` (``"param a.b"``, optimizer state ``"opt_state 0.mu.a.b"``) is parameter ``path``'s."""
    return name.endswith((" " + path, "." + path))


def replicas_by_gradient(record: StepRecord) -> tuple[list[str], list[str], list[str]]:
    """``(unreduced, own, downstream)`` for the leaves whose copies differ (``record.replica_mismatches``):
    the gradient paths that fail at that step and own some of them, those leaves, and the others.

    A leaf whose own gradient is within its tolerance while its copies differ parted downstream of the failing
    gradients (an update that reads every gradient: a global-norm clip of gradients left unreduced elsewhere
    differs per device), or by a gradient of its own left unreduced whose difference is too small to show at
    the tolerance's precision (bf16's): the records do not tell which, so it is not named unreduced. Those
    leaves come nearest their tolerance first (their parameter's gradient error over its tolerance, largest
    first: an unreduced one hidden by the precision before the ones that differ only downstream).
    ``([], [], all)`` where the step compared no gradient, or none of the failing gradients is a leaf whose
    copies differ.
    """
    grads = {e.path: e for e in record.leaves if e.kind == "grad"}
    failing = sorted(p for p, e in grads.items() if not e.ok)
    names = record.replica_mismatches
    unreduced = [p for p in failing if any(_owns(n, p) for n in names)]
    own = [n for n in names if any(_owns(n, p) for p in unreduced)]
    rest = [n for n in names if n not in own]
    if unreduced:
        rest.sort(key=lambda n: -_gradient_share(n, grads))
    return unreduced, own, rest


def _gradient_share(name: str, grads) -> float:
    """The error of the gradient of the parameter that owns leaf ``name`` over its tolerance (``grads``:
    ``{path: LeafError}``), 0 where none is known."""
    mine = [e for p, e in grads.items() if _owns(name, p)]
    if not mine:
        return 0.0
    e = max(mine, key=lambda e: len(e.path))
    return e.max_abs_err / e.tolerance if e.tolerance > 0 else 0.0


def replicas_root(record: StepRecord) -> list[str]:
    """The leaves whose copies differ, those whose own gradient differs at that step first
    (:func:`replicas_by_gradient`): the first names a leaf that was left unreduced where the gradients show one."""
    _, own, downstream = replicas_by_gradient(record)
    return own + downstream


# what the leaves whose gradients are within tolerance may be, beside the parameters whose gradients differ
WITHIN = "or by an unreduced gradient too small to show at this precision"


def downstream_note(record: StepRecord) -> str:
    """How the leaves whose copies differ split, where some have gradients that differ and others gradients
    within tolerance; ``""`` otherwise. Counted so the numbers add up: ``"6 of them are the values and optimizer
    state of the 2 parameters whose gradients differ; the other 73 have gradients within tolerance: their copies
    differ downstream of those or by an unreduced gradient too small to show at this precision"``."""
    unreduced, own, downstream = replicas_by_gradient(record)
    if not own or not downstream:
        return ""
    one = len(unreduced) == 1
    whose = (
        "the parameter whose gradient differs"
        if one
        else f"the {len(unreduced)} parameters whose gradients differ"
    )
    held = {"param ": "value" if one else "values", "opt_state ": "optimizer state"}
    what = " and ".join(w for k, w in held.items() if any(n.startswith(k) for n in own)) or "leaves"
    graded, stateless = _by_own_gradient(record, downstream)
    it = "it" if one else "those"
    parts = []
    if graded:
        have, their = ("has a gradient", "its") if len(graded) == 1 else ("have gradients", "their")
        parts.append(f"{have} within tolerance: {their} copies differ downstream of {it} {_why(record, it)}")
    if stateless:
        parts.append(f"{'is' if len(stateless) == 1 else 'are'} {_stateless_phrase(stateless, it)}")
    if len(parts) == 1:
        other = f"the other {len(downstream)} {parts[0]}"
    else:
        other = f"of the other {len(downstream)}, {len(graded)} {parts[0]}; {len(stateless)} {parts[1]}"
    return f"{len(own)} of them {'is' if len(own) == 1 else 'are'} the {what} of {whose}; {other}"


def _why(record: StepRecord, it: str) -> str:
    """How leaves whose gradients are within tolerance come to differ across devices downstream of the unreduced
    gradient(s) ``it``: where the task's optimizer clips by a global norm (``StepRecord.global_clip``), through
    its coefficient, which each device computed from its own copies of every gradient (trial 44: an embedding's
    gradient never reduced, and 36 leaves whose gradients matched differed per device); else :data:`WITHIN`."""
    if record.global_clip is None:
        return WITHIN
    return (
        f"through the task's optimizer's global-norm clip (optax.clip_by_global_norm({record.global_clip:g})), "
        f"where it binds: each device computes its coefficient from its own copies of every gradient, {it} among "
        "them, so every leaf's update is scaled by another coefficient on each device"
    )


def _by_own_gradient(record: StepRecord, names: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(graded, stateless)``: the leaves of ``names`` that belong to a parameter whose gradient the step
    compared (its value, its optimizer state), and the others: non-parameter model state (``state model.ema.*``,
    trial 37's EMA copies) and other leaves with no gradient of their own."""
    paths = [e.path for e in record.leaves if e.kind == "grad"]
    graded = [n for n in names if any(_owns(n, p) for p in paths)]
    return graded, [n for n in names if n not in graded]


def _stateless_phrase(stateless: Sequence[str], it: str) -> str:
    """What leaves without a gradient of their own whose copies differ are (after "is"/"are"): non-parameter
    model state, written in the step from the copies that differ (an EMA of the parameters) or from each
    device's own shard (a statistic not reduced); never said to have gradients within tolerance (trial 37)."""
    state = all(n.startswith("state ") for n in stateless)
    what = "non-parameter model state" if state else "leaves with no gradient of their own"
    return (
        f"{what} ({name_leaves(list(stateless))}; no gradient of {'its' if len(stateless) == 1 else 'their'} own): "
        f"written in the step from the copies that differ downstream of {it}, or from each device's own shard (a "
        "statistic not reduced over the batch axes)"
    )


def _downstream_sentence(unreduced: Sequence[str], downstream: Sequence[str], missed: str) -> str:
    """What the leaves whose copies differ while their gradients are within tolerance may be: downstream of
    ``unreduced``, or unreduced by too little to show. Non-parameter model state among them (``state ...``: no
    gradient of its own) is said as such (:func:`_stateless_phrase`), never as having gradients within
    tolerance (trial 37: an EMA written from the parameters' differing copies)."""
    it = "it" if len(unreduced) == 1 else "those"
    named = "the one named" if len(unreduced) == 1 else f"the {len(unreduced)} named"
    is_ = "is" if len(unreduced) == 1 else "are"
    state = [n for n in downstream if n.startswith("state ")]
    graded = [n for n in downstream if n not in state]
    said = ""
    if state:
        are = "is" if len(state) == 1 else "are"
        said = (
            f" {n_leaves(len(state)).capitalize()} whose copies differ {are} {_stateless_phrase(state, it)}."
        )
    if not graded:
        return said + f" Not reduced: {name_leaves([f'grad {p}' for p in unreduced])}."
    have, their = ("has", "its") if len(graded) == 1 else ("have", "their")
    other = "The other" if not state else "The"
    return said + (
        f" {other} {n_leaves(len(graded))} whose copies differ {have} gradients within tolerance of the "
        f"reference's: {their} copies differ across {missed} downstream of {it}, through an update that reads "
        "every gradient (a global-norm clip such as optax.clip_by_global_norm, a global norm), which each device "
        f"computed from its own copies of the unreduced gradients, {WITHIN} (a gradient within tolerance may "
        f"still be unreduced). Reduce every gradient over {missed}, not only {named}: where copies still differ "
        f"once {it} {is_} reduced, another was left unreduced too. Not reduced: "
        f"{name_leaves([f'grad {p}' for p in unreduced])}; leaves whose copies differ with their parameter's "
        f"gradient within tolerance, nearest its tolerance first: {name_leaves(graded)}."
    )


def missed_axes_message(
    step: int,
    leaves: Sequence[str],
    missed: Sequence[str],
    mesh_shape,
    after_gradients: bool = False,
    unreduced: Sequence[str] = (),
    facts=None,
) -> str:
    """The ``wrong_axis_reduction`` message: the copies of ``leaves`` differ along ``missed`` only.
    ``after_gradients``: the loss and every gradient the step returns matched the reference's at that step, so
    the copies parted after them (no forward or gradient reduction is blamed). ``unreduced``: the gradient
    paths that differ at that step and own some of ``leaves`` (:func:`replicas_by_gradient`): named as the ones
    not reduced, the leaves they do not own as having gradients within tolerance (their copies differ downstream
    of them, or by an unreduced gradient too small to show at this precision); ``()`` (the gradients not
    observed, or every leaf's own) blames every leaf's gradient. ``facts``: ``{parameter path: LeafFacts}``,
    where known: a model axis that holds the stages of a pipeline (:func:`pipeline_axes`) is said with a
    pipeline's readings, not a tensor-parallel layer's."""
    batch, model = axis_roles(mesh_shape)
    axes = tuple(mesh_shape or {})
    done = _axes_text(a for a in axes if a not in missed)
    head = (
        f"After step {step} the copies of {leaves[0]} differ along mesh axis {_axes_text(missed)} and agree "
        f"along {done}"
    )
    downstream = [n for n in leaves if not any(_owns(n, p) for p in unreduced)]
    split = bool(unreduced) and bool(downstream) and not after_gradients
    affected = (
        _downstream_sentence(unreduced, downstream, _axes_text(missed))
        if split
        else f" Affected: {name_leaves(leaves)}."
    )
    which = "the gradients were"
    if split:
        which = f"the gradient{'' if len(unreduced) == 1 else 's'} of {name_leaves(unreduced)} "
        which += "was" if len(unreduced) == 1 else "were"
    if after_gradients:
        m = _axes_text(missed)
        return (
            f"{head}, while the loss and every gradient the step returns match the reference's: the copies parted "
            "after the gradients, in what each device did with them before or in the update: a value each device "
            f"computed from its own shard of a leaf split over {m} (a clip by the norm of its local gradients, a "
            "statistic of its local shard) under shard_map with check_vma=False, or an update applied from "
            f"values not reduced over {m}. Compute such values from the whole gradient (psum the squared norms "
            f"over {m} before the square root, or compute them outside shard_map).{affected}"
        )
    on_model = tuple(a for a in missed if a in model)
    if not on_model:
        where = (
            f"every axis {axes}"
            if not model
            else f"{_axes_text(batch)} (and replicated over {_axes_text(model)})"
        )
        return (
            f"{head}: {which} not reduced over {_axes_text(missed)} (reduced over {done} only, or over "
            f"no axis where the step does not split the batch over {done}), though the batch is split over "
            f"{where}. Reduce over all of the batch axes (jax.lax.psum(g, {batch!r}), or a "
            f"psum_scatter over the split axis and a psum over the others).{affected}"
        )
    if any(a in pipeline_axes(mesh_shape, facts) for a in on_model):
        return _pipeline_missed(head, on_model, batch, affected)
    if set(on_model) <= set(sequence_axes(mesh_shape)):  # the tokens split over it, not the model (trial 45)
        return _sequence_missed(head, on_model, batch, affected)
    return _model_missed(head, on_model, batch, affected)


def _model_missed(head: str, on_model: Sequence[str], batch: Sequence[str], affected: str) -> str:
    """:func:`missed_axes_message` where the missed axes split the model: a tensor-parallel partial result never
    summed, or a batch or sequence split over them too."""
    m = _axes_text(on_model)
    return (
        f"{head}: by its name {m} splits the model, not the batch (the batch is split over {_axes_text(batch)} "
        f"and replicated over {m}); if so, its devices hold partial results of a tensor-parallel layer that were "
        f"never summed: the row-parallel layer's output was not psum-ed over {m} (Megatron's g: y = "
        f"jax.lax.psum(h @ w, {on_model[0]!r}) + b), or was psum-ed over {_axes_text(batch)} in its place (a "
        "psum over a batch axis adds other rows' partial results), or the gradient of a column-parallel layer's "
        f"input was not all-reduced over {m} (Megatron's f; jax.shard_map inserts it with check_vma=True, not with "
        f"check_vma=False); or, if the step splits the batch or the sequence over {m} too (the rows or the "
        f"tokens: data or sequence parallelism over {m}), the gradients were not psum-ed over {m}.{affected}"
    )


# the names of a pipeline's stage axis (GPipe, 1F1B: each device along it holds some of the layers)
PIPELINE_AXIS_NAMES = ("stage", "stages", "pipe", "pipeline", "pp")


def pipeline_axes(mesh_shape, facts=None) -> tuple[str, ...]:
    """The model axes of ``mesh_shape`` (``{axis: size}``) that hold a pipeline's stages: named so
    (:data:`PIPELINE_AXIS_NAMES`), or the one axis every leaf split over it is stacked along, its leading
    dimension the axis's size (``nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME: axis})`` over blocks of 2
    or more dimensions), read from ``facts`` (``{parameter path: LeafFacts}``), where known; ``()`` where none."""
    _, model = axis_roles(mesh_shape)
    shape = dict(mesh_shape or {})
    named = tuple(a for a in model if str(a).lower() in PIPELINE_AXIS_NAMES and int(shape[a]) > 1)
    stacked = []
    for a in model:
        split = [f for f in (facts or {}).values() if getattr(f, "axes", ()) == (a,) and f.shape]
        if a not in named and int(shape[a]) > 1 and split:
            # split along the leading dimension (where the placement is known): a stacked (layers, d, h) kernel
            # split along h over 'model' is tensor parallelism, whatever its layer count (trial 56: 2 layers on
            # model=2 read "a pipeline's stages")
            if all(
                len(f.shape) >= 2 and f.shape[0] == int(shape[a]) and getattr(f, "dims", None) in (None, (0,))
                for f in split
            ):
                stacked.append(a)
    return named + tuple(stacked)


def _pipeline_missed(head: str, axes: Sequence[str], batch: Sequence[str], affected: str) -> str:
    """:func:`missed_axes_message` where the missed axis holds a pipeline's stages: a replicated leaf's gradient
    computed on one stage only, not psum-ed over the axis."""
    m, a = _axes_text(axes), axes[0]
    return (
        f"{head}: {m} holds the stages of a pipeline (its name, or the stacked leaves split along it; the batch "
        f"is split over {_axes_text(batch)}): a replicated leaf used on one stage only (the loss's, the head's on "
        "the last stage, a shared embedding's on the first) has its gradient on that stage alone and 0 on the "
        f"others, and was not psum-ed over {m}: sum it before the update (jax.lax.psum(g, {a!r}), then the mean "
        "over the batch axes), as the stacked stages' own gradients need none; or the update of those leaves was "
        f"applied on some stages only.{affected}"
    )


def is_expert_axis(axis) -> bool:
    """An axis that holds the experts of a mixture (``"expert"``, ``"experts"``, ``"expert_group"``...)."""
    return "expert" in str(axis)


def _expert_message(head: str, right: int, r: int, m: str) -> str:
    """``replicated_reduced`` on an expert axis: the expert leaves' gradients were not divided by the group."""
    return (
        f"{head} while the other {right} match: x{r} is the size of mesh axis {m}, the expert-parallel group. An "
        f"expert-parallel scaling fault: these experts' gradients sum the contributions of the {r} ranks of the "
        f"expert group (routing brings every rank's tokens to each expert) and were not divided by the group's "
        f"size: normalize the experts' loss by the group's total token count, or divide their gradients by {r}; "
        f"or they were psum-ed over {m} once too often (a second psum after the reduction was done: remove it, "
        "rather than divide by the size)."
    )


def added_before_psum(axes: Sequence[str], r: int) -> str:
    """The reading of a parameter added to a row-parallel layer's partial sums before their psum over the model
    ``axes`` of size ``r``: it counts once per shard (said by ``replicated_reduced`` and, where the bias is not 0
    and moves the loss, by ``forward_differs``)."""
    return (
        f"a parameter added before the psum over {_axes_text(axes)} counts once per shard: each of the {r} shards "
        f"adds it to its partial sum (a row-parallel layer's replicated bias: add it after the reduction, y = "
        f"jax.lax.psum(h @ w, {axes[0]!r}) + b)"
    )


def replicated_reduced_message(step: int, off: Sequence[str], right: int, r: int, mesh_shape) -> str:
    """The ``replicated_reduced`` message: the gradients of ``off`` are x``r``, the other ``right`` match (a
    factor of the batch shards S would scale those too: not offered beside them)."""
    axes = model_axes_of_size(mesh_shape, r)
    named = name_leaves(off)  # "a, b" or, past 4, "the 20 leaves (a, ... and 16 more)"
    which = named if len(off) > 4 else f"{n_leaves(len(off))} ({named})"
    head = f"At step {step} the gradient of {which} is x{r} the reference's"
    if not axes:
        return (
            f"{head} while the other {right} match: those leaves were reduced twice. In jax.shard_map the gradient "
            f"of a parameter replicated over mesh axes comes back already psum-ed over them ({r} copies; "
            "docs/reduction_cases.md C2), so a second psum multiplies it by the replica count; cast the "
            "replicated parameters with jax.lax.pcast(..., to='varying') before differentiating, or drop the "
            "second reduction for them."
        )
    m = _axes_text(axes)
    if any(is_expert_axis(a) for a in axes):
        return _expert_message(head, right, r, m)
    twice = (
        f"their gradient was psum-ed over {m} twice: in jax.shard_map the gradient of a parameter replicated over "
        f"{m} comes back already psum-ed over it (docs/reduction_cases.md C2), so an explicit psum on top counts "
        f"it {r} times (keep one: a step that splits the tokens over {m}, as sequence parallelism does, needs "
        "exactly one)"
    )
    before = added_before_psum(axes, r)
    # biases alone: the bias added before the reduction first; otherwise the double reduction
    first, second = (before, twice) if all(n.endswith("bias") for n in off) else (twice, before)
    return (
        f"{head} while the other {right} match: x{r} is the size of mesh axis {m}, which splits the model: these "
        f"gradients were reduced over {m} once too often. Either {first}; or {second}; or, where the step splits "
        f"no tokens over {m}, their gradient was psum-ed over {m} though the batch is replicated over it (drop "
        f"that reduction).{_batch_axis_too(mesh_shape, r)}"
    )


def _batch_axis_too(mesh_shape, r: int) -> str:
    """The alternative where a batch axis has the factor's size too: a sum over it where the others average."""
    batch, _ = axis_roles(mesh_shape)
    same = tuple(a for a in batch if (mesh_shape or {}).get(a) == r)
    if not same:
        return ""
    b = _axes_text(same)
    return (
        f" Or, as x{r} is also the size of the batch axis {b}: these gradients were summed over {b} where the "
        f"others are averaged (a psum for a pmean, or a second reduction over {b} for these leaves only)."
    )
