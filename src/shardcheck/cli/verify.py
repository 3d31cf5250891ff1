"""``shardcheck verify``: parity of every strategy (or a user's own step) against the baseline, over many steps."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from shardcheck._catalog import CANDIDATES, COMPARED, REFERENCE, STRATEGY_SPECS
from shardcheck.cli._common import (
    MATMUL_PRECISIONS,
    HelpFormatter,
    add_mesh_argument,
    add_platform_argument,
    apply_mesh,
    configure_devices,
    console_for,
    device_choice,
    early_problem_of,
    library_to_flags,
    needed_mesh,
    reason_line,
    shard_words,
    write_json,
)
from shardcheck.cli._task import (
    add_precision_arguments,
    add_size_argument,
    add_task_arguments,
    precision_overrides,
    task_from_args,
)

if TYPE_CHECKING:  # the steps import JAX; verify --help does not
    from shardcheck.steps import Candidate


# every registered strategy but the reference; the default leaves out multiprocess (it needs a launched run)
STRATEGY_NAMES = COMPARED
DEFAULT_STRATEGIES = ",".join(CANDIDATES)
# what --reference accepts: the single-device step, or a mesh strategy that steps the task's own optimizer
REFERENCE_NAMES = (REFERENCE,) + tuple(
    n for n, s in STRATEGY_SPECS.items() if s.uses_mesh and not s.wraps_optimizer
)


DESCRIPTION = (
    "Draw --steps successive mini-batches of --batch-size rows from a data set (reshuffled every epoch "
    "with --seed), run the single-device baseline (sgd_step) and each strategy from the same initial "
    "model and optimizer, and compare after every step the loss, the gradients (where exposed), every "
    "parameter, every optimizer-state leaf and the step counters, within tolerances derived from the "
    "precision policy (the parameters' and the compute dtype, read from the model or set with "
    "--param-dtype / --compute-dtype), the reduction length and the step. Prints a table per strategy "
    "with its worst leaf, error, tolerance, verdict and diagnosis. Exit status: 0 when every strategy passes "
    "(PASS, or PASS (per step): the trajectories diverged through a non-smooth op but every step matched from "
    "the reference's state), 1 when any fails or cannot verify, 2 on bad input, a reference run that diverges "
    "(lower --lr), or a strategy or candidate whose check raised: its row reads ERROR with the exception's type "
    "and first line, and every other strategy's row is still printed (the exit status is the worst row's); 2 "
    "too on an internal error of shardcheck's (one 'internal error' line naming the exception; "
    "SHARDCHECK_TRACEBACK=1 prints its traceback)."
)
EPILOG = (
    "example: shardcheck verify --devices 8 --optimizer adam --steps 20 --batch-size 64; "
    "your own step: shardcheck verify --candidate my_steps.py:dp_step --devices 4; "
    "against XLA's partitioning of the same step on the same mesh, never whole on one device: "
    "shardcheck verify --task tiny-lm --mesh data=2,model=4 --reference gspmd --strategies none --candidate "
    "my_steps.py:tp_step"
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="prove each sharded step against the single-device baseline, leaf by leaf, over many steps",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    add_task_arguments(p, optimizer_default_help="the optax optimizer (default: sgd; a built-in task's own)")
    add_size_argument(p)
    add_precision_arguments(p, harness=True)
    _add_run_arguments(p)
    _add_check_arguments(p)
    p.set_defaults(
        func=main,
        early_problem=early_problem_of("shardcheck verify", ("steps", "batch_size", "devices", "hidden")),
    )


def _add_run_arguments(p) -> None:
    """What runs: the strategies, the steps, the batch, the devices or mesh, the user's candidate, the seed."""
    p.add_argument(
        "--strategies",
        default=None,
        help=f"comma-separated strategies from {', '.join(STRATEGY_NAMES)}; 'none' with --candidate (default: "
        f"{DEFAULT_STRATEGIES}, less the --reference strategy; with --against: the recorded run's)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps (batches) compared (default: 10; a task file's: all its batches)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="rows per batch B, a multiple of S (default: 64; a built-in task's)",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="S: shards per step, and fake CPU devices to create (default: every device of a launched run, else 2)",
    )
    add_mesh_argument(p)
    add_platform_argument(p)
    p.add_argument(
        "--candidate",
        default=None,
        metavar="MODULE:FUNC|PATH.py:FUNC",
        help="also verify your own in-place step (model, optimizer, batch) or (model, optimizer, batch, mesh), or a "
        "shardcheck.Candidate; without --task, (model, optimizer, x, y[, mesh]); the file's folder is importable "
        "while it loads",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the initial parameters and the shuffling")
    p.add_argument(
        "--reference",
        default=REFERENCE,
        metavar="{" + ",".join(REFERENCE_NAMES) + "}|FILE.py:ATTR",
        help="what every step is compared with: the task's single-device step (default), or a strategy on the "
        "same mesh (gspmd: the plain step jitted over the model's annotations, XLA's collectives); then the state "
        "is created directly sharded and compared on the devices, never whole on one device; or a step of your "
        "own, FILE.py:ATTR or MODULE:ATTR taking (model, optimizer, batch) on one device (one that writes state "
        "the task's step does not, such as an EMA of the parameters, so that it is compared) (--task only)",
    )


def _add_check_arguments(p) -> None:
    """How the check judges and reports: the weak-check acceptance, fixed tolerances, JSON."""
    p.add_argument(
        "--accept-weak",
        action="store_true",
        help="accept a tolerance too loose to tell the update from a factor-S error (else CANNOT VERIFY, exit 1)",
    )
    p.add_argument("--rtol", type=float, default=None, help="fixed relative tolerance (default: derived)")
    p.add_argument("--atol", type=float, default=None, help="fixed absolute tolerance (default: derived)")
    p.add_argument(
        "--matmul-precision",
        default=None,
        choices=MATMUL_PRECISIONS,
        help="the precision of the steps' float32 matmuls, for the tolerance: tf32 (a GPU's default; JAX's "
        "'tensorfloat32'), bfloat16 (one pass: a TPU's default), float32 (a CPU; JAX's 'highest') (default: what "
        "the backend uses for the steps; the report names it, and says so when the stated one is coarser than "
        "the backend's own: the tolerances are then the stated one's)",
    )
    p.add_argument(
        "--json", default=None, metavar="PATH|-", help="also write the reports as JSON ('-': stdout)"
    )
    p.add_argument(
        "--against",
        default=None,
        metavar="RUN.npz",
        help="replay the run shardcheck record saved and compare each step's digests with it, instead of the "
        "reference (its mesh, steps and strategy are the defaults); names the first step and leaf that left its "
        "tolerance",
    )
    p.add_argument(
        "--pin-placement",
        action="store_true",
        help="with --against: a leaf whose sharding differs from the recording's fails (default: values are "
        "compared and a changed placement, a refactor's P() -> P(None, 'fsdp'), is listed in a note)",
    )


@dataclasses.dataclass(frozen=True)
class ErrorRow:
    """The row of a strategy (or the user's candidate) whose check raised instead of giving a report.

    Attributes:
        strategy: the row's name: a built-in strategy, or ``"candidate"``.
        message: the whole one-paragraph message printed on stderr (a candidate's as before: "the candidate step
            raised ...").
        error_type: the exception's class name (the step's own exception when the check wrapped it).
        reason: the exception's first line; a candidate's error whose likely cause shardcheck named (a hint:
            an annotation naming an axis the mesh lacks), that cause.
        step: the 0-based step at which the step raised, or ``None`` when it raised before any step.
        builtin: a built-in strategy (a limitation or a bug of shardcheck's step), not the user's step.
        refused: a built-in strategy that refused the task by a documented limitation (``RowCouplingError``: the
            loss couples the rows of a batch), not an error of the user's step nor of shardcheck: verdict
            ``REFUSED``, said once for all such rows, and left out of the exit status (:func:`exit_status`).
        short: the refusal in a few words for its summary cell (``"the loss couples rows"``); ``""`` otherwise.
    """

    strategy: str
    message: str
    error_type: str
    reason: str
    step: int | None
    builtin: bool
    refused: bool = False
    short: str = ""
    ok = False
    step_ok = False

    @property
    def verdict(self) -> str:
        """``"REFUSED"`` for a refusal by a documented limitation, else ``"ERROR"``."""
        return "REFUSED" if self.refused else "ERROR"

    def to_dict(self) -> dict:
        """``ok`` (False), ``verdict`` (``"ERROR"`` or ``"REFUSED"``), ``codes`` (``["error"]`` or
        ``["refused"]``), ``diagnosis`` (the message) and ``error``: ``type``, ``message`` (the first line),
        ``step``, ``builtin`` and ``refused``."""
        return {
            "ok": False,
            "verdict": self.verdict,
            "step_ok": False,
            "codes": ["refused" if self.refused else "error"],
            "diagnosis": self.message,
            "error": {
                "type": self.error_type,
                "message": self.reason,
                "step": self.step,
                "builtin": self.builtin,
                "refused": self.refused,
            },
        }


def exit_status(reports) -> int:
    """``shardcheck verify``'s exit status from its rows: the worst row's, 2 for an ERROR, 1 for a FAIL or CANNOT
    VERIFY, 0 when every row passes. A ``REFUSED`` row (a built-in strategy that refused the task by a documented
    limitation: :attr:`ErrorRow.refused`) is neither a failure of the user's step nor of shardcheck and does not
    count; where every row is refused, nothing was checked: 2."""
    counted = [r for r in reports.values() if not (isinstance(r, ErrorRow) and r.refused)]
    if not counted or any(isinstance(r, ErrorRow) for r in counted):
        return 2
    return 0 if all(r.step_ok for r in counted) else 1


def _note(message: str) -> None:
    """``message`` on stderr as a note: what the run did not check, which is no error (a strategy's refusal)."""
    from rich.console import Console

    Console(file=sys.stderr).print(f"[bold yellow]note:[/] {message}", highlight=False, soft_wrap=True)


def _fail(message: str) -> int:
    from rich.console import Console

    # soft_wrap: one line whatever the terminal's width (a pipe's is 80 columns)
    Console(file=sys.stderr).print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return 2


def _check_reference_name(spec: str) -> None:
    """``--reference``: one of :data:`REFERENCE_NAMES`, or a step's ``FILE.py:ATTR`` / ``MODULE:ATTR``.

    Raises:
        ValueError: neither, naming the choices.
    """
    if spec in REFERENCE_NAMES or ":" in spec:
        return
    if spec in STRATEGY_SPECS:
        raise ValueError(
            f"shardcheck verify: --reference {spec} is not a strategy on a mesh that steps the task's own optimizer "
            f"(it runs on one device or wraps the optimizer); check it as a candidate (--strategies {spec}) against "
            f"the task's step, or pass one of {', '.join(REFERENCE_NAMES)}"
        )
    close = difflib.get_close_matches(spec, REFERENCE_NAMES, n=1, cutoff=0.6)
    raise ValueError(
        f"shardcheck verify: --reference {spec!r} is neither one of {', '.join(REFERENCE_NAMES)} nor a step's "
        f"FILE.py:ATTR or MODULE:ATTR; {f'did you mean {close[0]!r}? ' if close else ''}pass e.g. --reference "
        "gspmd or --reference my_task.py:reference_step"
    )


def load_reference(spec: str):
    """The ``--reference`` step ``spec`` names (``FILE.py:ATTR`` / ``MODULE:ATTR``): a function ``(model,
    optimizer, batch)`` that steps the task's model and optimizer in place on one device, as
    ``check_parity(..., reference=step)`` takes it; ``None`` for a name of :data:`REFERENCE_NAMES`.

    Raises:
        ValueError: as :func:`load_candidate` (a missing file or attribute, a non-callable), or a step that
            takes a mesh or is a :class:`~shardcheck.Candidate` (a reference runs on one device).
    """
    from shardcheck.steps import Candidate
    from shardcheck.tasks.loading import import_attr

    if spec in REFERENCE_NAMES:
        return None
    fn = "shardcheck verify: --reference"
    step = import_attr(fn, spec, "FUNC")
    if isinstance(step, Candidate) or not callable(step):
        from shardcheck.parity.diagnosis.grouping import article

        raise ValueError(
            f"{fn}: {spec!r} names {article(type(step).__name__)}; pass a function (model, optimizer, batch) that "
            "steps the model and optimizer in place on one device"
        )
    return step


def load_candidate(spec: str, *, task_form: bool = True):
    """The step ``spec`` names: ``package.module:func`` or ``path/to/file.py:func``.

    The attribute is a function, or a :class:`~shardcheck.Candidate` (a step with its own optimizer wrapper,
    counters or shard count), returned as it is for :func:`~shardcheck.check_parity`. A file is imported with its
    folder first on ``sys.path`` (so it can import sibling modules), removed again afterwards.

    Raises:
        ValueError: malformed spec, missing file or module, an import that fails, a missing or non-callable
            attribute, a function whose positional parameters fit neither ``(model, optimizer, batch[, mesh])``
            (``(model, optimizer, x, y[, mesh])`` when ``task_form`` is False), a Candidate whose step is not
            callable or that is given without ``--task``.
    """
    from shardcheck.steps import Candidate
    from shardcheck.tasks.loading import import_attr

    fn = "shardcheck verify: --candidate"
    func = import_attr(fn, spec, "FUNC")
    if isinstance(func, Candidate):
        return _checked_candidate(fn, spec, func, task_form)
    if not callable(func) or isinstance(func, type):  # a class is callable, and constructing it is no step
        from shardcheck.parity.diagnosis.grouping import article

        what = f"the class {func.__name__}" if isinstance(func, type) else article(type(func).__name__)
        raise ValueError(
            f"{fn}: {spec!r} names {what}, not a step; a step is a function "
            + (
                "step(model, optimizer, batch) or step(model, optimizer, batch, mesh)"
                if task_form
                else "step(model, optimizer, x, y) or step(model, optimizer, x, y, mesh)"
            )
            + f" that updates model and optimizer in place{_steps_in_file(fn, spec, task_form)}"
        )
    read = _positional(func)
    if read is None:
        return func
    params, positional, required = read
    least = 3 if task_form else 4
    form = (
        "(model, optimizer, batch) or (model, optimizer, batch, mesh)"
        if task_form
        else ("(model, optimizer, x, y) or (model, optimizer, x, y, mesh)")
    )
    if len(required) > least + 1 or (
        len(positional) < least and not any(p.kind is p.VAR_POSITIONAL for p in params)
    ):
        keyword_only = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
        note = (
            f" ({', '.join(keyword_only)} after the '*' cannot be passed by position: drop the '*')"
            if keyword_only and len(positional) + len(keyword_only) >= least
            else ""
        )
        raise ValueError(
            f"{fn}: {getattr(func, '__name__', spec)} takes {inspect.signature(func)}; it must take "
            f"{form} and update model and optimizer in place{note}"
        )
    return func


def _positional(func) -> tuple[list, list, list] | None:
    """``(parameters, positional, required)`` of ``func``'s signature: every parameter, the positional ones, and
    those of them without a default; ``None`` where ``inspect.signature`` cannot read it (a builtin)."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return params, positional, [p for p in positional if p.default is p.empty]


def _takes_step_arguments(func, task_form: bool) -> bool:
    """Whether ``func``'s positional parameters read as a step's: 3 or 4 required (``(model, optimizer, batch[,
    mesh])``; one more for the regression form's ``x, y``), the first two naming a model or an optimizer, and no
    keyword-only parameter without a default (trial 60: ``kw_only(model, optimizer, batch, *, mesh, extra)`` was
    suggested, and cannot be called as a step)."""
    read = _positional(func)
    if read is None:
        return False
    params, positional, required = read
    if any(p.kind == p.KEYWORD_ONLY and p.default is p.empty and p.name != "mesh" for p in params):
        return False
    least = 3 if task_form else 4
    names = " ".join(p.name.lower() for p in positional[:2])
    return least <= len(required) <= least + 1 and ("model" in names or "opt" in names)


def _steps_in_file(fn: str, spec: str, task_form: bool) -> str:
    """``"; did you mean perceiver.py:step or perceiver.py:gspmd_step (the file's functions that take a step's
    arguments)?"`` for a spec naming something other than a step (trial 43: ``--candidate perceiver.py:SMOOTH``
    named a float, and the refusal said no more), else the file's other public functions, else ``""``."""
    import difflib

    from shardcheck.tasks.loading import spec_module

    target, _, attr = spec.rpartition(":")
    try:
        module = spec_module(fn, spec)
    except ValueError:
        return ""
    functions = sorted(
        name
        for name, obj in vars(module).items()
        if not name.startswith("_") and inspect.isfunction(obj) and obj.__module__ == module.__name__
    )
    steps = [name for name in functions if _takes_step_arguments(getattr(module, name), task_form)]
    close = difflib.get_close_matches(attr, steps, n=len(steps), cutoff=0.0) if steps else []
    if close:
        listed = " or ".join(f"{target}:{name}" for name in close[:4])
        return f"; did you mean {listed} (the file's functions that take a step's arguments)?"
    if functions:
        shown = ", ".join(functions[:8]) + (", ..." if len(functions) > 8 else "")
        return f"; the file's functions ({shown}) take no step's arguments"
    return ""


def _checked_candidate(fn: str, spec: str, candidate: Candidate, task_form: bool) -> Candidate:
    """A :class:`~shardcheck.Candidate` named by ``--candidate``: its step must be callable, and it runs on a task."""
    if not task_form:
        raise ValueError(
            f"{fn}: {spec!r} is a shardcheck.Candidate, whose step takes (model, optimizer, batch); pass the task it "
            "runs on with --task (a Candidate cannot run on the (x, y) regression form)"
        )
    if not callable(candidate.step):
        raise ValueError(
            f"{fn}: {spec!r} is a shardcheck.Candidate whose step is a {type(candidate.step).__name__}, not a "
            "callable; give it step=your_step(model, optimizer, batch)"
        )
    return candidate


def _parse_strategies(text: str, has_candidate: bool) -> list[str]:
    if text.strip().lower() == "none":
        if not has_candidate:
            raise ValueError("shardcheck verify: --strategies none needs --candidate; nothing to verify")
        return []
    names = [s.strip() for s in text.split(",")]
    rule = f"choose from {', '.join(STRATEGY_NAMES)}, comma-separated, each at most once"
    if not any(names) or "" in names:
        raise ValueError(f"shardcheck verify: --strategies {text!r} has an empty name; {rule}")
    unknown = [s for s in names if s not in STRATEGY_NAMES]
    if unknown:
        raise ValueError(f"shardcheck verify: --strategies {text!r}: unknown {unknown}; {rule}")
    repeated = sorted({s for s in names if names.count(s) > 1})
    if repeated:
        raise ValueError(
            f"shardcheck verify: --strategies {text!r} names {', '.join(repeated)} twice; {rule}"
        )
    return names


def _check_args(args) -> tuple[list[str], int]:
    """The strategies and S, after every argument check; fakes the CPU devices (before JAX starts).

    Raises:
        ValueError: a bad flag value (the message names the flag and the fix).
    """
    from shardcheck import _validate, distributed
    from shardcheck.cli._common import positive_problem

    apply_mesh("shardcheck verify", args)
    for flag in ("steps", "batch_size", "devices", "hidden"):
        problem = positive_problem("shardcheck verify", flag, getattr(args, flag))
        if problem is not None:
            raise ValueError(problem)
    try:
        _validate.check_seed("shardcheck verify: --seed", args.seed)
    except (TypeError, ValueError) as err:
        if not isinstance(args.seed, int):
            raise
        raise ValueError(
            f"shardcheck verify: --seed must be an int in [0, 2**31), got {args.seed}; pass e.g. --seed 0"
        ) from err
    from shardcheck.cli._task import check_lr_flag

    check_lr_flag("shardcheck verify", args)
    for flag in ("rtol", "atol"):  # before any step, --against's replay included
        value = getattr(args, flag)
        if value is not None and not 0 <= value < math.inf:
            raise ValueError(
                f"shardcheck verify: --{flag} must be a number >= 0 and finite, got {value}; omit it for the "
                "derived tolerance"
            )
    _check_reference_name(args.reference)
    own = args.reference not in REFERENCE_NAMES  # a step of the user's own: it checks the user's candidate
    if own and args.strategies is None and args.candidate is None:
        raise ValueError(
            f"shardcheck verify: --reference {args.reference} is a step of your own, compared with --candidate; "
            "pass --candidate FILE.py:ATTR (the built-in strategies run the task's own step: check them without "
            "--reference, or name them with --strategies)"
        )
    # the built-ins run the task's step, which need not write what the user's reference does (trial 39: a target
    # network's sync made every built-in FAIL as 'the forward pass's writes were dropped'): only when named
    chosen = ("none" if own else DEFAULT_STRATEGIES) if args.strategies is None else args.strategies
    strategies = _parse_strategies(chosen, args.candidate is not None)
    if args.strategies is None:  # the reference strategy against itself is no check
        strategies = [s for s in strategies if s != args.reference]
    elif args.reference in strategies:
        raise ValueError(
            f"shardcheck verify: --strategies {args.strategies} names --reference {args.reference} itself: a step "
            f"checked against itself proves nothing; drop {args.reference} from --strategies"
        )
    if args.reference != REFERENCE and args.task is None and args.size is None:
        raise ValueError(
            f"shardcheck verify: --reference {args.reference} needs --task (a built-in task or FILE.py:task); "
            "the seed form compares against the seed's single-device baseline"
        )
    # Like `shardcheck run`: without --devices, fake as many CPU devices as shards (2) before JAX starts; a
    # launched run (shardcheck launch) has its devices configured already.
    configure_devices(args.devices if args.devices is not None or distributed.is_multiprocess() else 2)
    import jax

    return strategies, args.devices or (jax.device_count() if distributed.is_multiprocess() else 2)


def _check_all(args, task, runs, num_shards, mesh) -> dict:
    """One :func:`~shardcheck.check_parity` report per ``(label, strategy or candidate)``."""
    from shardcheck import parity
    from shardcheck.tasks import BUILTIN_TASKS

    steps = args.steps if args.task is not None and args.task not in BUILTIN_TASKS else None
    options = dict(
        num_shards=num_shards, mesh=mesh, rtol=args.rtol, atol=args.atol, accept_weak=args.accept_weak
    ) | precision_overrides(args)
    if getattr(args, "matmul_precision", None) is not None:
        options["matmul_precision"] = args.matmul_precision
    if args.reference != REFERENCE:
        options.update(reference=load_reference(args.reference) or args.reference)
    reports = {}
    with parity.shared_reference():  # every check runs against the same reference steps: they run once
        for label, cand in runs:
            try:
                reports[label] = _check_one(args, task, label, cand, steps, options)
            except Exception as err:  # one strategy's failure never hides the others' rows
                row = _error_row(args, label, err)
                if row is None:
                    raise
                reports[label] = row
    return reports


# a built-in strategy's refusal is said whole on stderr and in --json: its fix comes at its end (issue #36, trial 22
# read the row-coupling refusal cut off at 400 characters, before "Check it with a GSPMD step")
FULL_REASON = 4000


def _error_row(args, label: str, err: Exception) -> ErrorRow | None:
    """The row of a check that raised; ``None`` for what is no row's own: the run's bad input (a ``check_parity:``
    refusal, which every check would give: :func:`main` says it once, exit 2), or an error of the user's candidate
    raised outside its step (as before)."""
    from shardcheck import parity

    wrapped = isinstance(err, parity.CandidateError)
    cause = err.__cause__ if wrapped and err.__cause__ is not None else err
    step = err.step if wrapped else None
    if label == "candidate":
        from shardcheck.parity.tolerance.matmul import EmulationError

        if isinstance(err, EmulationError):  # the harness's matmul emulation failed, not the candidate
            message = f"shardcheck verify: checking the candidate: {err}"
            return ErrorRow(
                label, message, type(err.__cause__).__name__, reason_line(err.__cause__), None, False
            )
        from shardcheck.parity.harness.candidates import StepReturnError

        if isinstance(err, StepReturnError):  # the step ran; what it returned cannot be read (trial 51)
            message = library_to_flags(str(err), "verify", args=args)
            reason = reason_line(TypeError(str(err).split(": ", 1)[-1]))  # without check_parity's name
            return ErrorRow(label, message, "TypeError", reason, err.step, False)
        if not wrapped:
            return None
        # the likely cause shardcheck named (an annotation naming an axis the mesh lacks), not JAX's own words
        # ("Resource axis: fsdp of P('fsdp', None, None) is not found in mesh", trial 56)
        reason = reason_line(ValueError(err.hint.split("; ")[0])) if err.hint else reason_line(cause)
        return ErrorRow(label, _candidate_message(args, err), type(cause).__name__, reason, step, False)
    from shardcheck.parity.harness.setup import StrategyRefusal

    # this strategy's placement alone: its own row, the others stand (trial 56)
    if isinstance(err, StrategyRefusal) and err.strategy == label:
        whole = library_to_flags(str(err), "verify", args=args).removeprefix("shardcheck verify: ")
        message = (
            f"shardcheck verify: the built-in strategy {label!r} cannot place this task on this mesh: {whole}; "
            f"the other rows stand (or leave {label} out with --strategies)"
        )
        cell = reason_line(ValueError(whole.split("; ")[0]))  # the cause; the fix is in the message
        return ErrorRow(label, message, "ValueError", cell, None, True)
    if not wrapped and isinstance(err, (ValueError, TypeError)) and str(err).startswith("check_parity"):
        return None
    whole = reason_line(cause, limit=FULL_REASON)  # the message says it whole: its fix comes last
    where = "" if step is None else f" at step {step}"
    short = _limitation(label, cause)
    if short is not None:  # a documented limitation of the strategy on this task
        message = (
            f"shardcheck verify: the built-in strategy {label!r} cannot check this task{where}: {whole}; the "
            f"other rows stand (leave {label} out with --strategies)"
        )
        reason = _refusal_reason(label, whole)
        return ErrorRow(label, message, type(cause).__name__, reason, step, True, True, short)
    reason = f"{type(cause).__name__}: {whole.rstrip('.')}"  # one period before "A limitation"
    message = (
        f"shardcheck verify: the built-in strategy {label!r} could not run this task{where}: {reason}. A "
        f"limitation or a bug of shardcheck's {label} step, not a fault of your model or step; the other rows "
        f"stand (leave {label} out with --strategies)"
    )
    return ErrorRow(label, message, type(cause).__name__, reason_line(cause), step, True)


def _limitation(label: str, cause: BaseException) -> str | None:
    """The short cell of a built-in strategy's documented refusal of a task, else ``None``: a loss that couples
    the rows of a batch (``RowCouplingError``), a forward pass that writes the model's non-parameter state or
    draws random numbers (the strategy's ``cannot run this model``: trial 31's GRU carry had exited 2 as four
    ERROR rows beside a passing candidate)."""
    from shardcheck.parity.harness.row_coupling import RowCouplingError

    if isinstance(cause, RowCouplingError):
        return "the loss couples rows"
    text = str(cause)
    if not (isinstance(cause, ValueError) and text.startswith(f"{label}: cannot run this model:")):
        return None
    if "writes non-parameter state" in text:
        return "the forward pass writes model state"
    if "draws random numbers" in text:
        return "the forward pass draws random numbers"
    return "it cannot run this model"


def _refusal_reason(label: str, whole: str) -> str:
    """A built-in strategy's refusal without the strategy's own name at its start and end (``"dp: cannot compute
    ..."``, ``"... (check_parity, strategy 'dp')"``): the same words for every strategy that refused, said once."""
    import re

    text = whole.removeprefix(f"{label}: ")
    text = re.sub(rf" \(\w+, strategy {re.escape(repr(label))}\)$", "", text)
    # "and dp runs the forward pass per device", "which dp cannot see": one reason for dp and fsdp (trial 35)
    return re.sub(rf"(?<![\w'=-]){re.escape(label)}(?![\w'=-])", "it", text)  # not in "--mesh fsdp=4"


SHARED_TAILS = (". ", ", so ", ": ")
"""Where the reasons of several refusals may part from a tail they share, said once after them: a sentence (the
fix they all give), a consequence (``", so its batch statistics ... would be computed over part of the batch
...``, the same after each strategy's own way of running the forward pass: trial 51 read it three times in one
line of 1,900 characters) or what follows a colon (``": that gives the full batch's numbers only where ..."``,
trial 53)."""

SHARED_HEAD = ", and "
"""Where the reasons of several refusals may part from a head they share, said once before them (``"cannot run
this model: model ViT draws random numbers in its forward pass (...)"``, then each strategy's way of running it:
trial 53 read the head four times in one line of 1,800 characters)."""


def _shared_advice(reasons: list[str]) -> tuple[str, str]:
    """``(separator, tail)``: the longest tail every one of several ``reasons`` ends with, starting after a
    :data:`SHARED_TAILS` separator, and that separator; ``("", "")`` where they share none or there is one
    reason."""
    if len(reasons) < 2:
        return "", ""
    first = reasons[0]
    for i in range(len(first)):  # the earliest separator gives the longest shared tail
        for sep in SHARED_TAILS:
            if first.startswith(sep, i) and all(r.endswith(first[i:]) for r in reasons[1:]):
                return sep, first[i + len(sep) :]
    return "", ""


def _shared_head(reasons: list[str]) -> str:
    """The longest head every one of several ``reasons`` starts with, ending at a :data:`SHARED_HEAD` that each
    of them has there; ``""`` where they share none or there is one reason."""
    if len(reasons) < 2:
        return ""
    first, head = reasons[0], ""
    i = first.find(SHARED_HEAD)
    while i > 0:
        if all(r.startswith(first[: i + len(SHARED_HEAD)]) for r in reasons[1:]):
            head = first[:i]
        i = first.find(SHARED_HEAD, i + 1)
    return head


def _own_parts(reasons: list[str]) -> tuple[Callable[[str], str], str, str]:
    """``(own, head, advice)`` of several refusal ``reasons``: the head they share (:func:`_shared_head`), the
    tail they share (:func:`_shared_advice`), and ``own(reason)``, a reason without either."""
    sep, advice = _shared_advice(reasons)
    head = _shared_head(reasons)

    def own(reason: str) -> str:
        said = reason.removesuffix(f"{sep}{advice}") if advice else reason
        return said.removeprefix(f"{head}{SHARED_HEAD}") if head else said

    return own, head, advice


def _refusals_said(groups: dict[str, list[str]]) -> tuple[str, str]:
    """``(text, end)`` of the refusals ``groups`` (``{reason: the strategies that gave it}``): each reason said
    once with the strategies it names; a head several reasons share (:func:`_shared_head`) said once before
    them, each group's own part on a line of its own, and a tail they share (:func:`_shared_advice`) once after
    them; ``end``: what joins the next sentence (a new line after the lines, else a space)."""
    from shardcheck.parity.diagnosis.grouping import words_and

    own, head, advice = _own_parts(list(groups))

    def which(names: list[str]) -> str:
        return f"strategy {names[0]!r}" if len(names) == 1 else f"strategies {words_and(map(repr, names))}"

    end = "\n" if head else " "
    if head:
        every = [n for names in groups.values() for n in names]
        lines = ";".join(f"\n  - {words_and(map(repr, names))}: {own(r)}" for r, names in groups.items())
        text = f"the built-in {which(every)} refused this task: {head}{SHARED_HEAD.rstrip()}{lines}"
    else:
        text = "; ".join(
            f"the built-in {which(names)} refused this task: {own(r)}" for r, names in groups.items()
        )
    if advice:  # the fix, or the consequence, every refusal gives, said once after them
        text += f".{end}For all of them: {advice[:1].lower()}{advice[1:]}"
    return text, end


def _refusals_message(reports) -> str:
    """One message for the built-in strategies of ``reports`` (label -> report or :class:`ErrorRow`) that refused
    the task by a documented limitation (:attr:`ErrorRow.refused`), grouped by their reason (:func:`_refusals_said`),
    and the ``--strategies`` that runs the other built-ins alone."""
    groups: dict[str, list[str]] = {}
    for r in reports.values():
        if isinstance(r, ErrorRow) and r.refused:
            groups.setdefault(r.reason, []).append(r.strategy)
    text, end = _refusals_said(groups)
    one = sum(map(len, groups.values())) == 1
    others = [
        k for k, r in reports.items() if k != "candidate" and not (isinstance(r, ErrorRow) and r.refused)
    ]
    rest = ",".join(others) or "none"
    which, it = ("that strategy", "it") if one else ("those strategies", "them")
    head = f"shardcheck verify: {text}.{end}A documented limitation of {which} on this task"
    if all(isinstance(r, ErrorRow) and r.refused for r in reports.values()):  # nothing was checked: exit 2
        return (
            f"{head}, and no other row checked it (exit status 2): pass --strategies gspmd or a --candidate"
        )
    return (
        f"{head}, not a fault of your step nor a verdict: the other rows stand and the exit status leaves {it} "
        f"out (--strategies {rest} runs without {it})"
    )


def _candidate_message(args, err) -> str:
    """What a :class:`~shardcheck.parity.CandidateError` of the user's candidate says on the command line."""
    cause = err.__cause__
    if cause is None:  # the step ran; what it returned cannot be compared (the message says what and why)
        return library_to_flags(str(err), "verify", args=args)
    if err.hint:  # the likely cause first: a JAX error's own text can run to many lines (trial 13)
        return (
            f"shardcheck verify: the candidate step raised {type(cause).__name__} at step {err.step} ({err.hint}): "
            f"{_short(str(cause))} (shardcheck.check_parity in Python shows the traceback)"
        )
    return (
        f"shardcheck verify: the candidate step raised {type(cause).__name__}: {_short(str(cause))} at step "
        f"{err.step}; fix the step (shardcheck.check_parity in Python shows the traceback)"
    )


def _check_one(args, task, label, cand, steps, options):
    from shardcheck import check_parity

    if args.task is None and label == "candidate":
        # the (model, optimizer, x, y) form of a candidate, on the regression task's own batches
        model = task.new_model()
        optimizer = task.new_optimizer(model)
        return check_parity(cand, model, optimizer, list(task.batches), name=label, **options)
    return check_parity(cand, task, steps=steps, name=label, **options)


def _diverged_message(args, task, reports) -> str | None:
    done = (r for r in reports.values() if not isinstance(r, ErrorRow))
    diverged = next((r for r in done if r.reference_diverged_at is not None), None)
    if diverged is None:
        return None
    from shardcheck.cli._common import lr_setting

    setting, default = lr_setting(args, args.optimizer or ("sgd" if args.task is None else None), task.name)
    return (
        f"shardcheck verify: the reference run diverged (non-finite loss or parameters at step "
        f"{diverged.reference_diverged_at}) {setting}; no verdict about the candidates; lower --lr{default} "
        f"where the parameters grew, or fix batch {diverged.reference_diverged_at} where it makes the loss "
        "non-finite from finite parameters (an index out of range, a log of 0; JAX_DEBUG_NANS=True names the "
        "operation)"
    )


def _short(message: str, max_lines: int = 12) -> str:
    """An exception's message with repeated lines shown once (JAX's shard_map errors repeat a line per output)
    and at most ``max_lines`` lines."""
    lines, seen = [], set()
    for line in message.splitlines():
        if line.strip() and line in seen:
            continue
        seen.add(line)
        lines.append(line)
    if len(lines) > max_lines:
        lines = [*lines[:max_lines], f"... ({len(lines) - max_lines} more lines)"]
    return "\n".join(lines)


def _check_builtin_batch(args, task, num_shards) -> None:
    """A built-in task's batch must split over the devices: the fix is --batch-size (a task file's batches are the
    user's own: check_parity says how to pad them). The one rule and wording of
    :func:`shardcheck._validate.check_divisible`, S named as the command line gave it (:func:`shard_words`)."""
    from shardcheck import _validate
    from shardcheck.task import batch_size
    from shardcheck.tasks import BUILTIN_TASKS

    if (args.task is not None and args.task not in BUILTIN_TASKS) or not num_shards:
        return
    b = batch_size(task.batches[0])
    by, counts = shard_words(args, num_shards)
    fit = -(-b // num_shards) * num_shards
    fix = f"pass --batch-size with a multiple of {num_shards}, e.g. --batch-size {fit}"
    _validate.check_divisible("shardcheck verify", b, num_shards, by=by, counts=counts, fix=fix)


def main(args) -> int:
    from shardcheck import distributed

    against = None
    if args.against is not None:  # a recorded run, replayed and compared with it instead (cli/record.py)
        from shardcheck.cli import record

        try:
            against = record.recorded_defaults(args)
        except ValueError as err:
            return record._fail(err)
    elif args.pin_placement:
        return _fail(
            "shardcheck verify: --pin-placement pins a replay's placement to a recording's; pass --against "
            "RUN.npz, or drop --pin-placement"
        )
    try:
        strategies, devices = _check_args(args)
    except (TypeError, ValueError) as err:
        return _fail(str(err))
    from shardcheck.mesh import data_shards

    # S: the batch is split over the mesh's batch axes ('data', 'fsdp'), replicated over its model axes
    num_shards = devices if args.mesh is None else data_shards(args.mesh)
    from shardcheck import parity
    from shardcheck.steps import STRATEGIES

    try:
        task = task_from_args(args, default_optimizer="sgd", batch_size=args.batch_size, steps=args.steps)
        _check_builtin_batch(args, task, num_shards)
        candidate = (
            load_candidate(args.candidate, task_form=args.task is not None) if args.candidate else None
        )
        named = [args.reference] if args.reference in STRATEGIES else []  # not a step of the user's own
        uses_mesh = [STRATEGIES[s].uses_mesh for s in (*strategies, *named)]
        mesh = needed_mesh("shardcheck verify", args, devices, any(uses_mesh) or candidate is not None)
        runs = [(name, name) for name in strategies] + ([("candidate", candidate)] if candidate else [])
        if against is not None:
            from shardcheck.cli.record import verify_against

            return verify_against(args, task, runs, num_shards, mesh, against)
        reports = _check_all(args, task, runs, num_shards, mesh)
    except parity.CandidateError as err:
        return _fail(_candidate_message(args, err))
    except (ValueError, TypeError) as err:
        return _fail(library_to_flags(str(err), "verify", args=args))
    message = _diverged_message(args, task, reports)
    if message is not None:
        return _fail(message)
    status = exit_status(
        reports
    )  # the worst row's: ERROR 2, FAIL or CANNOT VERIFY 1, PASS 0; REFUSED left out
    if distributed.is_main_process():  # every process computed the same reports; process 0 alone prints them
        _print(args, task, reports, num_shards, status == 0)
    return status


def _model_dtype_text(report) -> str:
    """``", compute dtype bfloat16 (the model's layers: the tolerances' policy)"``: a compute dtype coarser than
    float32 read from the model, which the tolerances follow (trial 21: a bfloat16 model's check never said
    bfloat16), else ``""``."""
    if not report.compute_dtype or report.compute_dtype in ("float32", "float64"):
        return ""
    return f", compute dtype {report.compute_dtype} (the model's layers: the tolerances' policy)"


def _dtype_policy_text(args) -> str:
    """``", compute dtype bfloat16 (--compute-dtype: ...)"``: where ``--compute-dtype`` / ``--param-dtype`` set
    the tolerance policy of a task file's check, said beside the matmul precision (trial 16: the tolerances
    widened from a float32 model's without a word), else ``""``."""
    from shardcheck.cli._task import precision_overrides

    given = precision_overrides(args)
    if not given:
        return ""
    words = " and ".join(f"{k.removesuffix('_dtype')} dtype {v}" for k, v in given.items())
    flags = " / ".join("--" + k.replace("_", "-") for k in given)
    return (
        f", {words} ({flags}: the tolerances' policy; the task file's model computes in the dtypes it is "
        "written with, so a fault below that dtype's rounding passes)"
    )


def _print(args, task, reports, num_shards: int, ok: bool) -> None:
    import jax

    from shardcheck.optimizers import DEFAULT_LR
    from shardcheck.task import batch_size

    console = console_for(args)
    done = {name: r for name, r in reports.items() if not isinstance(r, ErrorRow)}
    # every check an ERROR row: the steps asked for, not "0 steps" (trial 18)
    steps = len(next(iter(done.values())).steps) if done else (args.steps or len(task.batches))
    b = batch_size(task.batches[0])
    setup = f"task {task.name}, {steps} steps of B={_sizes_text(task.batches[:steps])}, S={num_shards}"
    if args.mesh is not None:
        setup += (
            " on mesh " + " x ".join(f"{k}={v}" for k, v in args.mesh.items()) + _placement_text(args, task)
        )
    if args.reference != REFERENCE:  # a step of the user's own is named by its spec
        own = args.reference not in REFERENCE_NAMES
        setup += f", against {args.reference if own else next(iter(done.values())).reference}" if done else ""
    if done:  # the matmul precision the tolerances assumed (one for every check of a run)
        first = next(iter(done.values()))
        setup += f", matmul precision {first.matmul_precision} ({first.matmul_precision_source})"
    setup += _dtype_policy_text(args) or (_model_dtype_text(next(iter(done.values()))) if done else "")
    said: dict[str, str] = {}  # a long note the run's tables share, said once
    for report in reports.values():
        if isinstance(report, ErrorRow) and not report.refused:  # on stderr, as a candidate that raised was
            _fail(report.message)
        elif not isinstance(report, ErrorRow):
            console.print(render_report(report, setup, said=said))
    console.print(render_summary(reports, setup))
    console.print(device_choice(args).line(), highlight=False)
    refused = [r for r in reports.values() if isinstance(r, ErrorRow) and r.refused]
    if refused:  # one message for every refusal, below the summary (trial 27: 4 times on stderr, and 4 cells)
        _note(_refusals_message(reports))
    single = _one_device(args, num_shards)
    if single:
        _note(SINGLE_DEVICE_NOTE)
    optimizer = args.optimizer or ("sgd" if args.task is None else None)
    lr = None if optimizer is None else (DEFAULT_LR[optimizer] if args.lr is None else args.lr)
    document = {
        "command": "verify",
        "ok": ok,
        "task": task.name,
        "dataset": task.name,
        "model": args.model if args.task is None else None,
        "optimizer": optimizer,
        "lr": lr,
        "mesh": args.mesh,
        "steps": steps,
        "batch_size": b,
        "num_shards": num_shards,
        "seed": args.seed,
        "process_count": jax.process_count(),
        "devices": device_choice(args).to_dict(),
        "strategies": {name: r.to_dict() for name, r in reports.items()},
        "reduction_exercised": not single,
    }
    # what every strategy was compared with (the report's own name for it: "gspmd on data=2,model=4")
    document.update(reference=next(iter(done.values())).reference if done else args.reference)
    write_json(document, args.json)


SINGLE_DEVICE_NOTE = (
    "S=1, one device: every strategy ran unsplit, so no all-reduce, all-gather or reduce-scatter was exercised and "
    "a shard-count error (a sum for a mean: x S, here x1) cannot show; to check the sharding, pass --devices 2 or "
    "more (fake CPU devices where the host has fewer accelerators)"
)
"""What ``verify`` notes of a check on one device (trial 49: a PASS at S=1 said nothing of it)."""


def _one_device(args, num_shards: int) -> bool:
    """Whether the check ran on one device: one shard, and no ``--mesh`` larger than 1 (``--mesh data=1,model=8``
    is tensor parallel over 8: its reductions over ``model`` are exercised)."""
    mesh = getattr(args, "mesh", None) or {}
    return num_shards == 1 and math.prod(mesh.values()) == 1


def _sizes_text(batches, listed: int = 6) -> str:
    """The batch sizes (rows) of the steps checked, as they are: ``"8"`` where every batch has 8 rows, ``"8, 6 (by
    step)"`` where the second has 6 (trial 27 read "2 steps of B=8"), ``"8, 8, 6, 8, 8, 8, ... (by step, 6 to 8)"``
    past ``listed`` steps."""
    from shardcheck.task import batch_size

    sizes = [batch_size(x) for x in batches]
    if len(set(sizes)) <= 1:
        return str(sizes[0]) if sizes else "?"
    if len(sizes) <= listed:
        return f"{', '.join(map(str, sizes))} (by step)"
    return f"{', '.join(map(str, sizes[:listed]))}, ... (by step, {min(sizes)} to {max(sizes)})"


def _placement_text(args, task) -> str:
    """``" (batch over data; replicated over model)"``: where ``args.mesh`` has axes beside its batch axes, which
    split the batch and what the others hold, as the built-in steps place them; where a ``--candidate`` is
    checked, said as the built-in steps' placement (trial 45: a context-parallel step placing its batch
    ``P('data', 'seq')`` read "replicated over seq"); ``""`` for a mesh of batch axes only."""
    from shardcheck.mesh import batch_axis_names

    batch = batch_axis_names(args.mesh)
    model = [a for a in args.mesh if a not in batch]
    if not model:
        return ""
    placed = f"batch over {', '.join(batch)}; {_model_axes_text(task, model)}"
    if getattr(args, "candidate", None):
        placed = f"the built-in steps' placement: {placed}; a step of its own may split it otherwise"
    return f" ({placed})"


def _model_axes_text(task, axes: list[str]) -> str:
    """``"model annotated over model"`` for the axes some leaf of the task's model is annotated with (what the
    annotations say, not where a user's step placed it: trial 27's step replicated every leaf under this
    header), ``"replicated over model"`` for the others (the batch is not split over them, and no leaf names
    them)."""
    from shardcheck.memory.state import abstract_training_state
    from shardcheck.steps.sharded import annotated_axes

    try:
        named = annotated_axes(abstract_training_state("shardcheck verify", task)[0])
    except Exception:  # the header only: where the model cannot be traced abstractly, say what the mesh says
        named = frozenset(axes)
    split = [a for a in axes if a in named]
    replicated = [a for a in axes if a not in named]
    parts = ([f"model annotated over {', '.join(split)}"] if split else []) + (
        [f"replicated over {', '.join(replicated)}"] if replicated else []
    )
    return "; ".join(parts)


def _verdict(ok: bool | str) -> str:
    """A leaf's ``ok`` or a report's verdict, coloured: PASS green, FAIL red, every qualified verdict yellow
    (``PASS (per step)``, ``PASS (weak check accepted)``, ``CANNOT VERIFY``, ``NO VERDICT``), ERROR red."""
    if ok == "ERROR":
        return "[bold red]ERROR[/]"
    if isinstance(ok, str) and ok not in ("PASS", "FAIL"):
        return f"[bold yellow]{ok}[/]"
    if isinstance(ok, str):
        ok = ok == "PASS"
    return "[bold green]PASS[/]" if ok else "[bold red]FAIL[/]"


# A caption line this long that an earlier strategy's table of the same run said word for word is said as "the same
# as for dp, above" (tiny-lm's 6-line rounding_level note and 3-line footnote had been said in full once a strategy).
ONCE_CHARS = 100


def _once(line: str, strategy: str, said: dict[str, str] | None) -> str:
    """``line`` of ``strategy``'s caption, or, where an earlier table said it (``said``: ``{line: strategy}``, kept
    across one run's tables; ``None``: every line as it is), its tag (``[rounding_level]``, ``rel err ...:``) and
    "the same as for X, above"."""
    if said is None or len(line) < ONCE_CHARS:
        return line
    if line not in said:
        said[line] = strategy
        return line
    end = line.find("]") + 1 if line.startswith(("[", "\\[")) else line.find(":") + 1
    return f"{line[:end]} the same as for {said[line]}, above"


def render_report(report, setup: str, against: str | None = None, said: dict[str, str] | None = None):
    """One strategy's table: the worst leaf of each compared kind, with its error, tolerance and verdict; the
    diagnosis below. A replay against a recording (``against``: its path; ``report.replay``, the same
    renderer) adds whether it is bitwise identical, the digests' evidence and what a recording cannot tell.
    ``said``: the long caption lines earlier tables of the run said, each said once (:func:`_once`)."""
    from rich.markup import escape
    from rich.table import Table

    from shardcheck.parity.report import RERUN_MARK, ROUNDING_MARK, ROUNDING_NOTE, rerun_note

    replay = report.replay
    title = f"shardcheck verify {report.strategy}" + (f" against {against}" if against else "")
    bitwise = " (bitwise identical)" if replay is not None and replay.bitwise else ""
    caption = [
        setup,
        *(escape(line) for line in report.diagnosis_lines),
    ]  # the cause first, one finding a line
    if report.weak_accepted is not None:
        caption.append(f"weak check accepted: {report.weak_accepted}")
    if report.scale_evidence and all(r.ok for r in report.steps):  # as the report's own text says it
        caption.append(f"evidence: {report.scale_evidence}")
    if replay is not None:
        caption += [replay.evidence, *replay.notes]
    rerun = getattr(report, "rerun_after_failure", ())  # steps re-run from the reference's state
    if rerun:  # trial 46: a re-run step's parameter read as the trajectory's, beside "parameters: matches"
        caption.append(f"rows: {rerun_note(rerun)}")
    if any(e.reference_within_tolerance for e in report.worst_by_kind().values()):
        caption.append(ROUNDING_NOTE)
    table = Table(
        title=f"{title}: {_verdict(report.verdict)}{bitwise}",
        caption="\n".join([caption[0], *(_once(line, report.strategy, said) for line in caption[1:])]),
        caption_justify="left",
    )
    table.add_column("compared")
    table.add_column("worst leaf")
    table.add_column("step", justify="right")
    table.add_column("max abs err", justify="right")
    table.add_column("max rel err", justify="right")
    table.add_column("allowed abs err", justify="right")
    table.add_column("verdict")
    rows = report.worst_by_kind()
    for kind, e in rows.items():
        cell = step_cell(e.step) + (RERUN_MARK if e.step in rerun else "")
        abs_cell, rel_cell, tol_cell = error_cells(e)
        rel_cell += ROUNDING_MARK if e.reference_within_tolerance else ""
        table.add_row(kind, e.path, cell, abs_cell, rel_cell, tol_cell, _verdict(e.ok))
    replicas = report.replica_failure
    if replicas is not None:  # no leaf's error shows it: each device's copy may be within tolerance
        table.add_row("replicas", _replica_cell(replicas), str(replicas.step), "-", "-", "-", _verdict(False))
    return table


def error_cells(e) -> tuple[str, str, str]:
    """A leaf's max abs err, max rel err and allowed abs err cells. A leaf in one run only (``e.missing``: a
    multi_transform's other labels) or shaped otherwise (``e.cand_shape``) has no difference and no tolerance:
    ``("in one run only", "-", "-")`` / ``("shaped otherwise", "-", "-")``, not the ``inf`` and ``0`` that stand
    for them in the records (trial 27 read "max abs err inf, allowed 0")."""
    if getattr(e, "missing", False):
        return "in one run only", "-", "-"
    if getattr(e, "dtypes", None) is not None:  # a counter converted: "float32, not int32"
        return f"{e.dtypes[1]}, not {e.dtypes[0]}", "-", "-"
    if getattr(e, "cand_shape", None) is not None and not math.isfinite(e.max_abs_err):
        return "shaped otherwise", "-", "-"
    return f"{e.max_abs_err:.3g}", f"{e.max_rel_err:.3g}", f"{e.tolerance:.3g}"


def step_cell(step: int) -> str:
    """A table's step: ``"0"``, ``"1"``, ...; a replay's initial state, before step 0 (``step`` -1 in its records
    and in the JSON), ``"initial"``."""
    return "initial" if step < 0 else str(step)


def _replica_cell(replicas) -> str:
    """The leaf cell of a replica failure (:class:`~shardcheck.parity.report.ReplicaFailure`):
    ``"opt_state 1.0.mu.bias (40 leaves along 'model' differ across devices)"``, and where the gradients show
    the unreduced leaves, ``"...; 6 of them are the values and optimizer state of the 2 parameters whose gradients
    differ; the other 73 have gradients within tolerance: ...)"`` (``topology.downstream_note``)."""
    tail = f"; {replicas.downstream}" if replicas.downstream else ""
    return f"{replicas.leaf} ({replicas.text()} differ across devices{tail})"


SUMMARY_CAPTION = (
    "leaf: a FAIL row's first failing leaf at its first failing step (each kind's largest error over every step "
    "is in the strategy's table above), a PASS row's worst leaf"
)
"""The summary's caption line where a row fails: what its leaf column and the errors beside it show."""


def render_summary(reports, setup: str):
    """One row per strategy: verdict, a leaf, its error and tolerance, the diagnosis codes; a check that raised
    (:class:`ErrorRow`): ERROR and the exception's type and first line.

    The leaf of a FAIL row is its first failing leaf at its first failing step (where the failure is localized;
    the JSON's ``first_failing_*``), not the largest error over every step (the strategy's table above and the
    JSON's ``max_abs_err`` hold that): trial 44 read "grad head.kernel (step 0) | 0.000233" under a "max abs err"
    header while the table above showed 0.000293 at step 1. A PASS row's is its worst leaf. The headers say so,
    and where a row fails, a caption line too."""
    from rich.table import Table

    failing = any(r.verdict == "FAIL" for r in reports.values())  # an ErrorRow's: ERROR or REFUSED
    from shardcheck.parity.report import ROUNDING_NOTE

    rounding = [ROUNDING_NOTE] if any(_worst_at_rounding(r) for r in reports.values()) else []
    caption = "\n".join([setup, SUMMARY_CAPTION, *rounding] if failing else [setup, *rounding])
    table = Table(title="shardcheck verify: summary", caption=caption)
    table.add_column("strategy")
    table.add_column("verdict")
    table.add_column("first failing / worst leaf")
    table.add_column("its abs err", justify="right")
    table.add_column("its rel err", justify="right")
    table.add_column("its allowed abs err", justify="right")
    table.add_column("diagnosis")
    for name, r in reports.items():
        if isinstance(r, ErrorRow) and r.refused:  # the whole refusal is said once, below the tables
            table.add_row(name, _verdict(r.verdict), "-", "-", "-", "-", f"refused: {r.short} (below)")
            continue
        if isinstance(r, ErrorRow):
            table.add_row(name, _verdict("ERROR"), "-", "-", "-", "-", f"{r.error_type}: {r.reason}")
            continue
        table.add_row(name, _verdict(r.verdict), *_worst_cells(r), ", ".join(r.codes))
    return table


def _worst_cells(report) -> tuple[str, str, str, str]:
    """The summary's worst leaf, its errors and tolerance; where the replicas' disagreement is the only failure
    (every leaf within tolerance), the first mismatched replica, with no error of its own ("-")."""
    if report.only_replicas_fail:
        return f"replicas: {_replica_cell(report.replica_failure)}", "-", "-", "-"
    worst = getattr(report, "first_worst", report.worst)  # a failure's first step: where it is localized
    name = "-" if worst is None else worst.name
    if worst is not None and not worst.ok:  # the first failing step's: said, as the table's rows say theirs
        name = f"{name} (step {worst.step})"
    if worst is not None and error_cells(worst)[2] == "-":  # no difference, no tolerance: said as what it is
        return (name, *error_cells(worst))
    from shardcheck.parity.report import ROUNDING_MARK

    return (
        name,
        f"{0.0 if worst is None else worst.max_abs_err:.3g}",
        f"{0.0 if worst is None else worst.max_rel_err:.3g}"
        + (ROUNDING_MARK if worst is not None and worst.reference_within_tolerance else ""),
        "-" if worst is None else f"{worst.tolerance:.3g}",
    )


def _worst_at_rounding(report) -> bool:
    """Whether the summary row of ``report`` (:func:`_worst_cells`) shows a leaf whose reference is within its
    tolerance (``LeafError.reference_within_tolerance``)."""
    if isinstance(report, ErrorRow) or report.only_replicas_fail:
        return False
    worst = getattr(report, "first_worst", report.worst)
    return worst is not None and worst.reference_within_tolerance
