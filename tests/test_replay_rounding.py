"""Rounding-level leaves in the grouping, live and replayed alike (issue #36, a user's trial).

A parameter whose true gradient is 0 (an attention key bias: the softmax ignores a shift of a query's scores)
matches under any fault of the gradients. A fault in the module that holds it (``blocks.0.attn``'s gradients
never all-reduced) fails every other leaf under that module: the group is that module, its key bias set aside as
at rounding level, not "the failing leaves ... share no ndim, name or module". A replay of a step that returns no
gradients knows those leaves as the live check does: from the task's own gradient (``record_run(...,
true_gradients=True)``), so that it names the group and prints the ``rounding_level`` note as live.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardcheck import Task, check_parity
from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.grouping import NO_PROPERTY, state_property
from shardcheck.parity.diagnosis.localization import localize
from shardcheck.parity.diagnosis.rules import DiagnosisContext, localized

ROUNDING = "(a true gradient of 0 shows no difference)"

# --------------------------------------------------------------------------------------- the grouping, on records

MODULES = ("blocks.0.attn", "blocks.1.attn")
PARAMS = {
    f"{m}.{p}.{w}": (4,) if w == "bias" else (4, 4)
    for m in MODULES
    for p in "qkv"
    for w in ("bias", "kernel")
}
QUIET = frozenset({"blocks.0.attn.k.bias", "blocks.1.attn.k.bias"})


def _opt_leaf(path: str, ok: bool) -> LeafError:
    return LeafError(
        0, "opt_state", path, 0.0 if ok else 1.0, 0.0 if ok else 1.0, 0.5, ok, shape=PARAMS[path[5:]]
    )


def _record(rounding: tuple[str, ...]) -> StepRecord:
    """Step 0 of Adam whose blocks.0.attn gradients were not all-reduced: both moments of every leaf under it
    fail but the key bias's (a true gradient of 0), every other leaf matches; ``rounding``: its
    ``rounding_level``."""
    leaves = [LeafError(0, "loss", "loss", 0.0, 0.0, 1e-6, True)]
    leaves += [LeafError(0, "param", p, 0.0, 0.0, 1e-6, True, shape=s) for p, s in PARAMS.items()]
    for p in PARAMS:
        ok = not p.startswith("blocks.0.attn") or p in QUIET
        leaves += [_opt_leaf(f"0.{m}.{p}", ok) for m in ("mu", "nu")]
    return StepRecord(0, 1e-5, 1e-6, 1.0, 1.0, tuple(leaves), 1, 1, rounding_level=rounding)


def test_matching_rounding_level_leaves_do_not_hide_the_module_and_are_named():
    """With the key biases at rounding level: the group is blocks.0.attn, its key bias named at rounding level
    (not blocks.1's: it contradicts nothing); without, no module, the leaves listed as the stage table lists
    them (``opt_state 0.mu...``)."""
    quiet = _record(tuple(f"param {p}" for p in sorted(QUIET)))
    group = (
        f"every failing leaf is under blocks.0.attn; the other leaves under it are at rounding level {ROUNDING}: "
        "blocks.0.attn.k.bias; every other leaf matches"
    )
    assert localize([quiet]).group == group
    assert f"{group[0].upper()}{group[1:]}." in localized(DiagnosisContext.build([quiet])).message
    # the other side: no leaf known at rounding level, nothing shared
    blind = localize([_record(())]).group
    assert NO_PROPERTY in blind and ROUNDING not in blind
    assert blind.startswith("the failing leaves (opt_state 0.mu.blocks.0.attn.k.kernel, opt_state 0.mu.")


def test_rounding_level_leaves_are_set_aside_only_where_they_alone_contradict():
    """A failing set that shares nothing with or without the quiet leaves keeps its listing; a property that
    holds outright names no rounding-level leaf; where the rounding-level leaves are the only matching ones, no
    property is read against them."""
    failing = {"a.kernel": (4, 4), "b.bias": (4,)}
    matching = {"c.kernel": (4, 4), "c.bias": (4,), "a.bias": (4,)}
    params = {**failing, **matching}
    said = state_property(failing, matching, params, quiet={"a.bias"})
    assert NO_PROPERTY in said and ROUNDING not in said
    outright = state_property(
        {"a.kernel": (4, 4), "a.bias": (4,)}, {"c.kernel": (4, 4)}, params, quiet={"c.kernel"}
    )
    # the only matching leaf at rounding level: no property is read against it (trial 7: "every failing leaf is
    # split over ('fsdp',); every replicated leaf matches" of one fused qkv bias allowed its noise)
    assert outright == (
        "every leaf differs but those with elements whose gradient is at rounding level (near 0 at that step: a "
        "true gradient of 0, such as an attention key bias's, or one small by chance), allowed their noise: "
        "c.kernel"
    )
    held = state_property(
        {"a.kernel": (4, 4), "a.bias": (4,)}, {"c.kernel": (4, 4), "c.bias": (4,)}, params, quiet={"c.kernel"}
    )
    assert held == "every failing leaf is under a; every other leaf matches"  # c.bias matches outright
    # an optimizer-state leaf is read as its parameter's: both moments of a.bias set aside
    params = {**params, "a.scale": (4,)}
    state = {f"0.{m}.{p}": params[p] for m in ("mu", "nu") for p in params}
    bad = {k: s for k, s in state.items() if k.endswith(("a.kernel", "a.scale"))}
    good = {k: s for k, s in state.items() if k not in bad}
    assert state_property(bad, good, params, quiet={"a.bias"}) == (
        f"every failing leaf is under a; the other leaves under it are at rounding level {ROUNDING}: a.bias; "
        "every other leaf matches"
    )


# ------------------------------------------------------------------------------------------ live and replayed

V, D, T = 32, 16, 8
EMBED_SCALE = 2.0  # 1.5 to 3 all hold the key bias at rounding level and every other leaf above it


class _Block(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=D, decode=False, rngs=rngs)
        self.mlp = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(x)
        return x + nnx.relu(self.mlp(x))


class _Model(nnx.Module):
    def __init__(self, rngs):
        # large embeddings: a sharp attention, whose query and key gradients stand well above rounding
        self.embed = nnx.Embed(V, D, embedding_init=nnx.initializers.normal(EMBED_SCALE), rngs=rngs)
        self.blocks = nnx.List([_Block(rngs) for _ in range(2)])
        self.head = nnx.Linear(D, 4, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=1))


def _loss(model, batch):
    ce = optax.softmax_cross_entropy_with_integer_labels(model(batch["tokens"]), batch["label"])
    return jnp.sum(ce), jnp.asarray(ce.size, jnp.float32)


def _task() -> Task:
    rng = np.random.default_rng(0)
    batches = [
        {
            "tokens": rng.integers(0, V, (8, T)).astype(np.int32),
            "label": rng.integers(0, 4, (8,)).astype(np.int32),
        }
        for _ in range(2)
    ]
    model = lambda: _Model(nnx.Rngs(params=0))  # noqa: E731
    return Task(model=model, optimizer=optax.adam(1e-2), loss_fn=_loss, batches=batches, name="attention")


def _step(unreduced: str | None):
    """A shard_map data-parallel step returning its loss only; the gradients under ``unreduced`` are each
    device's own (the all-reduce forgotten for that module)."""

    def step(model, optimizer, batch, mesh):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def body(params, rest, batch):
            def local(p):
                loss_sum, count = _loss(nnx.merge(graphdef, p, rest), batch)
                return loss_sum / jax.lax.psum(count, "data")

            loss, grads = jax.value_and_grad(local)(params)

            def reduce(path, g):
                name = jax.tree_util.keystr(path, simple=True, separator=".")
                return g * 2 if unreduced and name.startswith(unreduced) else jax.lax.psum(g, "data")

            return jax.lax.psum(loss, "data"), jax.tree_util.tree_map_with_path(reduce, grads)

        mapped = jax.shard_map(
            body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P(), check_vma=False
        )
        loss, grads = jax.jit(mapped)(params, rest, batch)
        optimizer.update(model, grads)
        return loss

    return step


@pytest.fixture(scope="module")
def live_and_replayed():
    """The faulty step checked live and replayed against a recording of the correct one, on data=2."""
    from shardcheck.mesh import make_mesh
    from shardcheck.parity.harness.recorded import record_run

    require_devices(2)
    task, mesh = _task(), make_mesh({"data": 2})
    recording = record_run(task, _step(None), mesh=mesh, name="good")
    assert "true_gradients" not in recording.meta  # asked by a replay only: a recording stays as it was
    faulty = _step("blocks.0.attn")
    return check_parity(faulty, task, mesh=mesh), check_parity(faulty, task, mesh=mesh, reference=recording)


@require_devices(2)
def test_a_replay_names_the_module_and_the_rounding_level_leaves_as_live(live_and_replayed):
    live, replayed = live_and_replayed
    group = (
        f"Every failing leaf is under blocks.0.attn; the other leaves under it are at rounding level {ROUNDING}: "
        "blocks.0.attn.key.bias; every other leaf matches."
    )
    messages = [{d.code: d.message for d in r.diagnoses} for r in (live, replayed)]
    for found in messages:
        assert not found.get("ok", False) and group in found["localized"], found
        assert "2 leaves have a gradient at rounding level" in found["rounding_level"]
        assert "param blocks.0.attn.key.bias" in found["rounding_level"]
    assert messages[0]["rounding_level"] == messages[1]["rounding_level"]
    # the replay compares its copies across the devices (trial 37): the replicas stage, localized as live
    assert replayed.localization.stage == live.localization.stage == "replicas"
    assert replayed.localization.group == live.localization.group
    assert NO_PROPERTY not in replayed.replay.cause
    # the copies' form is read from each device's arrays, which only a live check holds: a replay says which
    # copies differ along which axes, and that no factor is read from digests
    assert live.localization.form.sentence.startswith("the copies along 'data' differ")
    form = replayed.localization.form
    assert (
        form.kind == "replicas"
        and form.factor is None
        and form.leaves == len(replayed.steps[0].replica_mismatches)
    )
    assert (
        " differ along 'data' (a replay holds a digest of each device's copy, not its values" in form.sentence
    )
    # the replay's steps know the key biases at rounding level from the task's own gradient, as live
    assert {p for r in replayed.steps for p in r.rounding_level} == {
        "param blocks.0.attn.key.bias",
        "param blocks.1.attn.key.bias",
    }
