"""The model's state beside its parameters that a step writes (an ``nnx.Variable`` counter incremented in
``__call__``, as the Flax NNX docs write one): compared after every step, exactly.

The single-device step writes back what the forward pass wrote to that state, once a step
(:func:`shardcheck.steps._core.shard_value_and_grad`), as ``nnx.value_and_grad`` does; a candidate must leave
the same values. Integer (and boolean) leaves are compared; floating ones (a running-statistics cache) are not
yet.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from shardcheck.parity.comparison.live import counter_error, is_int
from shardcheck.parity.diagnosis.evidence import LeafError

PREFIX = "model."
"""The path prefix of a model-state leaf in a report (``counter model.calls``), beside the optimizer's counters."""


def model_state(model: nnx.Module, found: dict | None = None, key: str = "model_state") -> dict:
    """``{dotted path: array}`` of the model's integer state that is neither a parameter nor an RNG stream.

    ``found``: where the model's steps write into its Variables in place, a mapping in which the Variables are
    kept under ``key`` when first found (one graph traversal), and read at every later call without another."""
    entry = None if found is None else found.get(key)
    if entry is None or entry[0] is not model:
        flat = nnx.to_flat_state(nnx.state(model, nnx.All(nnx.Not(nnx.Param), nnx.Not(nnx.RngState))))
        entry = (model, [(".".join(map(str, p)), v) for p, v in flat])
        if found is not None:
            found[key] = entry
    return {path: v[...] for path, v in entry[1] if is_int(v[...])}


def model_state_leaves(
    step: int, ref_model: nnx.Module, cand_model: nnx.Module, found: dict | None = None
) -> list[LeafError]:
    """One exact ``counter`` leaf per integer model-state leaf both models hold (path ``model.<path>``); an
    array leaf's error is its largest elementwise difference. ``found``: as :func:`model_state`'s."""
    ref = model_state(ref_model, found, "model_state ref")
    cand = model_state(cand_model, found, "model_state cand")
    out = []
    for path, r in ref.items():
        if path not in cand:
            continue
        if np.size(r) == 1:
            out.append(counter_error(step, PREFIX + path, r, cand[path]))
            continue
        r64, c64 = np.asarray(r, np.int64), np.asarray(cand[path], np.int64)
        err = float(np.max(np.abs(c64 - r64), initial=0))
        top = float(np.max(np.abs(r64), initial=0))
        rel = err / top if top else (0.0 if err == 0 else np.inf)
        out.append(LeafError(step, "counter", PREFIX + path, err, rel, 0.0, err == 0, None))
    return out
