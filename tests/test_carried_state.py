"""A model that carries per-row state between batches (truncated BPTT: each row's last hidden state kept in an
``nnx.Variable`` of shape ``(B, H)`` and read by the next batch), issue #36 trial 12.

Every live FAIL of such a model crashed ("Incompatible types for broadcasting: input type=float32[8,16] and
requested type=float32[4,16]"): the harness's per-shard reruns ran a shard of the batch against the whole carry.
They now cut the per-row state with the batch where the model does not run with it whole
(``task.shards_with_state``). And the reruns read the carry after the reference's step (the Variables are written
in place), so a loss divided by each shard's own count was not named ``normalization``; they now read the values
before it. The same per-shard evaluation finds a loss that couples the rows of a batch (a contrastive loss):
the built-in strategies that compute it per shard are refused with the reason, a GSPMD step checks it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardcheck import Task, check_parity, make_mesh
from shardcheck.parity.harness import row_coupling
from shardcheck.parity.harness.recorded import record_run
from shardcheck.parity.harness.row_coupling import coupled_rows
from shardcheck.task import shards_with_state

B = 8


class Carry(nnx.Variable):
    """Each row's last output, carried into the next batch."""


class Recurrent(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(4, 3, rngs=rngs)
        self.h = Carry(jnp.zeros((B, 3)))

    def __call__(self, x):
        y = jnp.tanh(self.lin(x) + 0.5 * self.h[...])
        self.h[...] = jax.lax.stop_gradient(y)
        return y


def per_row(model, batch):
    return jnp.sum((model(batch["x"]) - batch["y"]) ** 2, axis=-1) * batch["mask"]


def loss_fn(model, batch):
    return jnp.sum(per_row(model, batch)), jnp.sum(batch["mask"])


def _batches():
    rng = np.random.default_rng(0)
    mask = np.array([1, 1, 1, 0, 1, 1, 1, 1], np.float32)  # 3 rows in shard 0, 4 in shard 1: unequal counts
    return [
        {
            "x": rng.normal(size=(B, 4)).astype(np.float32),
            "y": rng.normal(size=(B, 3)).astype(np.float32),
            "mask": mask,
        }
        for _ in range(2)
    ]


TASK = Task(
    model=lambda: Recurrent(nnx.Rngs(0)), optimizer=optax.adam(1e-2), loss_fn=loss_fn, batches=_batches()
)


def _step(loss):
    @nnx.jit
    def jitted(model, optimizer, batch):
        value, grads = nnx.value_and_grad(loss)(model, batch)
        optimizer.update(model, grads)
        return value, grads

    def step(model, optimizer, batch, mesh):
        value, grads = jitted(model, optimizer, jax.device_put(batch, NamedSharding(mesh, P("data"))))
        return {"loss": value, "grads": grads}

    return step


def _full(model, batch):
    total, weight = loss_fn(model, batch)
    return total / weight


def _per_shard_means(model, batch):
    """Each of 2 shards divides its loss sum by its own count, then the shards are averaged (C4)."""
    terms = per_row(model, batch).reshape(2, B // 2)
    counts = batch["mask"].reshape(2, B // 2).sum(axis=1)
    return jnp.mean(terms.sum(axis=1) / counts)


def test_shards_with_state_cuts_only_the_per_row_leaves():
    batch = _batches()[0]
    rest = {"h": jnp.arange(B * 3.0).reshape(B, 3), "count": jnp.array(5), "table": jnp.ones((3, 3))}
    for per_row_state, cut in ((False, False), (True, True)):
        xs, at = shards_with_state(batch, rest, 2, per_row_state)
        shard, mine = at(jax.tree.map(lambda a: a[1], xs))
        np.testing.assert_array_equal(shard["x"], batch["x"][4:])
        np.testing.assert_array_equal(mine["h"], rest["h"][4:] if cut else rest["h"])
        assert mine["count"] == 5 and mine["table"].shape == (3, 3)


@require_devices(2)
def test_a_carried_state_model_passes_and_its_per_shard_count_is_named_live_and_replayed():
    mesh = make_mesh(2)
    assert check_parity(_step(_full), TASK, mesh=mesh).ok
    recording = record_run(TASK, _step(_full), mesh=mesh, name="full")
    for reference in (None, recording):
        report = check_parity(_step(_per_shard_means), TASK, mesh=mesh, reference=reference, name="full")
        assert not report.ok and "normalization" in report.codes, str(report)
        assert "mean of per-shard means" in report.diagnosis


def clip_loss(model, batch):
    """A contrastive loss over the whole batch: every row's image against every row's text."""
    a, b = model.img(batch["x"]), model.txt(batch["y"])
    a = a / jnp.linalg.norm(a, axis=-1, keepdims=True)
    b = b / jnp.linalg.norm(b, axis=-1, keepdims=True)
    logits = 4.0 * a @ b.T
    labels = jnp.arange(a.shape[0])
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class Towers(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.img = nnx.Linear(4, 5, rngs=rngs)
        self.txt = nnx.Linear(3, 5, rngs=rngs)


CLIP = Task(
    model=lambda: Towers(nnx.Rngs(0)),
    optimizer=optax.adam(1e-2),
    loss_fn=clip_loss,
    batches=[{k: v for k, v in b.items() if k != "mask"} for b in _batches()],
)


def test_coupled_rows_finds_a_contrastive_loss_and_no_sum_over_rows():
    batch = CLIP.batches[0]
    coupling = coupled_rows(clip_loss, CLIP.new_model(), batch, 2)
    assert abs(coupling.full - coupling.combined) > 0.01 * abs(coupling.full)
    assert coupled_rows(loss_fn, Recurrent(nnx.Rngs(0)), _batches()[0], 2) is None  # a sum over rows
    assert coupled_rows(clip_loss, CLIP.new_model(), batch, 3) is None  # 8 rows: no 3 equal shards


@require_devices(2)
@pytest.mark.parametrize("strategy", ["simulation", "dp", "fsdp", "accumulation"])
def test_a_loss_that_couples_rows_is_refused_per_shard_and_checked_under_gspmd(strategy):
    with pytest.raises(
        ValueError, match=rf"^{strategy}: cannot compute this task's loss: .* couples the rows"
    ):
        check_parity(strategy, CLIP, num_shards=2)
    assert check_parity("gspmd", CLIP, mesh=make_mesh(2)).ok


class BfTowers(nnx.Module):
    """Two bfloat16 towers and a learnable temperature (a 0-D parameter), as CLIP writes them."""

    def __init__(self, rngs: nnx.Rngs):
        self.img = nnx.Linear(4, 5, dtype=jnp.bfloat16, rngs=rngs)
        self.txt = nnx.Linear(3, 5, dtype=jnp.bfloat16, rngs=rngs)
        self.log_t = nnx.Param(jnp.asarray(1.5, jnp.float32))


def bf_clip_loss(model, batch):
    a = model.img(batch["x"]).astype(jnp.float32)
    b = model.txt(batch["y"]).astype(jnp.float32)
    a = a / jnp.linalg.norm(a, axis=-1, keepdims=True)
    b = b / jnp.linalg.norm(b, axis=-1, keepdims=True)
    logits = jnp.exp(model.log_t[...]) * a @ b.T
    labels = jnp.arange(a.shape[0])
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _adamw(decay_temperature: bool):
    def mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda p, _: decay_temperature or "log_t" not in jax.tree_util.keystr(p), params
        )

    return optax.adamw(5e-3, weight_decay=0.1, mask=mask)


BF_CLIP = Task(
    model=lambda: BfTowers(nnx.Rngs(0)), optimizer=_adamw(False), loss_fn=bf_clip_loss, batches=CLIP.batches
)


@require_devices(2)
def test_a_bf16_contrastive_loss_is_held_to_a_tolerance_of_the_full_batch():
    """Trial 13: at bfloat16 compute the gradient tolerance took the loss run per shard as a correct split; for a
    contrastive loss that is the local-negatives loss, 4x wider than the fault it hid, so a temperature decayed
    by a wrong mask PASSed live; here the correct step was CANNOT VERIFY ("5 leaves have a gradient at rounding
    level"). The split is the full batch where the loss couples the rows: the fault FAILs at step 0, on the
    temperature, and the correct step PASSes."""
    from shardcheck.steps import Candidate

    mesh = make_mesh(2)
    good = _step(bf_clip_loss)
    assert check_parity(good, BF_CLIP, mesh=mesh).ok

    def decayed(model, optimizer):
        return nnx.Optimizer(model, _adamw(True), wrt=nnx.Param)

    wrong = Candidate("decayed", good, make_optimizer=decayed, pass_mesh=True)
    report = check_parity(wrong, BF_CLIP, mesh=mesh)
    assert not report.ok and report.localization.step == 0, str(report)
    assert report.localization.group.startswith("every failing leaf is 0-D (log_t)"), (
        report.localization.group
    )


CARRY_TASK_FILE = """
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
import shardcheck

class Carry(nnx.Variable):
    pass

class Recurrent(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 3, rngs=rngs)
        self.h = Carry(jnp.zeros((8, 3)))

    def __call__(self, x):
        y = jnp.tanh(self.lin(x) + 0.5 * self.h[...])
        self.h[...] = jax.lax.stop_gradient(y)
        return y

def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

rng = np.random.default_rng(0)
task = shardcheck.Task(model=lambda: Recurrent(nnx.Rngs(0)), optimizer=optax.adam(1e-2), loss_fn=loss_fn,
                       batches=[{"x": rng.normal(size=(8, 4)).astype(np.float32),
                                 "y": rng.normal(size=(8, 3)).astype(np.float32)}])
"""


@require_devices(2)
def test_memory_names_the_strategy_whose_step_does_not_compile_for_a_carried_state(tmp_path, capsys):
    """Trial 12: `memory --mesh` on a model with a (B, H) carried state ended in one line, "error: Incompatible
    types for broadcasting ...": now the line names the strategy, the likely cause and the way out, and gspmd
    (the forward pass on the whole batch) sizes it."""
    from shardcheck.cli import main

    path = tmp_path / "carry.py"
    path.write_text(CARRY_TASK_FILE)
    base = ["memory", "--task", f"{path}:task", "--mesh", "data=2"]
    assert main([*base, "--strategy", "fsdp"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "shardcheck memory: the fsdp step does not compile for this task: " in err, err
    assert "a carried hidden state" in err and "--strategy NAME (gspmd runs the forward pass" in err
    assert main([*base, "--strategy", "gspmd"]) == 0


def test_memory_names_itself_in_the_librarys_refusals(tmp_path, capsys):
    """Trial 12: a mesh lacking an annotated axis read 'error: estimate_memory: leaf ...' on the command line."""
    from shardcheck.cli import main

    path = tmp_path / "annotated.py"
    path.write_text(
        "import numpy as np, optax\nfrom flax import nnx\nimport shardcheck\n"
        "init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, 'model'))\n"
        "task = shardcheck.Task(model=lambda: nnx.Linear(4, 4, kernel_init=init, rngs=nnx.Rngs(0)),\n"
        "    optimizer=optax.sgd(0.1), loss_fn=lambda m, b: (m(b['x']) ** 2).mean(),\n"
        "    batches=[{'x': np.ones((4, 4), np.float32)}])\n"
    )
    assert main(["memory", "--task", f"{path}:task", "--mesh", "data=2,tensor=2", "--strategy", "gspmd"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("error: shardcheck memory: leaf 'kernel' is annotated P(None, 'model')"), err
    assert "estimate_memory" not in err


class Routed(nnx.Module):
    """A router and two experts with a load-balancing term over the whole batch's routing (Switch style)."""

    def __init__(self, rngs: nnx.Rngs):
        self.router = nnx.Linear(4, 2, rngs=rngs)
        self.experts = nnx.Linear(4, 6, rngs=rngs)


def routed_loss(model, batch):
    probs = jax.nn.softmax(model.router(batch["x"]), axis=-1)  # (B, 2)
    out = model.experts(batch["x"]).reshape(-1, 2, 3)
    y = jnp.einsum("be,bed->bd", probs, out)
    frac = jnp.mean(jax.nn.one_hot(jnp.argmax(probs, -1), 2), axis=0)  # the batch's routing: couples the rows
    aux = 2 * jnp.sum(frac * jnp.mean(probs, axis=0))
    count = jnp.sum(batch["mask"])
    return jnp.sum(jnp.sum((y - batch["y"]) ** 2, -1) * batch["mask"]) + 0.01 * aux * count, count


ROUTED = Task(
    model=lambda: Routed(nnx.Rngs(1)), optimizer=optax.adam(1e-2), loss_fn=routed_loss, batches=_batches()
)


@require_devices(2)
def test_a_load_balancing_term_over_the_batch_is_found_by_its_gradient():
    """Trial 14: an auxiliary loss of weight 0.01 over the whole batch's routing moves the loss by less than its
    tolerance when computed per shard, but the router's gradient by more: the probe compares the gradients too,
    so the per-shard strategies are refused, naming the router's gradient, and gspmd checks the task."""
    coupling = coupled_rows(
        routed_loss, ROUTED.new_model(), ROUTED.batches[0], 2, terms=ROUTED.terms(_batches()[0])
    )
    assert coupling is not None and coupling.leaf is not None and coupling.leaf.startswith("router.")
    assert coupling.err > coupling.tol > 0
    with pytest.raises(
        ValueError, match=r"^dp: cannot compute this task's loss: .*and the gradient of router\."
    ):
        check_parity("dp", ROUTED, num_shards=2)
    assert check_parity("gspmd", ROUTED, mesh=make_mesh(2)).ok


def _gradient_only_routing_loss(model, batch):
    """A Switch-style term of weight 0.001 over the whole batch's routing (its fraction held by stop_gradient, as
    trial 55 wrote it) whose value is taken out again: the loss is the rows' own, the router's gradient is not."""
    probs = jax.nn.softmax(model.router(batch["x"]), axis=-1)
    out = model.experts(batch["x"]).reshape(-1, 2, 3)
    y = jnp.einsum("be,bed->bd", probs, out)
    frac = jax.lax.stop_gradient(jnp.mean(jax.nn.one_hot(jnp.argmax(probs, -1), 2), axis=0))
    aux = 2 * jnp.sum(frac * jnp.mean(probs, axis=0))
    count = jnp.sum(batch["mask"])
    aux = aux - jax.lax.stop_gradient(aux)  # 0 in value, the coupling in the gradient only
    return jnp.sum(jnp.sum((y - batch["y"]) ** 2, -1) * batch["mask"]) + 0.001 * aux * count, count


@require_devices(2)
def test_a_weak_coupling_seen_in_a_gradient_alone_is_found_below_the_rounding_level_margin():
    """Trial 55: a load-balancing term of weight 0.05 moved the router's kernel gradient by 0.0085 of it, 20.7
    times its tolerance, and the loss within its tolerance: the built-ins FAILed where the README promises a
    REFUSED row (the probe then asked 64 times). A systematic change of a gradient above rounding level (less
    than 5% of it) counts from 8 times its tolerance."""
    task = Task(
        model=lambda: Routed(nnx.Rngs(1)),
        optimizer=optax.adam(1e-2),
        loss_fn=_gradient_only_routing_loss,
        batches=_batches(),
    )
    coupling = coupled_rows(_gradient_only_routing_loss, task.new_model(), task.batches[0], 2, terms=16)
    assert coupling is not None and coupling.full == pytest.approx(coupling.combined, abs=1e-6)
    assert coupling.leaf == "router.kernel"
    assert row_coupling.SYSTEMATIC_MARGIN < coupling.err / coupling.tol < row_coupling.GRADIENT_MARGIN
    with pytest.raises(row_coupling.RowCouplingError, match=r"^dp: .*and the gradient of router\.kernel by "):
        check_parity("dp", task, num_shards=2)
    assert check_parity("gspmd", task, mesh=make_mesh(2)).ok


@pytest.mark.parametrize(
    ("times_tol", "of_gradient", "shows"),
    [
        (20.7, 0.0085, True),  # trial 55's router kernel: systematic, a small part of a large gradient
        (
            3.37,
            0.75,
            False,
        ),  # tiny-lm's attention key bias in bfloat16: noise of a gradient at rounding level
        (20.0, 0.5, False),  # as far beyond, but half the gradient: a rounding-level gradient's noise
        (7.9, 0.001, False),  # systematic, but within SYSTEMATIC_MARGIN of the tolerance
        (65.0, 1.0, True),  # beyond GRADIENT_MARGIN: any gradient
        (float("nan"), 0.0, False),
    ],
)
def test_which_gradient_differences_show_a_coupling(times_tol, of_gradient, shows):
    tol = 1e-5
    gap = times_tol * tol
    magnitude = gap / of_gradient if of_gradient else 1.0
    assert row_coupling._shows_coupling(gap, tol, magnitude) is shows


def _equal_batches():
    return [dict(b, mask=np.ones(B, np.float32)) for b in _batches()]


EQUAL = Task(
    model=lambda: Routed(nnx.Rngs(1)),
    optimizer=optax.adam(1e-2),
    loss_fn=routed_loss,
    batches=_equal_batches(),
)


def _routing_per_shard(model, batch):
    """The task's loss with its load-balancing term taken over each of 2 shards' rows (trial 14's fault)."""
    halves = [jax.tree.map(lambda a, i=i: a[i * B // 2 : (i + 1) * B // 2], batch) for i in range(2)]
    parts = [routed_loss(model, h) for h in halves]
    return sum(p[0] for p in parts) / sum(p[1] for p in parts)


@require_devices(2)
def test_a_term_computed_per_shard_with_equal_counts_is_not_called_a_normalization():
    """Trial 14: a load-balancing loss over each shard's routing, the shards holding 53 and 53 tokens, read
    'normalization ... each shard divided its loss sum by its own weight (token count)': false, the counts were
    psum-ed and equal. Now 'per_shard_loss', live and replayed; a correct step PASSes."""
    mesh = make_mesh(2)

    def full(model, batch):
        total, weight = routed_loss(model, batch)
        return total / weight

    assert check_parity(_step(full), EQUAL, mesh=mesh).ok
    recording = record_run(EQUAL, _step(full), mesh=mesh, name="full")
    for reference in (None, recording):
        report = check_parity(_step(_routing_per_shard), EQUAL, mesh=mesh, reference=reference, name="full")
        assert not report.ok and "per_shard_loss" in report.codes and "normalization" not in report.codes, (
            str(report)
        )
        assert "while the shards carry equal weights, so no normalization differs" in report.diagnosis


def _mean_routed_loss(model, batch):
    """``routed_loss`` as a plain mean (no ``(loss_sum, weight)``): every row weighs 1."""
    total, weight = routed_loss(model, batch)
    return total / weight


def _mean_per_shard(combine):
    """The mean loss with its load-balancing term over each of 2 shards' rows, the shards' means ``combine``-d."""

    def loss(model, batch):
        halves = [jax.tree.map(lambda a, i=i: a[i * B // 2 : (i + 1) * B // 2], batch) for i in range(2)]
        return combine([_mean_routed_loss(model, h) for h in halves])

    return loss


MEAN_ROUTED = Task(
    model=lambda: Routed(nnx.Rngs(1)),
    optimizer=optax.chain(optax.clip_by_global_norm(1e6), optax.adam(1e-2)),  # a clip that never binds
    loss_fn=_mean_routed_loss,
    batches=_equal_batches(),
)


@require_devices(2)
@pytest.mark.parametrize(
    ("combine", "said"),
    [
        (
            lambda parts: sum(parts) / 2,  # the loss it returns shows it first
            "is the task's loss computed over each shard's own rows and combined over 2 shards",
        ),
        (
            sum,
            "the loss computed per shard and combined at 2 x their mean (parameters and optimizer state): the "
            "shards' means were summed (a psum where a pmean was due), not averaged: x2",
        ),
    ],
)
def test_a_term_of_a_mean_loss_computed_per_shard_is_named_not_a_clip_that_never_bound(combine, said):
    """Trial 55: a mean loss (not ``(loss_sum, weight)``) whose load-balancing term was computed per shard read
    'a clip applied per shard (before the all-reduce)', under a clip that bound on no shard; and with the shards'
    losses summed, 'no constant factor'. The per-shard hypothesis was tried for weighted losses only, and the
    clip's for any clip. Now: per_shard_loss, with the sum named where there is one, and no clip."""
    mesh = make_mesh(2)
    assert check_parity(_step(_mean_routed_loss), MEAN_ROUTED, mesh=mesh, steps=1).ok
    report = check_parity(_step(_mean_per_shard(combine)), MEAN_ROUTED, mesh=mesh, steps=1)
    # the summed step returns its loss summed too: 'scaled' leads (the loss at equal parameters is 2x), then this
    assert not report.ok and "per_shard_loss" in report.codes[:2], str(report)
    assert "clip_per_shard" not in report.codes
    assert said in next(d.message for d in report.diagnoses if d.code == "per_shard_loss")
