"""The forward stage one level down: the first module whose output differs, in the order the modules finished.

Where a failing step's first difference is the forward pass (:mod:`shardcheck.parity.diagnosis.localization`),
the harness runs the task's forward twice at equal parameters, capturing every module method's output
(``nnx.capture(..., method_outputs=nnx.Intermediate)``): once as the reference runs (one device) and once under
the candidate's placement and mesh (:mod:`shardcheck.parity.harness.module_probe`). The outputs are compared in
the order the modules finished (a child before its parent), so the first that differs is the deepest module whose
output differs while every module output computed before it matched: Megatron's rule for its determinism
tooling (the first layer whose output differs while its inputs matched). :class:`ModuleFinding` is what that
comparison found, in words and as a dict.
"""

from __future__ import annotations

import dataclasses

DIFFERS, MATCHES, NOT_CAPTURED = "differs", "matches", "not captured"


@dataclasses.dataclass(frozen=True)
class ModuleFinding:
    """What the module outputs showed at the localized step.

    Attributes:
        status: ``"differs"`` (``module`` is the first module output out of tolerance), ``"matches"`` (every
            captured module output is within tolerance) or ``"not captured"`` (the capture failed: ``error``).
        module: the first differing output's module path and method, as ``nnx.capture`` keys it
            (``"blocks.1.mlp.__call__"``; ``"... (call 2)"`` for a module's second call), else ``""``.
        max_abs_err: its largest absolute error (or, for ``"matches"``, the worst output's), else ``0.0``.
        tolerance: its tolerance, ``atol + rtol * max|reference output|`` (the same for ``"matches"``).
        matched_before: how many module outputs finished before it and matched (``"matches"``: all of them).
        compared: how many module outputs were compared in all.
        where: the candidate side's placement in words (``"mesh data=2 x model=2"``, ``"one device"``).
        error: why nothing was compared (``"not captured"``): the exception's type name when the capture or a
            forward raised, or ``"no module output on both sides"``; else ``""``.
    """

    status: str
    module: str = ""
    max_abs_err: float = 0.0
    tolerance: float = 0.0
    matched_before: int = 0
    compared: int = 0
    where: str = ""
    error: str = ""

    def text(self) -> str:
        """The finding in one sentence with its numbers (what was observed, nothing more)."""
        if self.status == NOT_CAPTURED:
            return f"module outputs could not be captured ({self.error}); the localization stays at the forward stage"
        numbers = f"max abs err {self.max_abs_err:.3g} {'>' if self.status == DIFFERS else '<='} tolerance "
        numbers += f"{self.tolerance:.3g}"
        if self.status == MATCHES:
            worst = f"; worst {self.module}: {numbers}" if self.module else ""
            return (
                f"every module's output matches under the candidate's placement ({self.where}; {self.compared} "
                f"captured outputs at equal parameters{worst}): the forward difference is in the step's own "
                "forward or loss, not in a module whose output was captured"
            )
        before = self.matched_before
        earlier = (
            "it is the first module output computed"
            if before == 0
            else f"the {before} module output{'s' if before > 1 else ''} computed before it "
            f"match{'' if before > 1 else 'es'}"
        )
        return (
            f"the first module whose output differs under the candidate's placement ({self.where}) is "
            f"{self.module} ({numbers}, at equal parameters); {earlier}: the difference begins in this "
            "module (its own computation as sharded, or an input that no captured module returned)"
        )

    def to_dict(self) -> dict:
        """A JSON-ready dict of the fields and ``text``."""
        return {**dataclasses.asdict(self), "text": self.text()}
