"""Per-leaf tolerance overrides (``check_parity(leaf_tolerance=...)``): the names a leaf's tolerance can take
and the user's mapping or callable checked against them, before anything runs."""

from __future__ import annotations

from collections.abc import Mapping

from flax import nnx

from shardcheck.parity.comparison.live import flatten_state, is_int
from shardcheck.parity.harness.state import _opt_state


def _leaf_names(model: nnx.Module, optimizer: nnx.Optimizer) -> list[str]:
    """Every name a per-leaf tolerance can take: ``"loss"``, ``"param <path>"``, ``"grad <path>"``,
    ``"opt_state <path>"`` (float leaves)."""
    params = flatten_state(nnx.state(model, nnx.Param))
    state = [k for k, v in flatten_state(_opt_state(optimizer)).items() if not is_int(v)]
    return [
        "loss",
        *(f"{kind} {p}" for kind in ("param", "grad") for p in params),
        *(f"opt_state {p}" for p in state),
    ]


def _tolerance_pair(fn: str, where: str, value) -> tuple[float, float]:
    ok = (
        isinstance(value, tuple | list)
        and len(value) == 2
        and all(isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in value)
    )
    if not ok:
        raise ValueError(f"{fn}: {where} must be a pair (rtol, atol) of numbers >= 0, got {value!r}")
    return float(value[0]), float(value[1])


def _check_leaf_tolerance(fn, leaf_tolerance, names: list[str]):
    """``leaf_tolerance`` as a table ``name -> (rtol, atol)`` over the task's leaf ``names``
    (:func:`_leaf_names`), checked before anything runs: a mapping's every key must name a leaf (as ``"param
    hidden.kernel"`` or the path alone, which applies to each kind); a callable is called once per name here and
    must return ``None`` or a pair."""
    if leaf_tolerance is None:
        return None
    if isinstance(leaf_tolerance, Mapping):
        table = {}
        for key, value in leaf_tolerance.items():
            pair = _tolerance_pair(fn, f"leaf_tolerance[{key!r}]", value)
            matched = [n for n in names if key in (n, n.split(" ", 1)[-1])] if isinstance(key, str) else []
            if not matched:
                examples = ", ".join(repr(n) for n in names[:4])
                raise ValueError(
                    f"{fn}: leaf_tolerance key {key!r} names no leaf of the task; a key is 'loss', "
                    f"'<kind> <path>' (kind: param, grad, opt_state) or a path alone, e.g. {examples} "
                    f"({len(names)} names); check its spelling"
                )
            for n in matched:
                if n == key or n not in table:  # a full name wins over its bare path
                    table[n] = pair
        return table
    if callable(leaf_tolerance):
        table = {}
        for name in names:
            try:
                value = leaf_tolerance(name)
            except Exception as err:
                raise ValueError(
                    f"{fn}: leaf_tolerance({name!r}) raised {type(err).__name__}: {err}; it is called with one "
                    "leaf name and returns (rtol, atol) or None"
                ) from err
            if value is not None:
                table[name] = _tolerance_pair(fn, f"leaf_tolerance({name!r})", value)
        return table
    raise TypeError(
        f"{fn}: leaf_tolerance must be a mapping {{leaf: (rtol, atol)}} or a callable leaf -> (rtol, atol) | None, "
        f"got {type(leaf_tolerance).__name__}"
    )
