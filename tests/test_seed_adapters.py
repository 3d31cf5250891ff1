"""The seeds' entrypoints are adapters over the Task engine: on the same regression task they give the engine's
numbers bit for bit (loss, updated parameters, shard losses), strategy by strategy."""

import dataclasses

import numpy as np
import optax
import pytest
from flax import nnx

import shardcheck
from shardcheck import make_model, seeds
from shardcheck.losses import mse_batch_loss
from shardcheck.runner import run_task, to_host


def _bits(a):
    return np.asarray(a).view(np.uint32)


def _assert_bitwise(params, want):
    assert set(params) == set(want)
    for k in want:
        np.testing.assert_array_equal(_bits(params[k]), _bits(want[k]), err_msg=k)


def _data(b, d, k, seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(b, d)).astype(np.float32), rng.normal(size=(b, k)).astype(np.float32)


@pytest.fixture(scope="module", params=[("linear", 2), ("mlp", 4)], ids=["linear-S2", "mlp-S4"])
def engine(request):
    """The engine's run of every registered strategy on one regression task, and what built it."""
    kind, num_shards = request.param
    x, y = _data(16, 3, 2, seed=num_shards)

    def factory():
        return make_model(kind, 3, 2, hidden=8, seed=1)

    task = shardcheck.Task(
        model=factory, optimizer=optax.adam(0.01), loss_fn=mse_batch_loss, batches=[(x, y)]
    )
    names = ["reference", "simulation", "dp", "fsdp", "accumulation"]
    report = run_task(task, num_shards=num_shards, strategies=names)
    return report, factory, x, y, num_shards


def _fresh(factory):
    model = factory()
    return model, nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)


def test_sgd_step_is_the_reference(engine):
    report, factory, x, y, _ = engine
    model, optimizer = _fresh(factory)
    loss = shardcheck.sgd_step(model, optimizer, x, y)
    want = report.outcomes["reference"]
    assert _bits(np.float32(want.loss)) == _bits(loss)
    _assert_bitwise(to_host(nnx.state(model, nnx.Param)), want.params)


@pytest.mark.parametrize("keep", [True, False])
def test_reduced_sgd_step_is_the_simulation(engine, keep):
    report, factory, x, y, num_shards = engine
    model, optimizer = _fresh(factory)
    result = shardcheck.reduced_sgd_step(model, optimizer, x, y, num_shards, keep_shard_grads=keep)
    want = report.outcomes["simulation"]
    assert _bits(np.float32(want.loss)) == _bits(result.loss)
    np.testing.assert_array_equal(_bits(np.float32(want.shard_losses)), _bits(result.shard_losses))
    _assert_bitwise(to_host(nnx.state(model, nnx.Param)), want.params)


@pytest.mark.parametrize("name", ["dp", "fsdp"])
def test_mesh_steps_are_the_registered_mesh_strategies(engine, name):
    report, factory, x, y, num_shards = engine
    model, optimizer = _fresh(factory)
    step = shardcheck.data_parallel_sgd_step if name == "dp" else seeds.fsdp_sgd_step
    loss = step(model, optimizer, x, y, shardcheck.make_mesh(num_shards))
    want = report.outcomes[name]
    assert _bits(np.float32(want.loss)) == _bits(loss)
    _assert_bitwise(to_host(nnx.state(model, nnx.Param)), want.params)


def test_accumulated_sgd_step_is_the_accumulation(engine):
    report, factory, x, y, num_shards = engine
    model = factory()
    optimizer = shardcheck.make_accumulation_optimizer(model, optax.adam(0.01), num_shards)
    loss = shardcheck.accumulated_sgd_step(model, optimizer, x, y, num_shards)
    want = report.outcomes["accumulation"]
    assert _bits(np.float32(want.loss)) == _bits(loss)
    _assert_bitwise(to_host(nnx.state(model, nnx.Param)), want.params)


@pytest.mark.parametrize("num_shards", [1, 2, 4])
@pytest.mark.parametrize("lr", [0.1, 3.0])
def test_seed_entrypoints_are_the_reference_and_the_simulation(num_shards, lr):
    """fsdp_step (seed 001) and simulated_data_parallel_step (seed 000) on a fresh nnx.Linear(D, K)."""
    x, y = _data(8, 3, 2, seed=7)
    task = shardcheck.Task(
        model=lambda: nnx.Linear(3, 2, rngs=nnx.Rngs(5)),
        optimizer=optax.sgd(lr),
        loss_fn=mse_batch_loss,
        batches=[(x, y)],
    )
    report = run_task(task, num_shards=num_shards, strategies=["reference", "simulation"])
    ref = shardcheck.fsdp_step(x, y, num_shards, lr, seed=5)
    sim = shardcheck.simulated_data_parallel_step(x, y, num_shards, lr, seed=5)
    assert _bits(ref) == _bits(np.float32(report.outcomes["reference"].loss))
    assert _bits(sim) == _bits(np.float32(report.outcomes["simulation"].loss))


def test_run_strategies_is_run_task_on_the_seed_task():
    from shardcheck.seeds import run_strategies

    x, y = _data(8, 3, 2, seed=9)
    seed_report = run_strategies(x, y, num_shards=4, lr=0.5, seed=3)
    task = shardcheck.Task(
        model=lambda: nnx.Linear(3, 2, rngs=nnx.Rngs(3)),
        optimizer=optax.sgd(0.5),
        loss_fn=mse_batch_loss,
        batches=[(x, y)],
    )
    report = run_task(task, num_shards=4, strategies=["reference", "simulation", "dp", "fsdp"])
    assert tuple(seed_report.outcomes) == ("baseline", "simulation", "dp", "fsdp")
    for name, outcome in seed_report.outcomes.items():
        want = report.outcomes["reference" if name == "baseline" else name]
        assert _bits(np.float32(outcome.loss)) == _bits(np.float32(want.loss))
        _assert_bitwise(outcome.params, want.params)
        assert outcome.shard_losses == want.shard_losses
        assert outcome.max_abs_grad_diff == want.max_abs_grad_diff


def test_old_module_paths_are_aliases():
    from shardcheck import accumulation, baseline, reductions, simulation, spmd

    # each old path warns (tests/test_deprecations.py pins the text) and gives the canonical object
    with pytest.warns(DeprecationWarning):
        _assert_old_module_paths_are_aliases(accumulation, baseline, reductions, simulation, spmd)


def _assert_old_module_paths_are_aliases(accumulation, baseline, reductions, simulation, spmd):
    assert baseline.sgd_step is seeds.sgd_step and baseline.fsdp_step is seeds.fsdp_step
    assert simulation.reduced_sgd_step is seeds.reduced_sgd_step
    assert simulation.simulated_data_parallel_step is seeds.simulated_data_parallel_step
    assert (
        spmd.data_parallel_sgd_step is seeds.data_parallel_sgd_step
        and spmd.fsdp_sgd_step is seeds.fsdp_sgd_step
    )
    assert accumulation.accumulated_sgd_step is seeds.accumulated_sgd_step
    assert reductions.tree_mean is seeds.tree_mean and reductions.tree_sum is seeds.tree_sum
    assert shardcheck.sgd_step is seeds.sgd_step


def test_weighted_reduced_sgd_step_is_the_simulation_of_the_weighted_task():
    """C5: 0/1 masks, S=2 shards of 4 rows; the engine's simulation of (x, y, w) batches gives the same bits."""
    from shardcheck.losses import regression_batch_loss

    x, y = np.ones((8, 2), np.float32), np.arange(1, 9, dtype=np.float32)[:, None]
    w = np.array([1, 0, 0, 0, 1, 1, 1, 0], np.float32)

    def factory():
        return nnx.Linear(2, 1, kernel_init=nnx.initializers.zeros, rngs=nnx.Rngs(0))

    task = shardcheck.Task(
        model=factory, optimizer=optax.sgd(0.1), loss_fn=regression_batch_loss, batches=[(x, y, w)]
    )
    want = run_task(task, num_shards=2, strategies=["simulation"]).outcomes["simulation"]
    model = factory()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    result = shardcheck.reduced_sgd_step(model, optimizer, x, y, 2, weights=w)
    assert _bits(np.float32(want.loss)) == _bits(result.loss)
    np.testing.assert_array_equal(_bits(np.float32(want.shard_losses)), _bits(result.shard_losses))
    _assert_bitwise(to_host(nnx.state(model, nnx.Param)), want.params)
    np.testing.assert_allclose(result.loss, (1 + 25 + 36 + 49) / 4)  # the masked mean of y**2 (zero model)


class _DropoutNet(nnx.Module):
    """A Linear then a Dropout holding an RNG stream: deterministic at rate 0, drawing a mask otherwise."""

    def __init__(self, rate):
        self.lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        self.drop = nnx.Dropout(rate, rngs=nnx.Rngs(dropout=1))

    def __call__(self, x):
        return self.drop(self.lin(x))


def test_one_admission_rule_for_the_adapters_and_the_engine():
    """Dropout(0.0) is admitted by the seeds' steps and the engine alike (and they agree bitwise); Dropout(0.5),
    which draws a mask in its forward pass, is refused by the seeds' steps and by the engine's dp (each shard draws
    with the same key) for the same stream, each naming the GSPMD step that works; the engine runs its reference."""
    x, y = _data(8, 3, 2, seed=11)
    task = shardcheck.Task(
        model=lambda: _DropoutNet(0.0), optimizer=optax.sgd(0.1), loss_fn=mse_batch_loss, batches=[(x, y)]
    )
    report = run_task(task, num_shards=2, strategies=["reference", "dp", "fsdp"])
    steps = {
        "reference": shardcheck.sgd_step,
        "dp": lambda m, o, x, y: shardcheck.data_parallel_sgd_step(m, o, x, y, shardcheck.make_mesh(2)),
        "fsdp": lambda m, o, x, y: seeds.fsdp_sgd_step(m, o, x, y, shardcheck.make_mesh(2)),
    }
    for name, step in steps.items():
        model = _DropoutNet(0.0)
        loss = step(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), x, y)
        assert _bits(loss) == _bits(np.float32(report.outcomes[name].loss)), name
        _assert_bitwise(to_host(nnx.state(model, nnx.Param)), report.outcomes[name].params)

    drawing = dataclasses.replace(task, model=lambda: _DropoutNet(0.5))
    assert set(run_task(drawing, num_shards=2, strategies=["reference"]).outcomes) == {"reference"}
    reason = (
        r"model _DropoutNet draws random numbers in its forward pass \(RNG stream\(s\) drop\.rngs\), and "
    )
    with pytest.raises(ValueError, match=f"^dp: cannot run this model: {reason}dp runs") as engine_err:
        run_task(drawing, num_shards=2, strategies=["dp"])
    model = _DropoutNet(0.5)
    with pytest.raises(ValueError, match=f"^sgd_step: {reason}the sharded steps run") as adapter_err:
        shardcheck.sgd_step(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), x, y)
    advice = "Check it with a GSPMD step (strategy gspmd"
    assert advice in str(engine_err.value) and advice in str(adapter_err.value)


def test_train_is_train_task_on_the_regression_task():
    """The seeds' train(x, y) is the engine's train_task on its regression task: the split standardized, epoch 1's
    shuffled batches, each later epoch's drawn from the same shuffle, both splits evaluated; the same bits."""
    import itertools

    from shardcheck.datasets import minibatch_indices
    from shardcheck.seeds.training import split_and_standardize, train
    from shardcheck.training import train_task

    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(50, 3)), rng.normal(size=(50, 2))
    events = []
    report = train(
        x, y, strategy="simulation", num_shards=2, model="mlp", hidden=8, optimizer="adam", lr=0.01, epochs=3,
        batch_size=8, test_fraction=0.2, seed=2, callback=events.append,
    )  # fmt: skip
    x_tr, y_tr, x_te, y_te = split_and_standardize(x, y, 0.2, seed=2)
    draws = minibatch_indices(40, 8, seed=2)
    epochs = [[(x_tr[i], y_tr[i]) for _, i in itertools.islice(draws, 5)] for _ in range(3)]
    task = shardcheck.Task(
        model=lambda: make_model("mlp", 3, 2, hidden=8, seed=2),
        optimizer=optax.adam(0.01),
        loss_fn=mse_batch_loss,
        batches=epochs[0],
        reduction_size=8 * 2,
    )
    want = train_task(
        task, "simulation", num_shards=2, epochs=3, epoch_batches=lambda e: epochs[e - 1],
        evaluate={"train": (x_tr, y_tr), "test": (x_te, y_te)},
    )  # fmt: skip
    assert (report.num_train, report.num_test, report.steps_per_epoch, report.num_steps) == (40, 10, 5, 15)
    assert report.steps == want.steps  # every loss, drift and tolerance, float for float
    assert len(report.epoch_records) == len(want.evaluations) == 4
    for record, evaluation in zip(report.epoch_records, want.evaluations, strict=True):
        assert (record.epoch, record.step) == (evaluation.epoch, evaluation.step)
        assert (record.train_loss_baseline, record.train_loss_sharded) == evaluation.loss("train")
        assert (record.test_loss_baseline, record.test_loss_sharded) == evaluation.loss("test")
    assert [e.epoch_end for e in events if e.epoch_end is not None] == list(report.epoch_records[1:])
    assert report.tolerance_rule == want.tolerance_rule


def test_train_keeps_its_old_paths():
    from shardcheck import training

    with pytest.warns(DeprecationWarning, match="shardcheck.training.train is deprecated"):
        assert training.train is seeds.training.train is shardcheck.train
    with pytest.warns(DeprecationWarning, match="shardcheck.training.TrainReport is deprecated"):
        assert training.TrainReport is seeds.training.TrainReport is shardcheck.TrainReport
    with pytest.warns(DeprecationWarning, match="use shardcheck.seeds.training.select_features"):
        assert training.select_features is seeds.training.select_features
    with pytest.raises(AttributeError, match="module 'shardcheck.training' has no attribute 'trian'"):
        training.trian  # noqa: B018
