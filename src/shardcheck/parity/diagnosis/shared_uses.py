"""A module's parameters read by several of its calls, whose gradient holds only some of the calls' terms.

A tied embedding's table is read twice in the forward pass: looked up (``nnx.Embed.__call__``) and as the output
head (``nnx.Embed.attend``). Its gradient is the sum of the two uses' terms. A step that stops the gradient of one
use (``jax.lax.stop_gradient`` on the table in the head, a copy of the table there) returns the other's alone,
which read "no constant factor: its elementwise ratio runs from -0.12 to 0.93, median 0" (trial 61).

:func:`uses_left_out` computes each call's term at the reference's pre-step state: every call of the module gets
its own offset of the module's parameters (zeros), and the gradient of the task's loss with respect to the offsets
is the calls' terms (their sum is the parameters' gradient). Where the failing gradients are one module's, the loss
matches and the candidate's returned gradients are the sum of some of the calls' terms within their tolerances,
the calls left out are named.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend.core import get_opaque_trace_state

from shardcheck.parity.comparison.live import flatten_state, to_host
from shardcheck.parity.diagnosis.evidence import StepRecord
from shardcheck.task import mean_loss

MAX_CALLS = 4
"""The most calls of one module whose subsets are tried (2^4 - 2 sums)."""


def uses_left_out(
    run, pre, batch, record: StepRecord, cand_grads
) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """``(module, kept, left_out)`` where the failing gradients are the parameters of one module (its path) that
    several calls of the module read (``kept``, ``left_out``: the calls' ``"path.method"``, in call order), the
    loss matches, and the candidate's returned gradients ``cand_grads`` are the sum of the terms of the calls
    ``kept`` alone, within each leaf's tolerance; ``()`` otherwise (and against a user's reference step, or
    where a call of the module runs inside a transform of the forward or the forward does not trace)."""
    grads = [e for e in record.leaves if e.kind == "grad"]
    bad = [e for e in grads if not e.ok]
    losses = [e for e in record.leaves if e.kind == "loss"]
    if cand_grads is None or run.reference is not None or not bad or not all(e.ok for e in losses):
        return ()
    modules = {e.path.rsplit(".", 1)[0] for e in bad if "." in e.path}
    if len(modules) != 1 or any("." not in e.path for e in bad):
        return ()
    (module,) = modules
    terms = _call_terms(run.task.loss_fn, pre, batch, module)
    if terms is None or not 2 <= len(terms) <= MAX_CALLS:
        return ()
    tolerance = {e.path: e.tolerance for e in grads if e.path.startswith(module + ".")}
    flat = flatten_state(nnx.as_pure(cand_grads))
    cand = {p: np.asarray(to_host(flat[p]), np.float64) for p in tolerance if p in flat}
    names = [name for name, _ in terms]
    for size in range(len(terms) - 1, 0, -1):
        for kept in itertools.combinations(range(len(terms)), size):
            if all(_within(cand, terms, kept, p, t) for p, t in tolerance.items()):
                left = tuple(names[i] for i in range(len(terms)) if i not in kept)
                return module, tuple(names[i] for i in kept), left
    return ()


def _within(cand: dict, terms, kept, path: str, tolerance: float) -> bool:
    name = path.rsplit(".", 1)[1]
    if path not in cand:
        return False
    total = sum(np.asarray(terms[i][1][name], np.float64) for i in kept)
    return bool(np.max(np.abs(cand[path] - total)) <= tolerance)


def _call_terms(loss_fn, pre, batch, module: str) -> list[tuple[str, dict]] | None:
    """``[("path.method", {param name: host array}), ...]``: each call of the module at ``module``'s term of its
    parameters' gradient (of the task's mean loss at ``pre``), in call order; ``None`` where the module is not
    reached by attributes, a call of it runs inside a transform of the forward, or the forward does not trace."""
    try:
        calls = _traced_calls(loss_fn, pre, batch, module, None)
        if not calls:
            return None
        offsets = [{n: jnp.zeros(v.shape, v.dtype) for n, v in shapes.items()} for _, shapes in calls]
        terms = jax.jit(jax.grad(lambda o: _traced_loss(loss_fn, pre, batch, module, o)))(offsets)
    except Exception:  # noqa: BLE001 - a forward that does not trace so: no reading
        return None
    return [
        (f"{module}.{name}", {n: np.asarray(to_host(a)) for n, a in term.items()})
        for (name, _), term in zip(calls, terms, strict=True)
    ]


def _traced_calls(loss_fn, pre, batch, module: str, offsets):
    """The calls of the module at ``module`` in one trace of the loss: ``[(method, {param name: shape}), ...]``."""
    found = []

    def count(params, rest):
        model = nnx.merge(pre.graphdef, params, rest)
        with _per_call(_module_at(model, module), offsets, found):
            return mean_loss(loss_fn, model, batch)

    jax.eval_shape(count, pre.params, pre.rest)
    return found


def _traced_loss(loss_fn, pre, batch, module: str, offsets):
    model = nnx.merge(pre.graphdef, pre.params, pre.rest)
    with _per_call(_module_at(model, module), offsets, []):
        return mean_loss(loss_fn, model, batch)


def _module_at(model: nnx.Module, path: str) -> nnx.Module:
    """The module at the dotted attribute ``path`` of ``model``; raises ``AttributeError`` where there is none."""
    target = model
    for part in path.split("."):
        target = target[int(part)] if part.isdigit() else getattr(target, part)
    if not isinstance(target, nnx.Module):
        raise AttributeError(f"{path} is no module")
    return target


@contextlib.contextmanager
def _per_call(target: nnx.Module, offsets, found: list):
    """Within the block, each call of ``target``'s ``__call__`` or public methods (its class's own, patched on
    the class and restored on leaving) reads its parameters plus the next of ``offsets`` (``None``: as they are),
    and appends ``(method, {param name: ShapeDtypeStruct})`` to ``found``. A call in another trace than the
    block's (inside a transform of the forward) raises ``ValueError``."""
    cls, outer = type(target), get_opaque_trace_state()
    originals = {
        name: method
        for name, method in vars(cls).items()
        if inspect.isfunction(method) and (name == "__call__" or not name.startswith("_"))
    }

    def wrapped(name, method):
        def call(self, *args, **kwargs):
            if self is not target:
                return method(self, *args, **kwargs)
            if get_opaque_trace_state() != outer:
                raise ValueError(f"{name} runs inside a transform of the forward")
            params = {n: v for n, v in vars(self).items() if isinstance(v, nnx.Param)}
            saved = {n: v[...] for n, v in params.items()}
            i = len(found)
            found.append((name, {n: jax.ShapeDtypeStruct(a.shape, a.dtype) for n, a in saved.items()}))
            if offsets is not None:
                for n, v in params.items():
                    v[...] = saved[n] + offsets[i][n].astype(saved[n].dtype)
            try:
                return method(self, *args, **kwargs)
            finally:
                for n, v in params.items():
                    v[...] = saved[n]

        return call

    for name, method in originals.items():
        setattr(cls, name, wrapped(name, method))
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(cls, name, method)
