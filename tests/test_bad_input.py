"""Every bad input raises a clear error naming the function and the argument, and changes nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardcheck

X = np.ones((4, 2), np.float32)
Y = np.ones((4, 1), np.float32)


def _host(a):
    if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    return np.array(a, copy=True)


def snapshot(*nodes):
    return jax.tree.map(_host, nnx.to_pure_dict(nnx.state(nodes)))


def assert_unchanged(before, *nodes):
    after = snapshot(*nodes)
    jax.tree.map(np.testing.assert_array_equal, before, after)


def linear():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


nan_x = X.copy()
nan_x[1, 1] = np.nan
inf_y = Y.copy()
inf_y[0, 0] = np.inf

BATCH_CASES = [
    ("x 1-D", np.ones(4), Y, ValueError, "x must be 2-D"),
    ("y 1-D", X, np.ones(4), ValueError, r"y must be 2-D .*y\[:, None\]"),
    ("x 3-D", np.ones((4, 2, 1)), Y, ValueError, "x must be 2-D"),
    ("batch mismatch", X, np.ones((3, 1)), ValueError, "same batch size.*x.shape\\[0\\]=4.*y.shape\\[0\\]=3"),
    ("empty", np.ones((0, 2)), np.ones((0, 1)), ValueError, "batch is empty"),
    ("nan", nan_x, Y, ValueError, "x contains NaN or inf"),
    ("inf", X, inf_y, ValueError, "y contains NaN or inf"),
    ("strings", np.array([["a", "b"]] * 4), Y, TypeError, "x has dtype <U1, which is not numeric"),
    ("bool", X.astype(bool), Y, TypeError, "not numeric"),
    ("complex", X.astype(np.complex64), Y, TypeError, "not numeric"),
    ("object", np.array([[1, None]] * 4, dtype=object), Y, TypeError, "not numeric"),
]


@pytest.mark.parametrize("case", BATCH_CASES, ids=[c[0] for c in BATCH_CASES])
@pytest.mark.parametrize("step", ["sgd_step", "reduced_sgd_step"])
def test_in_place_steps_reject_bad_batches_unchanged(case, step):
    _, x, y, err, msg = case
    model, optimizer = linear()
    before = snapshot(model, optimizer)
    args = (1,) if step == "reduced_sgd_step" else ()
    with pytest.raises(err, match=f"^{step}: .*{msg}"):
        getattr(shardcheck, step)(model, optimizer, x, y, *args)
    assert_unchanged(before, model, optimizer)


@pytest.mark.parametrize("case", BATCH_CASES, ids=[c[0] for c in BATCH_CASES])
@pytest.mark.parametrize("entry", ["fsdp_step", "simulated_data_parallel_step"])
def test_entrypoints_reject_bad_batches(case, entry):
    _, x, y, err, msg = case
    with pytest.raises(err, match=f"^{entry}: .*{msg}"):
        getattr(shardcheck, entry)(x, y, 1)


SHARD_CASES = [
    (0, ValueError, "num_shards must be a positive int, got 0"),
    (-2, ValueError, "num_shards must be a positive int, got -2"),
    (2.0, TypeError, r"num_shards must be a positive int, got 2.0 \(float\)"),
    (True, TypeError, r"got True \(bool\)"),
    (None, TypeError, r"got None \(NoneType\)"),
    ("2", TypeError, r"got '2' \(str\)"),
]


@pytest.mark.parametrize("num_shards,err,msg", SHARD_CASES)
@pytest.mark.parametrize("entry", ["fsdp_step", "simulated_data_parallel_step"])
def test_num_shards_validated(num_shards, err, msg, entry):
    with pytest.raises(err, match=f"^{entry}: .*{msg}"):
        getattr(shardcheck, entry)(X, Y, num_shards)


@pytest.mark.parametrize("num_shards,err,msg", SHARD_CASES)
def test_reduced_step_num_shards_validated_unchanged(num_shards, err, msg):
    model, optimizer = linear()
    before = snapshot(model, optimizer)
    with pytest.raises(err, match=f"^reduced_sgd_step: .*{msg}"):
        shardcheck.reduced_sgd_step(model, optimizer, X, Y, num_shards)
    assert_unchanged(before, model, optimizer)


def test_non_divisible_and_too_many_shards():
    x, y = np.ones((10, 2)), np.ones((10, 1))
    with pytest.raises(
        ValueError,
        match="batch size 10 is not divisible by num_shards=3; equal shards are required "
        r"\(valid num_shards for this batch: 1, 2, 5, 10",
    ):
        shardcheck.simulated_data_parallel_step(x, y, 3)
    with pytest.raises(ValueError, match="num_shards=11 is more shards than examples"):
        shardcheck.simulated_data_parallel_step(x, y, 11)
    model, optimizer = linear()
    before = snapshot(model, optimizer)
    for s in (3, 11):
        with pytest.raises(ValueError, match="^reduced_sgd_step: "):
            shardcheck.reduced_sgd_step(model, optimizer, x, y, s)
    assert_unchanged(before, model, optimizer)
    # fsdp_step: informational num_shards may exceed the batch.
    np.testing.assert_allclose(shardcheck.fsdp_step(x, y, 11), shardcheck.fsdp_step(x, y, 1))


@pytest.mark.parametrize(
    "lr,err,msg",
    [
        (0.0, ValueError, "lr must be a finite positive number, got 0.0"),
        (-0.1, ValueError, "got -0.1"),
        (float("nan"), ValueError, "got nan"),
        (float("inf"), ValueError, "got inf"),
        ("0.1", TypeError, r"got '0.1' \(str\)"),
        (None, TypeError, "got None"),
        (True, TypeError, "got True"),
    ],
)
@pytest.mark.parametrize("entry", ["fsdp_step", "simulated_data_parallel_step"])
def test_lr_validated(lr, err, msg, entry):
    with pytest.raises(err, match=f"^{entry}: .*{msg}"):
        getattr(shardcheck, entry)(X, Y, 1, lr)


@pytest.mark.parametrize(
    "params,err,msg",
    [
        ({"kernel": np.zeros((2, 1))}, ValueError, r"exactly the keys 'kernel' and 'bias', got \['kernel'\]"),
        ({"kernel": np.zeros((2, 1)), "bias": np.zeros(1), "extra": 1}, ValueError, "exactly the keys"),
        ({"w": np.zeros((2, 1)), "b": np.zeros(1)}, ValueError, "exactly the keys"),
        (
            {"kernel": np.zeros((1, 2)), "bias": np.zeros(1)},
            ValueError,
            r"params\['kernel'\] must have shape \(2, 1\)",
        ),
        (
            {"kernel": np.zeros((2, 1)), "bias": np.zeros(2)},
            ValueError,
            r"params\['bias'\] must have shape \(1,\)",
        ),
        ({"kernel": np.full((2, 1), np.nan), "bias": np.zeros(1)}, ValueError, "NaN or inf"),
        ({"kernel": np.array([["a"], ["b"]]), "bias": np.zeros(1)}, TypeError, "not numeric"),
        ([np.zeros((2, 1)), np.zeros(1)], TypeError, "params must be a mapping"),
    ],
)
@pytest.mark.parametrize("entry", ["fsdp_step", "simulated_data_parallel_step"])
def test_params_validated(params, err, msg, entry):
    with pytest.raises(err, match=f"^{entry}: .*{msg}"):
        getattr(shardcheck, entry)(X, Y, 1, params=params)


@pytest.mark.parametrize(
    "seed,err", [(-1, ValueError), (2**31, ValueError), (1.5, TypeError), (None, TypeError)]
)
def test_seed_validated(seed, err):
    with pytest.raises(err, match="^fsdp_step: seed must"):
        shardcheck.fsdp_step(X, Y, 1, seed=seed)


def test_batch_dependent_models_refused_c7():
    """C7: BatchNorm's per-shard statistics and Dropout's shared key break the equivalence: refused by the seeds'
    steps (the Task's rule, without a GSPMD step among them to check a drawing model with), unchanged."""

    class WithBatchNorm(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
            self.norm = nnx.BatchNorm(1, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.norm(self.linear(x))

    class WithDropout(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
            self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.drop(self.linear(x))

    # The statistics that differ: shards of [[0],[2],[10],[12]] see means 1 and 11; the full batch 6, variance 26.
    xs = np.array([[0.0], [2.0], [10.0], [12.0]])
    assert xs[:2].mean() == 1 and xs[2:].mean() == 11 and xs.mean() == 6 and xs.var() == 26
    refusals = (
        (WithBatchNorm, r"is refused because it holds nnx.BatchStat .*own batch statistics.*C7"),
        (
            WithDropout,
            r"draws random numbers in its forward pass \(RNG stream\(s\) drop\.rngs\), and the sharded steps run "
            r"the forward pass per shard or per micro-batch, every shard drawing with the same key.*GSPMD step",
        ),
    )
    for cls, msg in refusals:
        model = cls()
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        before = snapshot(model, optimizer)
        for call in (
            lambda m=model, o=optimizer: shardcheck.sgd_step(m, o, X, Y),
            lambda m=model, o=optimizer: shardcheck.reduced_sgd_step(m, o, X, Y, 2),
        ):
            with pytest.raises(ValueError, match=msg):
                call()
        assert_unchanged(before, model, optimizer)


def test_wrong_model_and_optimizer_types():
    model, optimizer = linear()
    with pytest.raises(TypeError, match="^sgd_step: model must be an nnx.Module, got dict"):
        shardcheck.sgd_step({}, optimizer, X, Y)
    with pytest.raises(
        TypeError, match=r"^sgd_step: optimizer must be an nnx.Optimizer.*nnx.Optimizer\(model, tx"
    ):
        shardcheck.sgd_step(model, optax.sgd(0.1), X, Y)


@pytest.mark.parametrize(
    "trees,err,msg",
    [
        ([], ValueError, "trees is empty"),
        ({"a": 1}, TypeError, "must be a sequence"),
        (
            [{"kernel": jnp.ones(2)}, {"bias": jnp.ones(2)}],
            ValueError,
            r"tree 1 differs in structure .*'kernel' \(present in tree 0 only\)",
        ),
        (
            [{"kernel": jnp.ones(2)}, {"kernel": jnp.ones(3)}],
            ValueError,
            r"leaf 'kernel' of tree 1 has shape \(3,\)",
        ),
        (
            [{"kernel": jnp.ones(2), "bias": jnp.ones(1)}, {"kernel": jnp.ones(2)}],
            ValueError,
            r"at path 'bias' \(present in tree 0 only\)",
        ),
    ],
)
@pytest.mark.parametrize("fn", ["tree_sum", "tree_mean"])
def test_tree_reductions_name_the_first_differing_path(trees, err, msg, fn):
    with pytest.raises(err, match=f"^{fn}: .*{msg}"):
        getattr(shardcheck, fn)(trees)


def test_weighted_mode_bad_weights():
    model, optimizer = linear()
    before = snapshot(model, optimizer)
    for weights, msg in (
        (np.ones(3), r"weights must have shape \(B,\)"),
        (np.zeros(4), "not all zero"),
        (-np.ones(4), ">= 0"),
        (np.array([1, np.nan, 1, 1]), "finite"),
    ):
        with pytest.raises(ValueError, match=f"^reduced_sgd_step: .*{msg}"):
            shardcheck.reduced_sgd_step(model, optimizer, X, Y, 2, weights=weights)
    with pytest.raises(
        ValueError, match="shard_sizes=.*must be 2 positive sizes summing to the batch size 4"
    ):
        shardcheck.reduced_sgd_step(model, optimizer, X, Y, 2, weights=np.ones(4), shard_sizes=(1, 2))
    assert_unchanged(before, model, optimizer)


@pytest.mark.parametrize("y_width", [1, 3])
@pytest.mark.parametrize("step", ["sgd_step", "reduced_sgd_step"])
def test_target_width_must_match_the_model(y_width, step):
    """A y of another width would broadcast in (model(x) - y) ** 2: refused, nothing changed."""
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    before = snapshot(model, optimizer)
    args = (2,) if step == "reduced_sgd_step" else ()
    with pytest.raises(
        ValueError, match=rf"^{step}: y has shape \(8, {y_width}\) but model Linear maps x to shape \(8, 2\)"
    ):
        getattr(shardcheck, step)(model, optimizer, np.ones((8, 3)), np.ones((8, y_width)), *args)
    with pytest.raises(ValueError, match=rf"^{step}: model Linear cannot take x of shape \(8, 2\)"):
        getattr(shardcheck, step)(model, optimizer, np.ones((8, 2)), np.ones((8, 2)), *args)
    assert_unchanged(before, model, optimizer)


def test_lr_that_overflows_float32_is_refused():
    with pytest.raises(ValueError, match="^fsdp_step: lr=1e.40 overflows float32"):
        shardcheck.fsdp_step(X, Y, 1, 1e40)


@pytest.mark.parametrize(
    "kwargs,err,msg",
    [
        (dict(name="rmsprop"), ValueError, "optimizer 'rmsprop' is unknown"),
        (dict(name="sgd", lr=-1.0), ValueError, "lr must be a finite positive number, got -1.0"),
        (dict(name="momentum", momentum=2.0), ValueError, r"momentum must be in \[0, 1\), got 2.0"),
        (dict(name="momentum", momentum=float("nan")), ValueError, "momentum must be in"),
        (dict(name="momentum", momentum="0.9"), TypeError, "momentum must be a number"),
    ],
)
def test_make_tx_validates(kwargs, err, msg):
    with pytest.raises(err, match=f"^make_tx: .*{msg}"):
        shardcheck.make_tx(**kwargs)


class _WithInteger(nnx.Module):
    """A Linear beside a second leaf of ``dtype``: an nnx.Param, or a Variable of its own (``kind``)."""

    def __init__(self, dtype, kind=nnx.Param):
        self.lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        self.n = kind(jnp.arange(2).astype(dtype))

    def __call__(self, x):
        return self.lin(x) + self.n[...].astype(jnp.float32)


class _Count(nnx.Variable):
    pass


def _integer_task(dtype, kind=nnx.Param):
    x = np.linspace(-1, 1, 48, dtype=np.float32).reshape(16, 3)
    return shardcheck.Task(
        model=lambda: _WithInteger(dtype, kind),
        optimizer=optax.adam(1e-2),
        loss_fn=lambda m, b: jnp.mean(m(b) ** 2),
        batches=[x],
        name="integer",
    )


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_an_integer_param_is_refused_by_name_before_any_step(dtype, tmp_path, capsys):
    """Trial 57: an int32 nnx.Param read as "a limitation or a bug of shardcheck's simulation step" with JAX's
    "grad requires real- or complex-valued inputs", on every row. It is the model's: refused by the leaf, its
    dtype and the fix (TypeError in Python, exit 2 on the command line); the same leaf as an nnx.Variable of its
    own is state, not a parameter, and the check passes."""
    name = jnp.dtype(dtype).name
    said = (
        f"model _WithInteger's parameter 'n' is an nnx.Param of dtype {name}; gradients need floating parameters: "
        "keep integer or bool state in an nnx.Variable of its own (e.g. class Count(nnx.Variable): ...), or make "
        "it a float Param"
    )
    with pytest.raises(TypeError) as raised:
        shardcheck.check_parity("simulation", _integer_task(dtype), num_shards=2)
    assert str(raised.value) == f"check_parity: {said}"
    path = tmp_path / "integer_task.py"
    path.write_text(
        "import jax.numpy as jnp\nfrom test_bad_input import _integer_task\n"
        f"task = _integer_task(jnp.{'int32' if dtype is jnp.int32 else 'bool_'})\n"
    )
    from shardcheck.cli import main

    assert main(["verify", "--task", f"{path}:task", "--strategies", "simulation", "--devices", "2"]) == 2
    assert " ".join(capsys.readouterr().err.split()) == f"error: shardcheck verify: {said}"
    assert shardcheck.check_parity("simulation", _integer_task(dtype, _Count), num_shards=2).ok
