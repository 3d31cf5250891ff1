"""What the grouping reads of each parameter beside its path (:class:`~shardcheck.parity.diagnosis.grouping.LeafFacts`).

:func:`leaf_facts`: each parameter's shape, dtype and the mesh axes of its placement; the module paths that hold
it where several do (:func:`shared_paths`: one ``nnx.Param`` referenced twice, a tied leaf); and, given the task,
the operations of the loss that read it (:func:`loss_uses`: a table both looked up and multiplied, as a tied
embedding is, is read by two). The facts are built when first read (a passing check reads none of them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import jax
import numpy as np
from flax import nnx

from shardcheck.parity.comparison.live import flatten_state
from shardcheck.parity.diagnosis.grouping import LeafFacts


def shared_paths(model: nnx.Module) -> dict[str, tuple[str, ...]]:
    """``{parameter path: every path that reaches it}`` for each ``nnx.Param`` that two or more module paths hold
    (one Variable object referenced twice, a tied or shared leaf: ``self.head.kernel = self.embed.embedding``);
    its path in ``nnx.state`` is the first of them. Read from the graph (``nnx.iter_graph`` visits each node once;
    each node's own attributes, ``get_node_impl(node).node_dict``, give every path to a Variable). A table used
    twice through one module (``nnx.Embed.attend``) is one path, not shared (:func:`loss_uses` sees it)."""
    paths: dict[int, list[tuple]] = {}
    for path, node in nnx.iter_graph(model):
        impl = None if isinstance(node, nnx.Variable) else nnx.graph.get_node_impl(node)
        if impl is None:
            continue
        for key, child in impl.node_dict(node).items():
            if isinstance(child, nnx.Param):
                paths.setdefault(id(child), []).append((*path, key))
    dotted = [sorted(".".join(str(k) for k in p) for p in ps) for ps in paths.values() if len(ps) > 1]
    state = set(flatten_state(nnx.as_pure(nnx.state(model, nnx.Param))))
    return {next((p for p in ps if p in state), ps[0]): tuple(ps) for ps in dotted}


def _reads(jaxpr, var) -> list[str]:
    """The primitives of ``jaxpr`` that read ``var``, looking inside the sub-programs of calls (``pjit``,
    ``remat``, ``scan``: their ``jaxpr`` parameter, whose inputs are the call's); another primitive counts once."""
    out = []
    for eqn in jaxpr.eqns:
        for i, v in enumerate(eqn.invars):
            if v is not var:
                continue
            sub = eqn.params.get("jaxpr")
            inner = getattr(sub, "jaxpr", sub)
            if inner is not None and hasattr(inner, "eqns") and len(inner.invars) == len(eqn.invars):
                out += _reads(inner, inner.invars[i])
            else:
                out.append(eqn.primitive.name)
    return out


def loss_uses(model: nnx.Module, loss_fn: Callable, batch) -> dict[str, tuple[str, ...]]:
    """``{parameter path: the primitives of the loss that read it}``, from the jaxpr of ``loss_fn(model, batch)``
    as a function of the parameters (traced, not compiled). ``{}`` where the loss cannot be traced alone (a
    sharding constraint that needs the step's mesh, a step-only input): then nothing is said of the uses."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    pure = nnx.as_pure(params)

    def loss(p):
        return loss_fn(nnx.merge(graphdef, p, rest), batch)

    try:
        closed = jax.make_jaxpr(loss)(pure)
    except Exception:  # noqa: BLE001  (any failure to trace leaves the uses unknown, never a wrong claim)
        return {}
    paths = list(flatten_state(pure))
    if len(paths) != len(closed.jaxpr.invars):
        return {}
    return {p: tuple(_reads(closed.jaxpr, v)) for p, v in zip(paths, closed.jaxpr.invars, strict=True)}


def param_groups(params, tx) -> dict[str, str]:
    """``{parameter path: label}`` of an ``optax.multi_transform`` (also one nested in a chain): the label under
    whose inner state (``inner_states.<label>.``) the parameter's own state leaves lie, where they lie under
    one label only; ``{}`` for another optimizer, or where its state cannot be built abstractly. A parameter
    whose group keeps no state for it (plain SGD) has no entry."""
    try:
        state = jax.eval_shape(tx.init, params)
    except Exception:  # noqa: BLE001 - a transformation that needs more than the parameters: no groups known
        return {}
    names = set(flatten_state(params))
    labels: dict[str, set[str]] = {}
    for path in flatten_state(state):
        parts = path.split(".")
        if "inner_states" not in parts[:-1]:
            continue
        at = parts.index("inner_states") + 1
        # the parameter path the state path ends in (its longest suffix that is one)
        owned = next(
            (".".join(parts[i:]) for i in range(at + 1, len(parts)) if ".".join(parts[i:]) in names), None
        )
        if owned is not None:
            labels.setdefault(owned, set()).add(parts[at])
    return {p: next(iter(ls)) for p, ls in labels.items() if len(ls) == 1}


def module_classes(model: nnx.Module) -> dict[str, str]:
    """``{parameter path: the class name of the module that holds it}`` (``"bn1.scale"`` -> ``"BatchNorm"``), from
    the graph (``nnx.iter_graph``): what a group of failing leaves may share where no name does (trial 25: a decay
    on every BatchNorm's scale and bias, beside conv biases that matched, "shared no ndim, name or module")."""
    nodes = dict(nnx.iter_graph(model))
    return {
        ".".join(str(k) for k in path): type(nodes[path[:-1]]).__name__
        for path, node in nodes.items()
        if isinstance(node, nnx.Param) and path and path[:-1] in nodes
    }


def _facts(model: nnx.Module, task) -> dict[str, LeafFacts]:
    shared = shared_paths(model)
    modules = module_classes(model)
    uses = loss_uses(model, task.loss_fn, task.batches[0]) if task is not None and task.batches else {}
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    groups = param_groups(params, task.optimizer) if task is not None else {}
    out = {}
    for path, leaf in flatten_state(params).items():
        spec = getattr(getattr(leaf, "sharding", None), "spec", None)
        axes: list[str] = []
        for entry in spec or ():
            if entry is None:
                continue
            axes += list(entry) if isinstance(entry, tuple) else [entry]
        paths = shared.get(path, ())
        out[path] = LeafFacts(
            tuple(np.shape(leaf)),
            str(np.dtype(leaf.dtype)),
            tuple(axes),
            bool(paths),
            paths,
            uses.get(path),
            groups.get(path),
            modules.get(path),
            tuple(i for i, entry in enumerate(spec or ()) if entry is not None),
        )
    return out


class _Lazy(Mapping):
    """A mapping built by ``build()`` when first read."""

    def __init__(self, build: Callable[[], dict]):
        self._build, self._built = build, None

    def _get(self) -> dict:
        if self._built is None:
            self._built = self._build()
        return self._built

    def __getitem__(self, key):
        return self._get()[key]

    def __iter__(self) -> Iterator:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


def leaf_facts(model: nnx.Module, task=None) -> Mapping[str, LeafFacts]:
    """``{parameter path: LeafFacts}`` of a model, built when first read: each leaf's shape, dtype, the mesh axes
    its placement splits it over (read from its ``NamedSharding``; ``()`` where it is replicated or not on a
    mesh), the paths that share it where several do (:func:`shared_paths`), and with ``task`` (a
    :class:`~shardcheck.Task`) the operations of its loss that read it, on its first batch (:func:`loss_uses`),
    and the parameter group of its optimizer that updates it (:func:`param_groups`)."""
    return _Lazy(lambda: _facts(model, task))
