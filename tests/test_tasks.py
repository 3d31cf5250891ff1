"""Built-in tasks (values of their data, losses and models) and ``load_task``'s spec forms and errors."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from shardcheck.task import Task
from shardcheck.tasks import (
    BUILTIN_TASKS,
    TinyLM,
    TinyLMConfig,
    digits_task,
    linnerud_task,
    load_task,
    tiny_lm_task,
)
from shardcheck.tasks.digits import digits_loss, load_digits
from shardcheck.tasks.tiny_lm import corpus_vocab, decode, encode, lm_loss, load_corpus, vocab_size

SEEDS = Path(__file__).resolve().parents[1] / "docs" / "seeds"


def _params(model: nnx.Module) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _softmax64(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def lm_task() -> Task:
    return tiny_lm_task(steps=2)


# ------------------------------------------------------------------------------------------ regression


def test_linnerud_batches_loss_and_reduction_size():
    task = linnerud_task(steps=3, seed=1, optimizer="sgd")
    assert task.name == "linnerud" and len(task.batches) == 3
    x, y = task.batches[0]
    assert x.shape == (16, 3) and y.shape == (16, 3)
    assert x.dtype == np.float32 and y.dtype == np.float32
    assert task.reduction_size == 16 * 3
    model = task.new_model()
    assert isinstance(model, nnx.Linear)
    w, b = (np.asarray(model.kernel[...], np.float64), np.asarray(model.bias[...], np.float64))
    expected = np.mean((x.astype(np.float64) @ w + b - y) ** 2)
    np.testing.assert_allclose(float(nnx.jit(task.loss_fn)(model, (x, y))), expected, rtol=1e-6)
    # same seed, same batches; another seed, another shuffle
    again = linnerud_task(steps=3, seed=1)
    np.testing.assert_array_equal(again.batches[2][0], task.batches[2][0])
    assert not np.array_equal(linnerud_task(steps=1, seed=2).batches[0][0], x)


def test_regression_mlp_option():
    task = load_task("diabetes", model="mlp", hidden=8, steps=1)
    model = task.new_model()
    assert model.hidden.kernel.shape == (10, 8) and model.out.kernel.shape == (8, 1)
    assert task.batches[0][0].shape == (64, 10) and task.reduction_size == 64


# ---------------------------------------------------------------------------------------------- digits


def test_digits_data_shapes_and_dtypes():
    x, label = load_digits()
    assert x.shape == (1797, 64) and x.dtype == np.float32
    assert label.shape == (1797,) and label.dtype == np.int32
    assert np.unique(label).tolist() == list(range(10))
    assert x.min() == 0.0 and x.max() == 1.0
    task = digits_task(batch_size=32, steps=2)
    batch = task.batches[1]
    assert set(batch) == {"x", "label"}
    assert batch["x"].shape == (32, 64) and batch["x"].dtype == np.float32
    assert batch["label"].shape == (32,) and batch["label"].dtype == np.int32
    assert task.reduction_size == 32
    model = task.new_model()
    assert nnx.eval_shape(lambda m: m(batch["x"]), model).shape == (32, 10)


def test_softmax_cross_entropy_gradient_matches_float64_oracle():
    """``nnx.grad`` of the digits loss on a Linear classifier == ``X.T @ (softmax(XW + b) - onehot) / B``."""
    batch = digits_task(batch_size=24, steps=1).batches[0]
    model = nnx.Linear(64, 10, rngs=nnx.Rngs(3))
    grads = nnx.jit(nnx.grad(digits_loss))(model, batch)
    x = batch["x"].astype(np.float64)
    w = np.asarray(model.kernel[...], np.float64)
    b = np.asarray(model.bias[...], np.float64)
    delta = _softmax64(x @ w + b) - np.eye(10)[batch["label"]]
    np.testing.assert_allclose(np.asarray(grads.kernel[...]), x.T @ delta / 24, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grads.bias[...]), delta.mean(axis=0), rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------------------- tiny-lm


def test_corpus_is_the_seed_documents_and_round_trips():
    seeds = [p.read_text(encoding="utf-8") for p in sorted(SEEDS.glob("*.txt"))]
    assert load_corpus().rstrip("\n") == "\n\n".join(s.rstrip("\n") for s in seeds)
    assert list(corpus_vocab()) == sorted(set(load_corpus()))
    assert vocab_size() == len(corpus_vocab()) + 1
    ids = encode("Linear(x)")
    assert ids.dtype == np.int32 and ids.min() >= 1
    assert decode(np.concatenate([ids, [0, 0]])) == "Linear(x)"
    with pytest.raises(ValueError, match="not in the corpus vocabulary"):
        encode("\u00e9")


def test_tiny_lm_batches_are_int32_and_padded(lm_task):
    cfg = TinyLMConfig()
    assert (cfg.d_model, cfg.num_heads, cfg.num_layers, cfg.seq_len) == (32, 2, 2, 32)
    for batch in lm_task.batches:
        assert set(batch) == {"tokens", "targets", "mask"}
        assert batch["tokens"].shape == batch["targets"].shape == batch["mask"].shape == (16, 32)
        assert batch["tokens"].dtype == np.int32 and batch["targets"].dtype == np.int32
        assert batch["mask"].dtype == np.float32
        mask = batch["mask"]
        counts = mask.sum(axis=1)
        assert (mask == 0).any() and len(set(counts.tolist())) > 1 and counts.min() >= 1
        # padding holds id 0 exactly where the mask is 0; real positions are next-character pairs
        assert np.array_equal(batch["tokens"] == 0, mask == 0)
        assert np.array_equal(batch["targets"] == 0, mask == 0)
        assert np.array_equal(
            batch["tokens"][:, 1:][mask[:, 1:] > 0], batch["targets"][:, :-1][mask[:, 1:] > 0]
        )
    assert lm_task.reduction_size == 16 * 32
    again = tiny_lm_task(steps=2)
    for a, b in zip(lm_task.batches, again.batches, strict=True):
        np.testing.assert_array_equal(a["mask"], b["mask"])
        np.testing.assert_array_equal(a["tokens"], b["tokens"])


def test_tiny_lm_loss_pair_matches_float64_masked_cross_entropy(lm_task):
    model = lm_task.new_model()
    assert isinstance(model, TinyLM)
    batch = lm_task.batches[0]

    @nnx.jit
    def forward(m, b):
        return m(b["tokens"], b["mask"]), lm_loss(m, b)

    logits, (total, count) = forward(model, batch)
    assert logits.shape == (16, 32, vocab_size()) and logits.dtype == jnp.float32
    z = np.asarray(logits, np.float64)
    log_z = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    picked = np.take_along_axis(z, batch["targets"][..., None].astype(np.int64), axis=-1)[..., 0]
    mask = batch["mask"].astype(np.float64)
    np.testing.assert_allclose(float(total), np.sum((log_z - picked) * mask), rtol=1e-5)
    assert float(count) == mask.sum()
    # padding is invisible to real tokens: changing padded positions' ids leaves real logits unchanged
    noisy = dict(batch, tokens=np.where(batch["mask"] > 0, batch["tokens"], 5).astype(np.int32))
    logits2, _ = forward(model, noisy)
    real = batch["mask"] > 0
    np.testing.assert_allclose(np.asarray(logits2)[real], np.asarray(logits)[real], rtol=1e-5, atol=1e-5)


def test_model_factories_give_identical_params(lm_task):
    for task in (lm_task, digits_task(steps=1), linnerud_task(model="mlp", steps=1)):
        first, second = _params(task.new_model()), _params(task.new_model())
        assert len(first) == len(second) > 0
        for a, b in zip(first, second, strict=True):
            assert a.dtype == np.float32
            np.testing.assert_array_equal(a, b)
    m = lm_task.new_model()
    assert not jax.tree.leaves(nnx.state(m, nnx.RngState)) and not jax.tree.leaves(
        nnx.state(m, nnx.BatchStat)
    )
    assert m.blocks[0].attn.query.bias is not None  # nnx.MultiHeadAttention's default biases


def test_tiny_lm_config_checks():
    with pytest.raises(ValueError, match="d_model=30 is not divisible by num_heads=4"):
        TinyLMConfig(d_model=30, num_heads=4)
    with pytest.raises(ValueError, match="smaller than the corpus vocabulary"):
        tiny_lm_task(config=TinyLMConfig(vocab_size=10))
    small = tiny_lm_task(config=TinyLMConfig(seq_len=8, num_layers=1), batch_size=8, steps=1)
    assert small.batches[0]["tokens"].shape == (8, 8) and small.reduction_size == 64


# ----------------------------------------------------------------------------------------- load_task


@pytest.mark.parametrize("name", list(BUILTIN_TASKS))
def test_load_task_builtins(name):
    task = load_task(name, steps=2, seed=1)
    assert isinstance(task, Task) and task.name == name and len(task.batches) == 2
    b = jax.tree.leaves(task.batches[0])[0].shape[0]
    assert b % 8 == 0
    assert isinstance(task.optimizer, optax.GradientTransformation)


def test_load_task_options_pass_through():
    tx = optax.sgd(0.5)
    task = load_task("digits", batch_size=16, steps=3, optimizer=tx)
    assert task.optimizer is tx and len(task.batches) == 3 and task.batches[0]["x"].shape == (16, 64)


def test_load_task_file_with_sibling_module(tmp_path):
    (tmp_path / "shardcheck_test_sibling.py").write_text(
        textwrap.dedent(
            """
            from flax import nnx

            def make():
                return nnx.Linear(2, 1, rngs=nnx.Rngs(0))
            """
        )
    )
    (tmp_path / "task_file.py").write_text(
        textwrap.dedent(
            """
            import numpy as np
            import optax
            import shardcheck_test_sibling
            from shardcheck.task import Task

            def loss(model, batch):
                return ((model(batch["x"]) - batch["y"]) ** 2).mean()

            BATCHES = [{"x": np.ones((8, 2), np.float32), "y": np.zeros((8, 1), np.float32)}]
            task = Task(shardcheck_test_sibling.make, optax.sgd(0.1), loss, BATCHES, name="mine")

            def build():
                return Task(shardcheck_test_sibling.make, optax.sgd(0.1), loss, BATCHES, name="built")

            unnamed = Task(shardcheck_test_sibling.make, optax.sgd(0.1), loss, BATCHES)
            """
        )
    )
    before = list(sys.path)
    try:
        assert load_task(f"{tmp_path / 'task_file.py'}:task").name == "mine"
        assert load_task(f"{tmp_path / 'task_file.py'}:build").name == "built"
        # a task left unnamed goes by its spec in the reports, not by the default "task"
        spec = f"{tmp_path / 'task_file.py'}:unnamed"
        assert load_task(spec).name == spec
        assert sys.path == before
    finally:
        sys.modules.pop("shardcheck_test_sibling", None)


def test_load_task_module_attr():
    task = load_task("shardcheck.tasks:linnerud_task")
    assert task.name == "linnerud"


def _write(tmp_path: Path, text: str, name: str = "bad_task.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_a_missing_name_lists_the_files_tasks_or_functions_first_and_no_modules(tmp_path):
    """Trial 51: the list of a file's public names began with the modules it imported (jax, nnx, optax)."""
    from shardcheck.cli.verify import load_candidate

    path = _write(
        tmp_path,
        """
        import jax
        import optax
        from shardcheck.tasks import load_task
        LR = 0.1
        task = load_task("diabetes")
        def step(model, optimizer, batch):
            return None
        """,
        "mine.py",
    )
    with pytest.raises(ValueError) as info:
        load_task(f"{path}:taks")
    assert str(info.value).endswith(
        "did you mean 'task'? its tasks: task; other public names: LR, load_task, step; name one of them after "
        "':', or define taks = shardcheck.Task(model=..., optimizer=..., loss_fn=..., batches=...) in the file"
    ), info.value
    with pytest.raises(ValueError) as info:
        load_task(f"{path}:jaxx")  # trial 52: ':nope' in a file importing numpy as np was asked about 'np'
    assert "did you mean" not in str(info.value)
    with pytest.raises(ValueError) as info:
        load_candidate(f"{path}:stepp")
    assert str(info.value).endswith(
        "did you mean 'step'? its functions: load_task, step; other public names: LR, task; name one of them "
        "after ':', or define it in the file"
    ), info.value


def test_load_task_errors(tmp_path):
    names = ", ".join(BUILTIN_TASKS)
    with pytest.raises(
        ValueError,
        match=rf"load_task: 'tiny_lm' is not a built-in task; did you mean 'tiny-lm'\? built-in tasks: {names}",
    ):
        load_task("tiny_lm")
    with pytest.raises(
        ValueError, match=rf"load_task: 'mnist' is not a built-in task; built-in tasks: {names}"
    ):
        load_task("mnist")
    with pytest.raises(
        ValueError, match=r"load_task: spec 'task\.py' names a file but no attribute; pass FILE\.py:ATTR"
    ):
        load_task("task.py")
    with pytest.raises(ValueError, match=r"load_task: task file '.*missing\.py' .* does not exist"):
        load_task(f"{tmp_path / 'missing.py'}:task")
    with pytest.raises(
        ValueError,
        match=r"load_task: option\(s\) 'bogus' do not apply to the built-in task 'digits'; its options are hidden, optimizer",
    ):
        load_task("digits", bogus=1)
    with pytest.raises(
        ValueError,
        match=r"load_task: built-in task 'digits': digits: batch_size=4000 is larger than the data's 1797 rows",
    ):
        load_task("digits", batch_size=4000)
    with pytest.raises(ValueError, match="load_task: option\\(s\\) steps apply to built-in tasks only"):
        load_task("shardcheck.tasks:linnerud_task", steps=2)
    with pytest.raises(ValueError, match="load_task: spec ':task' has an empty FILE/MODULE part"):
        load_task(":task")
    with pytest.raises(TypeError, match="load_task: spec must be a string"):
        load_task(3)

    broken = _write(tmp_path, "import numpy as np\nraise RuntimeError('no data here')\n")
    before = list(sys.path)
    with pytest.raises(
        ValueError,
        match=r"load_task: importing task file '.*bad_task\.py' failed with RuntimeError: no data here; fix the "
        r"file$",  # no note on sibling imports where nothing failed to import
    ):
        load_task(f"{broken}:task")
    assert sys.path == before
    missing_dep = _write(tmp_path, "import shardcheck_no_such_module\n", "dep_task.py")
    with pytest.raises(
        ValueError,
        match=r"failed with ModuleNotFoundError: No module named 'shardcheck_no_such_module'; fix the file \(its "
        r"folder is on sys.path while it loads",
    ):
        load_task(f"{missing_dep}:task")
    with pytest.raises(
        ValueError, match=r"load_task: module 'shardcheck_no_such_module' \(spec .*\) is not importable"
    ):
        load_task("shardcheck_no_such_module:task")

    odd = _write(
        tmp_path, "task_one = 1\ndef needs(x):\n    return x\ndef wrong():\n    return 'a task'\n", "odd.py"
    )
    with pytest.raises(
        ValueError,
        match=r"load_task: task file '.*odd\.py' has no attribute 'taks' .*public names: needs, task_one, wrong",
    ):
        load_task(f"{odd}:taks")
    with pytest.raises(
        ValueError, match=r"has no attribute 'task_on' \(spec .*\); did you mean 'task_one'\? public"
    ):
        load_task(f"{odd}:task_on")
    with pytest.raises(ValueError, match=r"has no attribute 'xyzzy' \(spec .*\); public names"):
        load_task(f"{odd}:xyzzy")
    with pytest.raises(TypeError, match=r"load_task: '.*odd\.py:task_one' names an int, not a Task"):
        load_task(f"{odd}:task_one")
    with pytest.raises(
        TypeError,
        match=r"load_task: '.*odd\.py:needs' needs argument\(s\) x; ATTR must be a Task or a zero-argument",
    ):
        load_task(f"{odd}:needs")
    with pytest.raises(
        TypeError,
        match=r"load_task: wrong\(\) of '.*odd\.py:wrong' returned str, not a shardcheck\.task\.Task",
    ):
        load_task(f"{odd}:wrong")


def test_one_command_loads_a_task_file_once_and_a_python_caller_afresh(tmp_path):
    """Trial 10: `verify --task F.py:task --candidate F.py:step` ran the file twice, so a module-level switch the
    task's code set was not the one the candidate's code read (planted faults silently PASSed). Within one
    command the file is one module; a Python caller's second load still runs it afresh, and a changed file runs
    again."""
    from shardcheck.tasks.loading import import_attr, one_module_per_file

    path = _write(tmp_path, "RUNS = []\nRUNS.append(1)\ndef step():\n    return len(RUNS)\n", "twice.py")
    with one_module_per_file():
        first = import_attr("t", f"{path}:RUNS")
        assert import_attr("t", f"{path}:RUNS") is first and import_attr("t", f"{path}:step")() == 1
        Path(path).write_text("RUNS = [1, 2]\n")  # changed: run again
        assert import_attr("t", f"{path}:RUNS") == [1, 2]
    assert import_attr("t", f"{path}:RUNS") is not import_attr("t", f"{path}:RUNS")  # outside: afresh
