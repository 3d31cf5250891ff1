"""The forward stage one level down: the first module whose output differs while its inputs matched.

Where a failing step's first difference is the forward pass (:mod:`shardcheck.parity.diagnosis.localization`),
the harness runs the task's forward twice at equal parameters, recording every module method call's array inputs
and array output (:mod:`shardcheck.parity.harness.module_probe`): once as the reference runs (one device) and once
under the candidate's placement and mesh. :func:`find_module` reads the calls in the order they finished (a child
before its parent) and names the first whose output differs while its inputs matched: Megatron's rule for its
determinism tooling. A call whose input already differs is downstream of the fault, not its place. Where the named
module called modules of its own, it says which part of its own code: between two children's calls (a child got a
different input while every earlier child's output matched), or after them (every child matched).
:class:`ModuleFinding` is what that comparison found, in words and as a dict.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

DIFFERS, MATCHES, NOT_CAPTURED = "differs", "matches", "not captured"
INPUT_DIFFERS = "input differs"
_LISTED = 4  # child names a sentence lists before "and N more"


@dataclasses.dataclass(frozen=True)
class ModuleCall:
    """One call of a module method, as recorded on one side.

    Attributes:
        name: the module path and method as ``nnx.capture`` keys it (``"blocks.0.attn.__call__"``; ``"... (call
            2)"`` for its second call, counted in the order the calls finished).
        start, end: the call's place in the forward's sequence of call starts and ends (ints, from 0).
        parent: ``start`` of the recorded call that made this call, ``-1`` for a call made by the loss itself.
        inputs: the call's array arguments (positional then keyword, pytrees flattened), host NumPy arrays; other
            arguments (Python numbers, strings, modules, PRNG keys) are not compared.
        output: the array leaves of what the call returned, host NumPy arrays.
    """

    name: str
    start: int
    end: int
    parent: int
    inputs: tuple
    output: tuple


@dataclasses.dataclass(frozen=True)
class Difference:
    """How one list of arrays compares with the reference's (:func:`compare`).

    Attributes:
        max_abs_err: the largest ``|c - r|`` over the entries finite on both sides (of the array that exceeds its
            tolerance the most, or comes nearest); ``inf`` where the shapes differ.
        tolerance: that array's ``atol + rtol * max|r|`` (``0`` for integers and booleans: compared exactly).
        not_finite: entries NaN or infinite where the reference's are finite (``0``: none).
    """

    max_abs_err: float = 0.0
    tolerance: float = 0.0
    not_finite: int = 0

    @property
    def differs(self) -> bool:
        return self.not_finite > 0 or self.max_abs_err > self.tolerance

    def text(self) -> str:
        """``"max abs err 0.444 > tolerance 0.000173"``, ``"not finite (...)"`` or ``"another shape"``."""
        if self.not_finite:
            return f"not finite: {self.not_finite} entries NaN or infinite where the reference's are finite"
        if self.max_abs_err == float("inf"):
            return "max abs err inf (another shape, or a NaN or infinity of the reference's not held)"
        sign = ">" if self.differs else "<="
        return f"max abs err {self.max_abs_err:.3g} {sign} tolerance {self.tolerance:.3g}"


OUTPUT_ROUNDING = 16.0
"""A module output's allowed compute rounding, in unit roundoffs of the compute dtype, relative to its largest
reference element: ``16 eps_c max|r|`` (:func:`~shardcheck.parity.harness.module_probe.module_tolerance`), and at
least that of an array held in a dtype coarser than float32 whatever the policy read (a bfloat16 output:
``max(rtol, 16 eps_dtype)``). Its own code rounds intermediates in that dtype (logits rounded to bfloat16 before a
softmax move its weights by ``eps |logit|``), so the error is not one rounding of the output. Measured on trial
10's T5 (bfloat16 compute, mesh data=2 x fsdp=2, correct modules): up to 8.4 eps_bf16 (a cross-attention's
output projection's input); at 4 eps (0.031) the probe named that correct attention as the module that differs."""


def compare(ref: tuple, cand: tuple, rtol: float, atol: float) -> Difference:
    """The :class:`Difference` of the candidate's arrays ``cand`` from the reference's ``ref`` (paired in order):
    of the array that differs the most. Each array normwise, ``atol + rtol max|r|`` over its finite entries, with
    ``rtol`` at least :data:`OUTPUT_ROUNDING` eps of an array held in a dtype coarser than float32 (bfloat16,
    float16); integers and booleans exactly; a NaN or infinity where the reference's entry is finite is
    ``not_finite``."""
    diffs = [_array_difference(r, c, rtol, atol) for r, c in zip(ref, cand, strict=True)]
    return max(diffs, key=lambda d: (d.not_finite, d.max_abs_err - d.tolerance), default=Difference())


def _array_difference(r: np.ndarray, c: np.ndarray, rtol: float, atol: float) -> Difference:
    if r.shape != c.shape:
        return Difference(float("inf"), 0.0)
    exact = not jnp.issubdtype(r.dtype, jnp.inexact)  # numpy's reads bfloat16 as not inexact
    if not exact and jnp.finfo(r.dtype).eps > jnp.finfo(np.float32).eps:
        rtol = max(rtol, OUTPUT_ROUNDING * float(jnp.finfo(r.dtype).eps))
    r, c = r.astype(np.float64), c.astype(np.float64)
    finite = np.isfinite(r)
    both = finite & np.isfinite(c)
    unheld = ~finite & (r != c) & ~(np.isnan(r) & np.isnan(c))  # a reference NaN or infinity not held
    err = float("inf") if unheld.any() else float(np.max(np.abs(r[both] - c[both]), initial=0.0))
    bound = 0.0 if exact else atol + rtol * float(np.max(np.abs(r[finite]), initial=0.0))
    return Difference(err, bound, int(np.sum(finite & ~both)))


@dataclasses.dataclass(frozen=True)
class ModuleFinding:
    """What the module calls showed at the localized step.

    Attributes:
        status: ``"differs"`` (``module`` is the first call whose output differs while its inputs matched),
            ``"input differs"`` (no call does: ``module``, the first whose output differs, got a different input
            from code outside every recorded call), ``"matches"`` (every output is within tolerance) or
            ``"not captured"`` (the capture failed: ``error``).
        module: that call's module path and method (``"blocks.1.mlp.__call__"``, ``"... (call 2)"``), or, for
            ``"matches"``, the output nearest its tolerance; else ``""``.
        max_abs_err: its output's largest absolute error over the entries finite on both sides, else ``0.0``.
        tolerance: its output's tolerance, ``atol + rtol * max|reference output|``.
        matched_before: how many recorded outputs finished before it and matched (``"matches"``: all of them).
        compared: how many calls were compared in all.
        where: the candidate side's placement in words (``"mesh data=2 x model=2"``, ``"one device"``).
        error: why nothing was compared (``"not captured"``): the exception's type name when the capture or a
            forward raised, or ``"no module output on both sides"``; else ``""`` (in the JSON, not in the
            sentence).
        not_finite: entries of its output NaN or infinite where the reference's are not (``0``: none).
        input_of: the call whose input differs: for ``"differs"``, the first child of ``module`` (in the order
            it called them) that got a different input (``""``: every child's input matched, or it has none); for
            ``"input differs"``, ``module`` itself.
        input_max_abs_err, input_tolerance, input_not_finite: that input's difference, as for the output.
        children_matched: for ``"differs"``, the children ``module`` called before ``input_of`` (all of them
            where ``input_of`` is ``""``), whose inputs and outputs matched.
        inside_transforms: the ``"Class.method"`` of module calls made inside a transform of the forward (a
            ``jax.lax.scan`` body such as a recurrent cell's, a ``vmap``, ``jax.checkpoint`` or ``shard_map``
            body): not recorded, so not compared; the module that runs the transform stands for them.
    """

    status: str
    module: str = ""
    max_abs_err: float = 0.0
    tolerance: float = 0.0
    matched_before: int = 0
    compared: int = 0
    where: str = ""
    error: str = ""
    not_finite: int = 0
    input_of: str = ""
    input_max_abs_err: float = 0.0
    input_tolerance: float = 0.0
    input_not_finite: int = 0
    children_matched: tuple = ()
    inside_transforms: tuple = ()

    def text(self) -> str:
        """The finding in one sentence with its numbers (what was observed, nothing more)."""
        return self._finding() + self._transforms()

    def _transforms(self) -> str:
        """Where module calls inside a transform were left out: which, and that they are not compared."""
        if not self.inside_transforms or self.status == NOT_CAPTURED:
            return ""
        return (
            f"; {_listed(self.inside_transforms)} runs inside a transform of the forward (a jax.lax.scan body or "
            "the like): not compared on its own, the module that runs that transform stands for it"
        )

    def _finding(self) -> str:
        if self.status == NOT_CAPTURED and self.inside_transforms:
            return (
                "no module call could be compared: every module method the forward calls runs inside a transform "
                f"of the loss ({_listed(self.inside_transforms)}; a jax.checkpoint, vmap, lax.scan or shard_map "
                "body), whose outputs the probe does not record; the localization stays at the forward stage (to "
                "localize by module, call the model outside such a transform in the task's loss_fn)"
            )
        if self.status == NOT_CAPTURED:
            return (
                "the module probe could not run the task's forward with its module outputs recorded (it raised; "
                "the JSON report's module.error names the exception); the localization stays at the forward stage"
            )
        if self.status == MATCHES:
            worst = f"; worst {self.module}: {self._output().text()}" if self.module else ""
            return (
                f"every module's output matches under the candidate's placement ({self.where}; {self.compared} "
                f"captured outputs at equal parameters{worst}): the forward difference is in the step's own "
                "forward or loss, not in a module as the task's loss calls it (the probe runs the task's loss on "
                "the candidate's placement, so code of the step's own inside its jax.shard_map, such as a "
                "collective it leaves out or a batch statistic it computes per shard, is not seen by it)"
            )
        if self.status == INPUT_DIFFERS:
            return (
                f"no module's output differs while its inputs match under the candidate's placement ({self.where}): "
                f"the first module whose output differs, {self.module} ({self._output().text()}, at equal "
                f"parameters), got a different input already ({self._input().text()}): the difference begins "
                "before it, in code outside every captured module call (the step's own forward or loss)"
            )
        return (
            f"the first module whose output differs while its inputs match, under the candidate's placement "
            f"({self.where}), is {self.module} ({self._output().text()}, at equal parameters): the difference "
            f"begins in {self._own_code()}"
        )

    def _own_code(self) -> str:
        """Where in ``module``'s own code: its whole computation, between two children's calls, or after them."""
        before = _listed(self.children_matched)
        if self.input_of:
            earlier = (
                f"while every earlier child's output ({before}) matched"
                if before
                else f"though it is the first child called and {self.module}'s inputs match"
            )
            return (
                f"{self.module}'s own code {'between its children' if before else 'before its first child'}'s "
                f"calls: its child {self.input_of} got a different input ({self._input().text()}) {earlier}"
            )
        if before:
            return (
                f"{self.module}'s own code after its children's calls: every child's input and output matched "
                f"({before})"
            )
        return f"{self.module}'s own computation as sharded (it calls no captured module)"

    def _output(self) -> Difference:
        return Difference(self.max_abs_err, self.tolerance, self.not_finite)

    def _input(self) -> Difference:
        return Difference(self.input_max_abs_err, self.input_tolerance, self.input_not_finite)

    def to_dict(self) -> dict:
        """A JSON-ready dict of the fields and ``text``."""
        return {
            **dataclasses.asdict(self),
            "children_matched": list(self.children_matched),
            "inside_transforms": list(self.inside_transforms),
            "text": self.text(),
        }


def _listed(names: tuple) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def find_module(ref: dict, cand: dict, tol: tuple[float, float], where: str) -> ModuleFinding:
    """The first call, in the order the candidate's calls finished, whose output differs while its inputs matched.

    Args:
        ref, cand: each side's calls, ``{name: ModuleCall}``; a call is compared where both sides made it with as
            many input and output arrays.
        tol: ``(rtol, atol)`` of every input and output (:func:`compare`).
        where: the candidate's placement in words.

    Returns:
        ``"differs"`` with the call, its error and where in its own code (``input_of``, ``children_matched``);
        ``"input differs"`` where every call whose output differs got a different input (the first such);
        ``"matches"`` with the output nearest its tolerance; ``"not captured"`` where no call is on both sides.
    """
    names = [
        n for n in sorted(cand, key=lambda n: cand[n].end) if n in ref and _arity(ref[n]) == _arity(cand[n])
    ]
    if not names:  # the forward called no module method, or the two sides none in common
        return ModuleFinding(NOT_CAPTURED, error="no module output on both sides", where=where)
    outs = {n: compare(ref[n].output, cand[n].output, *tol) for n in names}
    ins = {n: compare(ref[n].inputs, cand[n].inputs, *tol) for n in names}
    first = None
    for i, name in enumerate(names):
        if outs[name].differs and not ins[name].differs:
            matched = sum(not outs[n].differs for n in names[:i])
            return _in_own_code(name, outs[name], matched, [n for n in names if n != name], cand, ins, where)
        first = first or (name if outs[name].differs else None)
    if first is not None:
        out, inp = outs[first], ins[first]
        matched = sum(not outs[n].differs for n in names[: names.index(first)])
        return ModuleFinding(
            INPUT_DIFFERS, first, out.max_abs_err, out.tolerance, matched, len(names), where, "",
            out.not_finite, first, inp.max_abs_err, inp.tolerance, inp.not_finite,
        )  # fmt: skip
    worst = max(names, key=lambda n: outs[n].max_abs_err / max(outs[n].tolerance, 1e-300))
    return ModuleFinding(
        MATCHES, worst, outs[worst].max_abs_err, outs[worst].tolerance, len(names), len(names), where
    )


def _arity(call: ModuleCall) -> tuple[int, int]:
    return len(call.inputs), len(call.output)


def _in_own_code(
    name, out: Difference, matched: int, others: list, cand: dict, ins: dict, where
) -> ModuleFinding:
    """The ``"differs"`` finding of ``name``: its children (the compared calls it made, in the order it made them)
    up to the first whose input differs, and that child's input difference."""
    children = sorted((n for n in others if cand[n].parent == cand[name].start), key=lambda n: cand[n].start)
    child = next((n for n in children if ins[n].differs), "")
    before = tuple(children[: children.index(child)] if child else children)
    inp = ins[child] if child else Difference()
    return ModuleFinding(
        DIFFERS, name, out.max_abs_err, out.tolerance, matched, len(others) + 1, where, "", out.not_finite,
        child, inp.max_abs_err, inp.tolerance, inp.not_finite, before,
    )  # fmt: skip
