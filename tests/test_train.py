"""The lock-step training loop (shardcheck.training.train_task), the seeds' train() over it
(shardcheck.seeds.training) and the figure of train() (shardcheck.plots)."""

import dataclasses
import itertools
import math
import os

import jax
import matplotlib.image
import numpy as np
import pytest
from conftest import require_devices
from flax import nnx

from shardcheck import datasets
from shardcheck import training as train_lib
from shardcheck.datasets import minibatch_indices
from shardcheck.optimizers import DEFAULT_LR
from shardcheck.plots import plot_training
from shardcheck.seeds.training import TrainReport, select_features, split_and_standardize, train
from shardcheck.steps import STRATEGIES, Candidate
from shardcheck.steps import reference as reference_lib
from shardcheck.steps.reference import reference_step
from shardcheck.tasks import digits_task, tiny_lm_task
from shardcheck.training import TRAIN_STRATEGIES, train_task


@pytest.fixture(scope="module")
def diabetes():
    return datasets.load_dataset("diabetes", standardize_data=False)


def write_csv(path, x, y, names):
    rows = [",".join(names)] + [",".join(f"{v:.6f}" for v in row) for row in np.hstack([x, y])]
    path.write_text("\n".join(rows) + "\n")


def assert_lockstep_agrees(report: TrainReport):
    """Both loss curves agree within the step's tolerance at every step; the drift never exceeds its own."""
    for s in report.steps:
        assert abs(s.loss_sharded - s.loss_baseline) <= s.loss_tolerance, s
        assert s.held_param_diff <= s.drift_tolerance, s
    assert report.loss_curves_agree and report.first_exceeded_step is None
    # epoch-end evaluations: both runs on the same splits
    for r in report.epoch_records:
        assert r.train_loss_sharded == pytest.approx(r.train_loss_baseline, rel=1e-5)
        assert r.test_loss_sharded == pytest.approx(r.test_loss_baseline, rel=1e-5)


@pytest.mark.parametrize(
    "strategy,optimizer,num_shards",
    [
        ("simulation", "sgd", 2),
        pytest.param("dp", "momentum", 4, marks=require_devices(4)),
        pytest.param("fsdp", "adam", 4, marks=require_devices(4)),
    ],
)
def test_diabetes_lockstep_agrees_and_learns(diabetes, strategy, optimizer, num_shards):
    report = train(
        diabetes.x,
        diabetes.y,
        strategy=strategy,
        num_shards=num_shards,
        optimizer=optimizer,
        epochs=4,
        batch_size=64,
        name="diabetes",
    )
    # 442 rows, test_fraction 0.2: ceil(88.4) = 89 test rows, 353 train; 353 // 64 = 5 steps, 33 rows dropped
    assert (report.num_train, report.num_test) == (353, 89)
    assert (report.steps_per_epoch, report.dropped_per_epoch, report.num_steps) == (5, 33, 20)
    assert [s.step for s in report.steps] == list(range(1, 21))
    assert [s.epoch for s in report.steps] == [e for e in range(1, 5) for _ in range(5)]
    assert [r.epoch for r in report.epoch_records] == [0, 1, 2, 3, 4]
    assert [r.step for r in report.epoch_records] == [0, 5, 10, 15, 20]
    # identical initial state: bitwise-equal losses at initialization and on the first batch
    init = report.initial
    assert init.train_loss_sharded == init.train_loss_baseline
    assert init.test_loss_sharded == init.test_loss_baseline
    assert report.steps[0].loss_sharded == pytest.approx(report.steps[0].loss_baseline, rel=1e-6)
    assert_lockstep_agrees(report)
    assert report.max_abs_param_diff < 1e-5
    # training helps on held-out data
    assert report.final.test_loss_baseline < 0.5 * init.test_loss_baseline
    assert report.final.test_loss_sharded < 0.5 * init.test_loss_sharded


def test_csv_mlp_two_targets_learns(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 3))
    y = np.stack([np.sin(x[:, 0]) + x[:, 1], x[:, 2] ** 2 - x[:, 0]], axis=1) + 0.05 * rng.normal(
        size=(120, 2)
    )
    path = tmp_path / "made.csv"
    write_csv(path, x, y, ["a", "b", "c", "t1", "t2"])
    data = datasets.load_dataset(str(path), target="t1,t2", standardize_data=False)
    report = train(
        data.x,
        data.y,
        strategy="simulation",
        num_shards=4,
        model="mlp",
        hidden=16,
        optimizer="adam",
        lr=0.03,
        epochs=15,
        batch_size=16,
        test_fraction=0.25,
        seed=1,
        name=data.name,
    )
    assert (report.in_features, report.out_features, report.num_train, report.num_test) == (3, 2, 90, 30)
    assert report.num_steps == 15 * (90 // 16)
    assert_lockstep_agrees(report)
    assert report.final.test_loss_baseline < 0.5 * report.initial.test_loss_baseline


def test_minibatches_reshuffled_each_epoch_and_last_partial_dropped():
    batches = list(itertools.islice(minibatch_indices(10, 4, seed=5), 6))
    assert [e for e, _ in batches] == [1, 1, 2, 2, 3, 3]
    assert all(idx.shape == (4,) for _, idx in batches)
    for epoch in (1, 2, 3):
        rows = np.concatenate([idx for e, idx in batches if e == epoch])
        assert len(set(rows.tolist())) == 8  # no row twice in an epoch; 10 % 4 = 2 rows dropped
    orders = [np.concatenate([idx for e, idx in batches if e == epoch]) for epoch in (1, 2, 3)]
    assert not np.array_equal(orders[0], orders[1])
    # reproducible: the same seed draws the same permutations (np.random.default_rng)
    rng = np.random.default_rng(5)
    np.testing.assert_array_equal(orders[0], rng.permutation(10)[:8])
    again = list(itertools.islice(minibatch_indices(10, 4, seed=5), 6))
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(batches, again, strict=True))


def test_split_standardizes_with_training_statistics():
    rng = np.random.default_rng(2)
    x = rng.normal(3.0, 5.0, size=(50, 2))
    y = rng.normal(-1.0, 0.1, size=(50, 1))
    x_tr, y_tr, x_te, y_te = split_and_standardize(x, y, 0.3, seed=0)
    assert (x_tr.shape, x_te.shape, y_tr.shape, y_te.shape) == ((35, 2), (15, 2), (35, 1), (15, 1))
    assert x_tr.dtype == np.float32
    np.testing.assert_allclose(x_tr.mean(axis=0), 0.0, atol=1e-6)
    np.testing.assert_allclose(x_tr.std(axis=0), 1.0, rtol=1e-5)
    np.testing.assert_allclose(y_tr.mean(axis=0), 0.0, atol=1e-5)
    # the test split is scaled with the training statistics, so it is not exactly centred
    assert np.abs(x_te.mean(axis=0)).max() > 1e-3


@require_devices(4)
def test_steps_compile_once_per_run(diabetes, monkeypatch):
    """All batches share one shape (the last partial one is dropped): 33 steps, at most one trace of each step.

    Both steps come from the registry: the fsdp step's jitted shard_map (``sharded.compiled_step``) and the
    reference's ``_reference_jit``.

    (Each run builds a fresh optax transformation, which is part of the optimizer's static structure, so a new
    run may trace once more; the steps of one run never do.)
    """
    from shardcheck.steps import sharded

    # Which jitted mesh step each of the run's calls gets, and how many traces it held when first handed out.
    handed_out, first_sizes = [], {}
    cached = sharded.compiled_step

    def recording(*args):
        step = cached(*args)
        first_sizes.setdefault(id(step), (step, step._cache_size()))
        handed_out.append(id(step))
        return step

    monkeypatch.setattr(sharded, "compiled_step", recording)
    sizes = (reference_lib._reference_jit._cache_size(), train_lib._eval_losses._cache_size())
    report = train(diabetes.x, diabetes.y, strategy="fsdp", num_shards=4, epochs=3, batch_size=32)
    assert report.num_steps == 33 and report.dropped_per_epoch == 1
    assert len(handed_out) == 33 and len(first_sizes) == 1, "the run's steps used more than one jitted step"
    ((step, size_before),) = first_sizes.values()
    assert step._cache_size() - size_before <= 1
    assert reference_lib._reference_jit._cache_size() - sizes[0] <= 1
    assert train_lib._eval_losses._cache_size() - sizes[1] <= 1


def _faulty_simulation(monkeypatch, at_step: int = 4):
    """Register, for this test only, a "simulation" whose ``at_step``-th update leaves a bias 1e-3 off."""

    def build(loss_fn, num_shards, mesh):
        calls = {"n": 0}

        def step(model, optimizer, batch):
            out = reference_step(loss_fn, model, optimizer, batch)
            calls["n"] += 1
            if calls["n"] == at_step:  # e.g. a step counter off by one in a schedule: one update 1e-3 off
                leaves, treedef = jax.tree.flatten(nnx.state(model, nnx.Param))
                leaves[0] = leaves[0] + 1e-3  # the first bias (Linear: "bias"; MLP: the first layer's)
                nnx.update(model, jax.tree.unflatten(treedef, leaves))
            return out

        return Candidate("simulation", step, num_shards)

    faulty = dataclasses.replace(STRATEGIES["simulation"], build=build)
    monkeypatch.setitem(STRATEGIES, "simulation", faulty)


def test_drift_that_starts_late_is_caught(diabetes, monkeypatch):
    """A sharded step that goes wrong at its 4th update: drift exceeds the tolerance first at step 4."""
    _faulty_simulation(monkeypatch)
    report = train(diabetes.x, diabetes.y, strategy="simulation", optimizer="sgd", epochs=2, batch_size=64)
    assert report.first_exceeded_step == 4
    assert [s.drift_exceeded for s in report.steps[:4]] == [False, False, False, True]
    assert report.max_abs_param_diff == pytest.approx(1e-3, rel=0.2)
    assert all(s.loss_agrees for s in report.steps[:4])  # step 4's loss is measured before its update
    assert not report.loss_curves_agree  # later batches see the shifted bias


def test_tolerance_rule_values():
    eps = float(np.finfo(np.float32).eps)
    tol = train_lib.step_tolerance(64, 1, 1)
    assert tol.atol == pytest.approx(eps * 8) and tol.rtol == pytest.approx(16 * eps * 8)
    assert train_lib.step_tolerance(64, 1, 4).atol == pytest.approx(2 * tol.atol)  # grows like sqrt(t)
    assert train_lib.step_tolerance(16, 4, 1).atol == pytest.approx(tol.atol)  # depends on B*K


def test_callback_sees_every_step_and_epoch_end(diabetes):
    events = []
    report = train(
        diabetes.x, diabetes.y, strategy="simulation", epochs=2, batch_size=128, callback=events.append
    )
    assert [e.step.step for e in events] == [1, 2, 3, 4]
    assert {e.total_steps for e in events} == {4} and {e.epochs for e in events} == {2}
    assert [e.epoch_end.epoch if e.epoch_end else None for e in events] == [None, 1, None, 2]
    assert events[-1].epoch_end == report.final


def test_plot_is_a_png_of_the_expected_size(diabetes, tmp_path):
    report = train(diabetes.x, diabetes.y, strategy="simulation", epochs=2, batch_size=64, name="diabetes")
    path = plot_training(report, tmp_path / "figs" / "loss.png")
    image = matplotlib.image.imread(path)
    assert image.shape == (500, 1300, 4)  # 13 x 5 inches at 100 dpi, RGBA
    assert image[..., :3].std() > 0.05  # not blank
    assert sorted(p.name for p in path.parent.iterdir()) == ["loss.png"]  # no temp file left
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as open() would create it, not mkstemp's 0600
    with pytest.raises(ValueError, match=r"plot_training: path .*loss\.jpg.* must end in \.png"):
        plot_training(report, tmp_path / "loss.jpg")
    assert not (tmp_path / "loss.jpg").exists()


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        (
            dict(batch_size=30, num_shards=4),
            r"train: batch_size=30 is not divisible by num_shards=4; equal shards are required \(valid num_shards "
            r"for this batch: 1, 2, 3, 5, 6, 10, 15, 30; or use a batch size that is a multiple of 4, e.g. 24, "
            r"28, 32, 36\)",
        ),
        (dict(batch_size=400), r"train: the training split has 353 rows .* fewer than batch_size=400"),
        (dict(test_fraction=1.0), r"train: test_fraction=1.0 must be a number in \(0, 1\)"),
        (dict(strategy="zero"), r"train: strategy='zero' is unknown; use one of simulation, dp, fsdp"),
        (dict(optimizer="lion"), r"train: optimizer='lion' is unknown; use one of sgd, momentum, adam"),
        (dict(epochs=0), r"train: epochs must be a positive int, got 0"),
        (dict(lr=-1.0), r"train: lr must be a finite positive number, got -1.0"),
        (dict(strategy="dp", num_shards=64), r"train: strategy='dp' with S=64 needs 64 devices"),
    ],
)
def test_bad_arguments_raise_before_any_step(diabetes, kwargs, msg):
    calls = []
    with pytest.raises(ValueError, match=msg):
        train(diabetes.x, diabetes.y, **{"strategy": "simulation", **kwargs}, callback=calls.append)
    assert calls == []


def test_bad_data_raises():
    x = np.ones((20, 2))
    x[3, 1] = np.nan
    with pytest.raises(ValueError, match="train: x holds NaN or inf"):
        train(x, np.ones(20), strategy="simulation", batch_size=4)
    with pytest.raises(ValueError, match=r"train: x must be \(N, D\)"):
        train(np.ones((20, 2)), np.ones(19), strategy="simulation", batch_size=4)


def test_select_features(tmp_path):
    path = tmp_path / "d.csv"
    write_csv(path, np.arange(12.0).reshape(4, 3), np.ones((4, 1)), ["a", "b", "c", "y"])
    data = datasets.load_dataset(str(path), target="y", standardize_data=False)
    chosen = select_features(data, "c,a")
    assert chosen.feature_names == ("c", "a")
    np.testing.assert_array_equal(chosen.x, data.x[:, [2, 0]])
    assert select_features(data, None) is data
    with pytest.raises(
        ValueError, match=r"train: column\(s\) \['y'\] are listed as features but are also target"
    ):
        select_features(data, "a,y")
    with pytest.raises(ValueError, match=r"unknown feature column\(s\) \['z'\].*\['a', 'b', 'c'\]"):
        select_features(data, "a,z")
    with pytest.raises(ValueError, match=r"feature column\(s\) \['a'\] listed twice"):
        select_features(data, ["a", "a"])
    with pytest.raises(ValueError, match="names no column"):
        select_features(data, "")


def test_report_fields_are_frozen(diabetes):
    report = train(diabetes.x, diabetes.y, strategy="simulation", epochs=1, batch_size=64)
    with pytest.raises(AttributeError):
        report.lr = 1.0  # type: ignore[misc]
    assert math.isclose(report.lr, DEFAULT_LR["adam"]) and report.strategy == "simulation"
    assert report.num_shards == train_lib.DEFAULT_NUM_SHARDS["simulation"] == 2


def test_strategy_names_come_from_the_registry():
    assert TRAIN_STRATEGIES == tuple(n for n in STRATEGIES if n != "reference")
    assert {"simulation", "dp", "fsdp", "accumulation"} <= set(TRAIN_STRATEGIES)
    assert train_lib.DEFAULT_NUM_SHARDS == {n: 4 if s.uses_mesh else 2 for n, s in STRATEGIES.items()}


def test_accumulation_trains_beside_the_reference(diabetes):
    """A registry strategy the old loop never had: S = 4 micro-batches through optax.MultiSteps."""
    report = train(
        diabetes.x, diabetes.y, strategy="accumulation", num_shards=4, optimizer="momentum", epochs=2
    )
    assert report.strategy == "accumulation" and report.num_steps == 10
    assert_lockstep_agrees(report)
    assert report.max_abs_param_diff < 1e-5


# ------------------------------------------------------------------------------------------ train_task


@pytest.fixture(scope="module")
def lm_task():
    """One tiny-lm task for the module: its optax transformation is part of the jitted steps' static key."""
    return tiny_lm_task(steps=3)


def assert_task_lockstep(report, num_steps: int):
    assert report.num_steps == num_steps and [s.step for s in report.steps] == list(range(1, num_steps + 1))
    for s in report.steps:
        assert abs(s.loss_sharded - s.loss_baseline) <= s.loss_tolerance, s
        assert s.drift_within and not s.drift_exceeded, s
        assert s.held_param_diff <= s.drift_tolerance, s
    assert report.loss_curves_agree and report.first_exceeded_step is None


@require_devices(4)
@pytest.mark.parametrize("strategy,placement", [("dp", "replicated"), ("fsdp", "fsdp")])
def test_train_task_tiny_lm_agrees_at_every_step(lm_task, strategy, placement):
    events = []
    report = train_task(lm_task, strategy, num_shards=4, callback=events.append)
    assert (report.task, report.strategy, report.num_shards, report.placement) == (
        "tiny-lm",
        strategy,
        4,
        placement,
    )
    assert (report.epochs, report.steps_per_epoch, report.batch_size) == (1, 3, 16)
    assert_task_lockstep(report, 3)
    first = report.first_step
    assert first.loss_sharded == pytest.approx(first.loss_baseline, rel=1e-6)
    assert 4.0 < first.loss_baseline < 5.5  # about log(77) = 4.34 at initialization
    assert report.last_step.loss_baseline < first.loss_baseline  # Adam learns
    # the loss tolerance is the parity rule with n = B*T = 16*32 reduced terms
    eps = float(np.finfo(np.float32).eps)
    assert first.loss_tolerance == pytest.approx(eps * math.sqrt(512) * (1 + 16 * first.loss_baseline))
    assert [e.step for e in events] == list(report.steps) and {e.total_steps for e in events} == {3}


@require_devices(4)
def test_train_task_adam_noise_on_a_zero_gradient_is_left_out_and_counted(lm_task):
    """The key biases' gradients are 0 up to rounding; Adam turns that noise into updates of ~lr * 0.2, differently
    in the two runs, and compounds them over the steps (trial 52: a bias before a BatchNorm drifted past the
    accumulated sensitivity at step 2 of a correct GSPMD run). Those elements are left out of the verdict and
    counted; every other element is held to a tolerance the noise no longer widens."""
    report = train_task(lm_task, "dp", num_shards=4)
    plain = train_lib.step_tolerance(16 * 32, 3, 1)
    assert report.max_abs_param_diff > 10 * (
        plain.atol + plain.rtol * 2.0
    )  # the noise: far above the rule ...
    last = report.last_step
    assert last.rounding_level_elements >= 2 * 32  # ... in elements that include both layers' key biases,
    assert not report.first_exceeded_step  # left out; the others held to a tolerance below lr
    lr = DEFAULT_LR["adam"]
    assert (
        max(s.held_param_diff for s in report.steps)
        <= last.drift_tolerance
        < lr
        < report.max_abs_param_diff * 10
    )


def test_train_task_digits_accumulation_over_two_epochs():
    task = digits_task(steps=4)
    report = train_task(task, "accumulation", num_shards=4, epochs=2)
    assert (report.placement, report.steps_per_epoch, report.batch_size) == ("single", 4, 64)
    assert [s.epoch for s in report.steps] == [1, 1, 1, 1, 2, 2, 2, 2]
    assert_task_lockstep(report, 8)
    assert report.max_abs_param_diff < 1e-6
    # epoch 2 sees the same 4 batches again, from trained parameters: lower losses
    assert report.steps[4].loss_baseline < report.steps[0].loss_baseline


def test_train_task_catches_a_late_drift(monkeypatch):
    """A planted fault at the 3rd update (digits, sgd): flagged exactly there, not before."""
    _faulty_simulation(monkeypatch, at_step=3)
    report = train_task(digits_task(steps=4, optimizer="sgd"), "simulation", num_shards=2)
    assert report.first_exceeded_step == 3
    assert [s.drift_exceeded for s in report.steps] == [False, False, True, True]
    assert report.max_abs_param_diff == pytest.approx(1e-3, rel=0.2)


@pytest.mark.parametrize(
    "kwargs,error,msg",
    [
        (
            dict(strategy="reference"),
            ValueError,
            r"train_task: strategy='reference' is unknown; use one of simul",
        ),
        (dict(strategy="zero"), ValueError, r"train_task: strategy='zero' is unknown"),
        (dict(num_shards=0), ValueError, r"train_task: num_shards must be a positive int, got 0"),
        (
            dict(num_shards=3),
            ValueError,
            r"train_task: batch size 64 \(batch leaf 'label'\) is not divisible by num_shards=3",
        ),
        (dict(epochs=0), ValueError, r"train_task: epochs must be a positive int, got 0"),
        (
            dict(strategy="dp", num_shards=64),
            ValueError,
            r"train_task: strategy 'dp' with num_shards=64 needs",
        ),
        (dict(callback=1), TypeError, r"train_task: callback must be None or a callable"),
        (
            dict(epoch_batches=[]),
            TypeError,
            r"train_task: epoch_batches must be None or a callable, got list",
        ),
        (dict(evaluate=[1]), TypeError, r"train_task: evaluate must be None or a non-empty dict of named"),
        (
            dict(evaluate={"test": {"x": np.ones(())}}),
            ValueError,
            r"train_task: batch 'test' leaf 'x' is 0-d",
        ),
        (dict(task="digits"), TypeError, r"train_task: task must be a shardcheck.Task, got str"),
    ],
)
def test_train_task_bad_arguments_raise_before_any_step(kwargs, error, msg):
    calls = []
    args = {"task": digits_task(steps=1), "strategy": "simulation", "num_shards": 2, "callback": calls.append}
    args.update(kwargs)
    with pytest.raises(error, match=msg):
        train_task(args.pop("task"), args.pop("strategy"), **args)
    assert calls == []


def _digits_loss(model, batch):
    """The digits task's loss of ``model`` on ``batch``, as a float (the evaluation's reference value)."""
    from shardcheck.task import mean_loss

    return float(mean_loss(digits_task(steps=1).loss_fn, model, batch))


def test_train_task_evaluates_named_batches_at_initialization_and_every_epoch():
    """Held-out batches: both runs' loss on each, at epoch 0 and after each epoch, handed to the callback too."""
    task = digits_task(steps=3, optimizer="sgd")
    held_out = digits_task(steps=2, seed=5).batches
    events = []
    report = train_task(
        task, "simulation", num_shards=2, epochs=2, callback=events.append,
        evaluate={"a": held_out[0], "b": held_out[1]},
    )  # fmt: skip
    assert [(e.epoch, e.step) for e in report.evaluations] == [(0, 0), (1, 3), (2, 6)]
    assert [[name for name, _, _ in e.losses] for e in report.evaluations] == [["a", "b"]] * 3
    first = report.evaluations[0]
    for name, batch in (("a", held_out[0]), ("b", held_out[1])):
        reference, strategy = first.loss(name)
        assert reference == strategy  # one initial state: the same bits
        assert reference == pytest.approx(_digits_loss(task.new_model(), batch), rel=1e-6)
    last = report.evaluations[-1]
    assert last.loss("a")[0] < first.loss("a")[0]  # trained: lower held-out loss
    assert last.loss("a")[1] == pytest.approx(last.loss("a")[0], rel=1e-5)
    assert [e.epoch_end for e in events] == [
        None,
        None,
        report.evaluations[1],
        None,
        None,
        report.evaluations[2],
    ]
    with pytest.raises(
        KeyError, match=r"Evaluation.loss: no evaluation batch 'c'; the batches are \['a', 'b'\]"
    ):
        first.loss("c")
    assert train_task(task, "simulation", num_shards=2).evaluations == ()


def test_train_task_takes_each_later_epochs_batches_from_epoch_batches():
    """Epoch 1 trains on the task's batches; epochs 2 and 3 on what epoch_batches returns for them, in order."""
    task = digits_task(steps=2, optimizer="sgd")
    other = digits_task(steps=4, seed=9).batches
    asked = []

    def epoch_batches(epoch):
        asked.append(epoch)
        return other[2 * (epoch - 2) : 2 * (epoch - 1)]

    report = train_task(task, "simulation", num_shards=2, epochs=3, epoch_batches=epoch_batches)
    assert asked == [2, 3] and report.num_steps == 6 and report.steps_per_epoch == 2
    assert [s.epoch for s in report.steps] == [1, 1, 2, 2, 3, 3]
    # the same run by hand: one epoch over the six batches in that order
    flat = dataclasses.replace(task, batches=[*task.batches, *other])
    want = train_task(flat, "simulation", num_shards=2)
    assert [s.loss_baseline for s in report.steps] == [s.loss_baseline for s in want.steps]
    assert [s.max_abs_param_diff for s in report.steps] == [s.max_abs_param_diff for s in want.steps]


@pytest.mark.parametrize(
    "returned,error,msg",
    [
        (
            lambda b: b[:1],
            ValueError,
            r"train_task: epoch_batches\(2\) returned 1 batches; every epoch takes 2",
        ),
        (
            lambda b: iter(b),
            TypeError,
            r"train_task: epoch_batches\(2\) returned list_iterator; it must return",
        ),
        (
            lambda b: [b[0], {"x": b[1]["x"][:63], "label": b[1]["label"][:63]}],
            ValueError,
            r"train_task: batch size 63 \(batch leaf 'label'\) is not divisible by num_shards=2",
        ),
    ],
)
def test_train_task_checks_a_later_epochs_batches_when_drawn(returned, error, msg):
    task = digits_task(steps=2, optimizer="sgd")
    steps = []
    with pytest.raises(error, match=msg):
        train_task(
            task, "simulation", num_shards=2, epochs=2, callback=steps.append,
            epoch_batches=lambda e: returned(list(task.batches)),
        )  # fmt: skip
    assert len(steps) == 2  # epoch 1 ran; epoch 2 was refused before its first step
