"""A gradient reduced over an axis that autodiff had already summed it over: read from the step's own program.

Inside ``jax.shard_map`` with ``check_vma=True`` (the default), an input that does not vary over a mesh axis (a
replicated ``P()`` parameter) is cast to varying (``pvary``) where it meets a value that does (a batch shard).
The transpose of that cast is a ``psum``: the gradient of each shard's own loss with respect to the replicated
input comes out already summed over the axis (JAX's ``shard_map`` docs, "Efficient transposition of
replication-checked code"). A step written as for ``pmap`` or ``check_vma=False``, ``pmean(grad(local_loss))``,
then reduces a summed gradient: its ``pmean`` keeps the sum (x S), a ``psum`` sums it again (x S^2).

:func:`read_step` finds that in a jaxpr of the step (``jax.make_jaxpr``: nothing computed): a ``psum`` the
step wrote, over an axis, of a value computed from a ``psum`` that autodiff's transpose made over the same axis
(and not cast back to varying over it by autodiff since: the transpose of a ``psum`` the forward pass wrote).
:func:`with_resummed` says it with the ``summed`` finding it explains.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from jax.extend import core

from shardcheck.parity.diagnosis.evidence import Diagnosis
from shardcheck.parity.tolerance.matmul import nested_jaxprs

REDUCTIONS = ("psum", "psum_invariant")
"""A ``psum`` (and so a ``pmean``, a ``psum`` and a division) as a jaxpr writes it, with and without
``check_vma``."""


BROADCASTS = ("pvary", "pbroadcast")
"""The cast of a value invariant over an axis to varying over it, as a jaxpr writes it (the transpose of a
``psum``)."""


def _var(v) -> bool:
    """A variable of a jaxpr (a ``Literal`` is a constant: nothing carried)."""
    return isinstance(v, core.Var) and not isinstance(v, core.Literal)


def _made_by_autodiff(eqn) -> bool:
    """An equation that a transpose (``jax.grad``'s backward pass) wrote, by its name stack."""
    return "transpose" in str(eqn.source_info.name_stack)


def _axes(eqn) -> frozenset[str]:
    axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    return frozenset(a for a in (axes if isinstance(axes, tuple | list) else (axes,)) if isinstance(a, str))


def _walk(jaxpr, summed: dict, found: set, transposed: bool = False) -> dict:
    """Carry ``summed`` (``{var: axes autodiff summed it over}``) forward through ``jaxpr``; add to ``found`` the
    axes of every reduction the step wrote over a value so summed. Returns the summed outputs, by position.
    ``transposed``: ``jaxpr`` is nested in an equation a transpose wrote (a scan body's backward pass, whose own
    equations' name stacks start afresh)."""
    for eqn in jaxpr.eqns:
        seen = frozenset().union(*(summed.get(v, frozenset()) for v in eqn.invars if _var(v)))
        name = eqn.primitive.name
        by_autodiff = transposed or _made_by_autodiff(eqn)
        if name in REDUCTIONS and by_autodiff:
            seen = seen | _axes(eqn)
        elif name in BROADCASTS and by_autodiff:
            # a summed value cast back to varying (the transpose of a psum the forward pass wrote: BatchNorm's
            # pmean of its batch statistics over axis_name) feeds each shard's own gradient: no longer a sum
            # over those axes (trial 60: a shard_map step syncing BatchNorm over 'data', its parameters cast to
            # varying, read "reduces over 'data' a gradient that jax.grad had already summed")
            seen = seen - _axes(eqn)
        elif name in REDUCTIONS and seen & _axes(eqn):
            found.update(seen & _axes(eqn))
        for inner in nested_jaxprs(eqn.params):
            # a nested program's inputs line up with the equation's last ones (a cond's index comes first)
            ins = list(eqn.invars)[len(eqn.invars) - len(inner.invars) :] if inner.invars else []
            carried = {
                iv: summed[v] for iv, v in zip(inner.invars, ins, strict=False) if _var(v) and v in summed
            }
            outs = _walk(inner, carried, found, by_autodiff)
            if len(inner.outvars) == len(eqn.outvars):
                for i, axes in outs.items():
                    summed[eqn.outvars[i]] = summed.get(eqn.outvars[i], frozenset()) | axes
            elif outs:
                seen = seen | frozenset().union(*outs.values())
        if seen:
            for v in eqn.outvars:
                summed[v] = summed.get(v, frozenset()) | seen
    return {i: summed[v] for i, v in enumerate(jaxpr.outvars) if _var(v) and v in summed}


def read_step(jaxpr) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(resummed, applied)`` of a training step's ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``): the mesh axes over
    which it reduces a value that its own autodiff had already summed over them (module docstring), and the axes
    over which a ``psum`` that autodiff made reaches its outputs (its new state: a gradient summed over them,
    applied as it came), each sorted; ``()`` where there are none."""
    found: set[str] = set()
    outs = _walk(getattr(jaxpr, "jaxpr", jaxpr), {}, found)
    return tuple(sorted(found)), tuple(sorted(frozenset().union(*outs.values())))


MECHANISM = (
    "inside jax.shard_map (check_vma=True, the default) the gradient of each shard's loss with respect to a "
    "replicated (P()) input comes out summed over the axes the loss varies on (JAX's psum, where it transposes the "
    "implicit pvary)"
)
"""Why autodiff sums such a gradient: the sentence both clauses share."""


def _named(axes: Sequence[str], num_shards: int | None) -> tuple[str, str, str]:
    """``(over, code, s)``: ``axes`` in words (``'data' and 'fsdp'``), as ``jax.lax`` takes them (``'data'``,
    ``('data', 'fsdp')``), and their devices in all (``num_shards``; ``"S"`` where ``None``)."""
    over = " and ".join(repr(a) for a in axes)
    code = repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))
    return over, code, f"{num_shards}" if num_shards else "S"


def resummed_clause(axes: Sequence[str], num_shards: int | None) -> str:
    """The sentence that names the cause: the step's reduction over ``axes`` of a gradient that autodiff summed
    over them; ``num_shards``: the devices over ``axes`` in all, the factor a pmean leaves (``None``: said as S)."""
    over, code, s = _named(axes, num_shards)
    square = f"{num_shards * num_shards}" if num_shards else "S^2"
    return (
        f"The step reduces over {over} a gradient that jax.grad had already summed over {over}: {MECHANISM}, so a "
        f"pmean after it keeps the sum (x{s}) and a psum sums it again (x{square}). Differentiate the mean loss "
        f"(jax.lax.pmean(loss, {code}) inside the function jax.grad takes) and reduce nothing after it, or keep the "
        f"pmean and cast the parameters to varying before jax.grad (jax.lax.pcast(params, {code}, to='varying')), "
        "so that each shard's gradient stays its own (docs/reduction_cases.md C2)."
    )


def applied_clause(axes: Sequence[str], num_shards: int | None) -> str:
    """The sentence for a summed step whose applied gradient autodiff summed over ``axes`` and that reduces it no
    further (a pmean forgotten, or a loss psum-ed): where the differentiated loss is each shard's own, that sum is
    the factor. ``num_shards``: the devices over ``axes`` in all (``None``: said as S)."""
    over, code, s = _named(axes, num_shards)
    return (
        f"The gradient the step applies is one jax.grad summed over {over} itself: {MECHANISM}, so where the loss "
        f"it differentiates is each shard's own (or a psum of them), that sum is the x{s}. Differentiate the mean "
        f"loss (jax.lax.pmean(loss, {code}) inside the function jax.grad takes), or divide the gradient by {s} "
        "(docs/reduction_cases.md C2)."
    )


def read_program(jaxpr, mesh, num_shards: int | None):
    """``((resummed, applied), sizes)``: :func:`read_step` of ``jaxpr`` (one abstract trace of the user's step,
    :func:`~shardcheck.parity.harness.candidates.step_jaxpr`; ``None``: nothing read) and the devices over each
    set of axes in all on ``mesh`` (else ``num_shards``, S)."""
    read = ((), ()) if jaxpr is None else read_step(jaxpr)

    def devices(axes):
        sizes = [int(mesh.shape[a]) for a in axes if mesh is not None and a in mesh.shape]
        return math.prod(sizes) if axes and len(sizes) == len(axes) else num_shards

    return read, (devices(read[0]), devices(read[1]))


def with_program(findings: Sequence[Diagnosis], trace, mesh, num_shards: int | None) -> list[Diagnosis]:
    """:func:`with_resummed` of what one abstract trace of the user's step shows, where the leading finding is
    ``summed``; ``findings`` as they are otherwise, with nothing traced. ``trace``: a callable returning that
    jaxpr (:func:`~shardcheck.parity.harness.candidates.step_jaxpr`), called only then. A live check and a
    replay say it alike."""
    findings = list(findings)
    if not findings or findings[0].code != "summed":
        return findings
    return with_resummed(findings, *read_program(trace(), mesh, num_shards))


def with_resummed(
    findings: Sequence[Diagnosis],
    read: tuple[tuple[str, ...], tuple[str, ...]],
    sizes: tuple[int | None, ...],
) -> list[Diagnosis]:
    """``findings`` with the cause the step's program shows after the first one's message, where that is
    ``summed``: :func:`resummed_clause` where it reduces an autodiff-summed gradient again, else
    :func:`applied_clause` where it applies one; else as they are. ``read``: :func:`read_step`'s ``(resummed,
    applied)``; ``sizes``: the devices over each of them in all."""
    findings = list(findings)
    if not findings or findings[0].code != "summed" or not any(read):
        return findings
    first = findings[0]
    clause = resummed_clause(read[0], sizes[0]) if read[0] else applied_clause(read[1], sizes[1])
    said = f"{first.message} {clause}"
    return [dataclasses.replace(first, message=said), *findings[1:]]
