"""``load_task``: a :class:`~shardcheck.task.Task` from a built-in name, a ``FILE.py:ATTR`` or a ``MODULE:ATTR``.

Also the option checks the built-in tasks share (optimizer, learning rate, batch size, steps, seed), so every
built-in reports a bad option the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import types
from pathlib import Path

import optax

from shardcheck import _validate
from shardcheck.optimizers import DEFAULT_LR, OPTIMIZERS, make_tx
from shardcheck.task import Task

DEFAULT_OPTIMIZER = "adam"
DEFAULT_STEPS = 5
SPEC_FORMS = "a built-in task name, FILE.py:ATTR or MODULE:ATTR"


# ------------------------------------------------------------------------------------------ shared options


def resolve_optimizer(fn: str, optimizer, lr) -> optax.GradientTransformation:
    """The optax transformation of a built-in task's ``optimizer`` and ``lr`` options.

    Args:
        fn: the calling task's name, for messages.
        optimizer: ``None`` (``"adam"``), a name from :data:`shardcheck.optimizers.OPTIMIZERS` (built by
            :func:`shardcheck.optimizers.make_tx`) or an ``optax.GradientTransformation`` (used as given).
        lr: the learning rate of a named optimizer; ``None`` for :data:`shardcheck.optimizers.DEFAULT_LR`.

    Raises:
        TypeError: ``optimizer`` of another type; ``lr`` not a number.
        ValueError: an unknown optimizer name; ``lr`` not finite and positive; ``lr`` given together with an
            optax transformation (its rate is set inside it).
    """
    if optimizer is None:
        optimizer = DEFAULT_OPTIMIZER
    if isinstance(optimizer, optax.GradientTransformation):
        if lr is not None:
            raise ValueError(
                f"{fn}: lr={lr!r} applies to a named optimizer ({', '.join(OPTIMIZERS)}); an optax "
                "transformation carries its own rate, e.g. optimizer=optax.adam(1e-3)"
            )
        return optimizer
    if isinstance(optimizer, optax.MultiSteps):
        raise TypeError(
            f"{fn}: optimizer must be an optax.GradientTransformation or one of {', '.join(OPTIMIZERS)}, got "
            "MultiSteps (a wrapper object, not a transformation itself); pass "
            "optimizer=optax.MultiSteps(tx, every_k_schedule=k).gradient_transformation()"
        )
    if not isinstance(optimizer, str):
        raise TypeError(
            f"{fn}: optimizer must be an optax.GradientTransformation or one of {', '.join(OPTIMIZERS)}, got "
            f"{type(optimizer).__name__}; pass e.g. optimizer=optax.adam(1e-3) or optimizer='sgd'"
        )
    if optimizer not in OPTIMIZERS:
        raise ValueError(
            f"{fn}: optimizer={optimizer!r} is unknown; use one of {', '.join(OPTIMIZERS)} or an optax "
            "transformation"
        )
    lr = DEFAULT_LR[optimizer] if lr is None else _validate.check_lr(fn, lr)
    return make_tx(optimizer, lr)


def check_sizes(
    fn: str, *, batch_size, steps, seed, num_rows: int, rows: str = "rows"
) -> tuple[int, int, int]:
    """``batch_size`` in ``[1, num_rows]``, ``steps >= 1``, ``seed`` in ``[0, 2**31)``; returned as ints.

    Raises:
        TypeError: a value that is not an int.
        ValueError: a value out of range (the batch size message gives the data's row count).
    """
    batch_size = _validate.check_int(fn, "batch_size", batch_size, example="batch_size=16")
    if batch_size > num_rows:
        raise ValueError(
            f"{fn}: batch_size={batch_size} is larger than the data's {num_rows} {rows}; pass batch_size <= "
            f"{num_rows}, a multiple of the shard count (e.g. {num_rows // 8 * 8 or num_rows})"
        )
    steps = _validate.check_int(fn, "steps", steps, example="steps=5")
    seed = _validate.check_seed(fn, seed)
    return batch_size, steps, seed


# ------------------------------------------------------------------------------------------------ loading


def _builtins() -> dict:
    from shardcheck.tasks import BUILTIN_TASKS

    return BUILTIN_TASKS


def _builtin_names() -> str:
    return ", ".join(_builtins())


def _load_builtin(spec: str, options: dict) -> Task:
    factory = _builtins()[spec]
    params = inspect.signature(factory).parameters
    unknown = [k for k in options if k not in params]
    if unknown:
        raise ValueError(
            f"load_task: option(s) {', '.join(map(repr, unknown))} do not apply to the built-in task {spec!r}; "
            f"its options are {', '.join(params)}"
        )
    try:
        return factory(**options)
    except (TypeError, ValueError) as err:
        kind = TypeError if isinstance(err, TypeError) else ValueError
        raise kind(f"load_task: built-in task {spec!r}: {err}") from err


def _import_file(spec: str, path_text: str, fn: str = "load_task", kind: str = "task"):
    path = Path(path_text)
    if not path.is_file():
        where = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise ValueError(  # the text of shardcheck._io.spec_file_problem, which the command line checks first
            f"{fn}: {kind} file {path_text!r} (spec {spec!r}) {where}; pass FILE.py:ATTR with the path of an "
            "existing Python file"
        )
    path = path.resolve()
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    name = f"_shardcheck_task_{path.stem}_{digest}"
    content = hashlib.sha1(path.read_bytes()).hexdigest()
    loaded = None if _LOADED is None else _LOADED.get(name)
    if loaded is not None and loaded[0] == content and sys.modules.get(name) is loaded[1]:
        return loaded[1]  # `--task F.py:task --candidate F.py:step`: one module, its globals shared
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(
            f"{fn}: cannot import {path_text!r} (spec {spec!r}) as Python; it must be a .py file"
        )
    module = importlib.util.module_from_spec(module_spec)
    folder = str(path.parent)
    sys.path.insert(0, folder)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name while it runs
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as err:
        sys.modules.pop(name, None)
        # only an import needs the note on where sibling modules are found
        where = (
            " (its folder is on sys.path while it loads, so sibling modules import by name)"
            if isinstance(err, ImportError)
            else ""
        )
        raise ValueError(
            f"{fn}: importing {kind} file {path_text!r} failed with {type(err).__name__}: {err}; fix the file{where}"
        ) from err
    finally:
        # Remove the entry inserted above (the file may have changed sys.path; remove ours, once).
        for i, entry in enumerate(sys.path):
            if entry == folder:
                del sys.path[i]
                break
    if _LOADED is not None:
        _LOADED[name] = (content, module)
    return module


_LOADED: dict[str, tuple[str, object]] | None = None
"""Inside :func:`one_module_per_file`, the files :func:`_import_file` ran, by module name: ``(sha1 of the file's
bytes, module)``; ``None`` outside it (every load runs the file afresh, as a Python caller changing an
environment variable between loads expects)."""


@contextlib.contextmanager
def one_module_per_file():
    """Within the block, a file loaded again unchanged (``--task F.py:task --candidate F.py:step`` of one command)
    is the module loaded first, not a second run of the file: the task's and the candidate's code share its
    globals (a module-level switch one sets is the one the other reads). The command line runs each command in
    this block."""
    global _LOADED
    outer, _LOADED = _LOADED, ({} if _LOADED is None else _LOADED)
    try:
        yield
    finally:
        _LOADED = outer


def _import_module(spec: str, module_name: str, fn: str = "load_task"):
    # like `python -m`, a module in the current folder is importable (a console script's sys.path lacks it)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise ValueError(
                f"{fn}: module {module_name!r} (spec {spec!r}) is not importable: {err}; install it, add its "
                "folder to PYTHONPATH, or pass a file as FILE.py:ATTR"
            ) from err
        raise ValueError(
            f"{fn}: importing module {module_name!r} failed with {type(err).__name__}: {err}; fix the module"
        ) from err
    except (Exception, SystemExit) as err:
        raise ValueError(
            f"{fn}: importing module {module_name!r} failed with {type(err).__name__}: {err}; fix the module"
        ) from err


def _public_names(module, wanted: str = "task") -> str:
    """The module's public names for an error: its Tasks (``wanted="task"``) or functions (``"step"``) first,
    then the rest; the modules it imported (``jax``, ``nnx``) left out."""
    public = {
        n: v for n, v in vars(module).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)
    }
    if wanted == "task":
        label, best = "tasks", sorted(n for n, v in public.items() if isinstance(v, Task))
    else:
        label, best = (
            "functions",
            sorted(n for n, v in public.items() if callable(v) and not isinstance(v, type)),
        )
    rest = sorted(set(public) - set(best))
    shown = ", ".join(rest[:30]) + (f", ... ({len(rest) - 30} more)" if len(rest) > 30 else "")
    parts = [f"its {label}: {', '.join(best)}"] if best else []
    if rest:
        parts.append(f"{'other ' if best else ''}public names: {shown}")
    return "; ".join(parts) or "no public names"


def _did_you_mean(obj, name: str) -> str:
    """``"did you mean 'task'? "`` for the public attribute of ``obj`` closest to a misspelt ``name``, else ``""``."""
    names = [
        n
        for n in dir(obj)
        if not n.startswith("_") and not isinstance(getattr(obj, n, None), types.ModuleType)
    ]  # not the modules it imported (trial 52: ':nope' was asked "did you mean 'np'?")
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def _resolve_attr(spec: str, source: str, module, attr: str) -> Task:
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"load_task: {source} has no attribute {attr!r} (spec {spec!r}); {_did_you_mean(obj, part)}"
                f"{_public_names(module)}; name "
                f"one of them after ':', or define {attr} = shardcheck.Task(model=..., optimizer=..., loss_fn=..., "
                "batches=...) in the file"
            )
        obj = getattr(obj, part)
    if isinstance(obj, Task):
        return obj
    if not callable(obj):
        from shardcheck.parity.diagnosis.grouping import article

        raise TypeError(
            f"load_task: {spec!r} names {article(type(obj).__name__)}, not a Task; ATTR must be a shardcheck.task.Task or "
            "a zero-argument callable returning one"
        )
    try:
        required = [
            p.name
            for p in inspect.signature(obj).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
    except (TypeError, ValueError):  # builtins without a signature: call and see
        required = []
    if required:
        raise TypeError(
            f"load_task: {spec!r} needs argument(s) {', '.join(required)}; ATTR must be a Task or a zero-argument "
            "callable returning one (give its arguments defaults, or bind them with functools.partial)"
        )
    try:
        task = obj()
    except Exception as err:
        kind = TypeError if isinstance(err, TypeError) else ValueError
        raise kind(f"load_task: calling {attr}() of {spec!r} raised {type(err).__name__}: {err}") from err
    if not isinstance(task, Task):
        raise TypeError(
            f"load_task: {attr}() of {spec!r} returned {type(task).__name__}, not a shardcheck.task.Task; return "
            "Task(model=..., optimizer=..., loss_fn=..., batches=...)"
        )
    return task


def load_task(spec: str, **options) -> Task:
    """The task named by ``spec``.

    Forms of ``spec``:

    * ``NAME``: a built-in task (a key of :data:`shardcheck.tasks.BUILTIN_TASKS`); ``options`` are passed to its
      factory (``optimizer``, ``lr``, ``batch_size``, ``steps``, ``seed`` and the task's own).
    * ``FILE.py:ATTR``: the attribute ``ATTR`` of a Python file, imported with the file's folder first on
      ``sys.path`` (so it can ``import model`` from a sibling ``model.py``); the folder is removed from
      ``sys.path`` again afterwards. Sibling modules it imported stay in ``sys.modules``.
    * ``MODULE:ATTR``: the attribute ``ATTR`` of an importable module (``ATTR`` may be dotted).

    ``ATTR`` is a :class:`~shardcheck.task.Task` or a zero-argument callable returning one.

    Args:
        spec: the task, in one of the forms above.
        **options: options of a built-in task.

    Returns:
        The :class:`~shardcheck.task.Task`.

    Raises:
        TypeError: ``spec`` not a string; ``ATTR`` neither a Task nor a zero-argument callable returning one
            (also a TypeError raised by calling it).
        ValueError: an unknown built-in name (the message lists the names), an option the built-in does not take,
            options given for a user task, a missing file, a file or module that fails to import (the message
            names it and the original error's type and message), a missing attribute (the message lists the
            module's public names), a spec with an empty part; errors of the built-in's own option checks and
            any other error raised by calling ``ATTR``. Every message starts with ``load_task:``.
    """
    if not isinstance(spec, str):
        raise TypeError(
            f"load_task: spec must be a string ({SPEC_FORMS}), got {type(spec).__name__}; pass e.g. 'diabetes'"
        )
    builtins = _builtins()
    if spec in builtins:
        return _load_builtin(spec, options)
    if ":" not in spec:
        if spec.endswith(".py") or "/" in spec or "\\" in spec:
            raise ValueError(
                f"load_task: spec {spec!r} names a file but no attribute; pass FILE.py:ATTR, e.g. {spec}:task "
                f"(built-in tasks: {_builtin_names()})"
            )
        close = difflib.get_close_matches(spec, list(builtins), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"load_task: {spec!r} is not a built-in task; {hint}built-in tasks: {_builtin_names()}; or pass "
            "FILE.py:ATTR or MODULE:ATTR"
        )
    source, _, attr = spec.rpartition(":")
    if not source or not attr:
        raise ValueError(
            f"load_task: spec {spec!r} has an empty {'FILE/MODULE' if not source else 'ATTR'} part; pass "
            "FILE.py:ATTR or MODULE:ATTR, e.g. my_task.py:task"
        )
    if options:
        raise ValueError(
            f"load_task: option(s) {', '.join(sorted(options))} apply to built-in tasks only ({_builtin_names()}); "
            f"{spec!r} is a user task: set them inside it"
        )
    if source.endswith(".py"):
        module = _import_file(spec, source)
        where = f"task file {source!r}"
    else:
        module = _import_module(spec, source)
        where = f"module {source!r}"
    task = _resolve_attr(spec, where, module, attr)
    # a task the file left unnamed goes by its spec in the reports ("my_task.py:task", not "task")
    return dataclasses.replace(task, name=spec) if task.name == Task.name else task


def spec_module(fn: str, spec: str):
    """The module a ``FILE.py:ATTR`` / ``MODULE:ATTR`` spec names (a file loaded as :func:`import_attr` loads it;
    once per command inside :func:`one_module_per_file`): what a refusal lists the file's names from."""
    target = spec.rpartition(":")[0]
    return (
        _import_file(spec, target, fn, "candidate")
        if target.endswith(".py")
        else _import_module(spec, target, fn)
    )


def import_attr(fn: str, spec: str, what: str = "ATTR"):
    """The object ``spec`` names, ``FILE.py:ATTR`` or ``MODULE:ATTR`` (ATTR may be dotted), as :func:`load_task`
    imports it (a file's folder is on ``sys.path`` while it loads).

    Raises:
        ValueError: a malformed spec, a missing file or module, an import that fails (naming the file and the
            error), a missing attribute (listing the public names found).
    """
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"{fn}: {spec!r} must be MODULE:{what} or PATH.py:{what}, e.g. my_steps.py:dp_step")
    if target.endswith(".py"):
        module = _import_file(spec, target, fn, "candidate")
    else:
        module = _import_module(spec, target, fn)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"{fn}: {target!r} has no attribute {attr!r} (spec {spec!r}); {_did_you_mean(obj, part)}"
                f"{_public_names(module, 'step')}; name one "
                "of them after ':', or define it in the file"
            )
        obj = getattr(obj, part)
    return obj
