"""Trial 27 (issue #36): an MoE LM on a ``data=2,expert=2`` mesh, its command line and its wording.

A built-in strategy that refuses the task by a documented limitation (the loss couples the rows of a batch) is a
REFUSED row said once, and it does not turn a passing candidate's exit status into 2; the hint of a step that
raised on a mesh lacking an axis names the axis and spec the error names before any annotation; the header says
each batch's size where they differ; a leaf in one run only reads as such in the tables, and its replay sentence
keeps the leaf kind's spelling and counts leaves by number.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from conftest import require_devices

from shardcheck.cli import main

TASK = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import shardcheck


    class Net(nnx.Module):
        def __init__(self, rngs, axis=None):
            init = nnx.initializers.lecun_normal()
            if axis is not None:  # the middle layer's kernel split over a model axis
                init = nnx.with_partitioning(init, (None, axis))
            self.a = nnx.Linear(4, 8, rngs=rngs)
            self.b = nnx.Linear(8, 8, kernel_init=init, rngs=rngs)
            self.c = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x):
            return self.c(jax.nn.relu(self.b(jax.nn.relu(self.a(x)))))


    def loss_fn(model, batch):
        y = model(batch["x"])[:, 0]
        # an auxiliary term over the whole batch (the square of its mean): the loss couples the rows
        return jnp.mean((y - batch["y"]) ** 2) + 0.5 * jnp.mean(y) ** 2


    def labels(params, moved=False):
        def lab(path, _):
            names = [str(getattr(k, "key", k)) for k in path]
            if "b" in names and not (moved and "kernel" in names):
                return "adam"
            return "sgd"
        return jax.tree_util.tree_map_with_path(lab, params)


    def make_tx(moved=False):
        return optax.multi_transform(
            {"adam": optax.adam(1e-2), "sgd": optax.sgd(0.05)}, lambda p: labels(p, moved)
        )


    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.normal(size=(8,)).astype(np.float32)}
        for _ in range(2)
    ]
    task = shardcheck.Task(model=lambda: Net(nnx.Rngs(0)), optimizer=make_tx(), loss_fn=loss_fn, batches=batches,
                           name="tiny27")
    # the second batch has 6 rows
    short = [batches[0], {k: v[:6] for k, v in batches[1].items()}]
    uneven_task = shardcheck.Task(model=lambda: Net(nnx.Rngs(0)), optimizer=make_tx(), loss_fn=loss_fn,
                                  batches=short, name="tiny27")
    annotated_task = shardcheck.Task(model=lambda: Net(nnx.Rngs(0), axis="expert"), optimizer=make_tx(),
                                     loss_fn=loss_fn, batches=batches, name="tiny27")


    def step(model, optimizer, batch, mesh):
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}


    def doubled_step(model, optimizer, batch, mesh):
        # the gradients summed over the 2 data shards instead of averaged
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        grads = jax.tree.map(lambda g: 2 * g, grads)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}


    def _placed_params(model, mesh):
        state = nnx.state(model)
        specs = nnx.get_partition_spec(state)
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))
        nnx.update(model, jax.device_put(state, shardings))


    def batch_first_step(model, optimizer, batch, mesh):
        # the batch placed by P('data') before the parameters by their annotations
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        _placed_params(model, mesh)
        return step(model, optimizer, batch, mesh)


    def params_first_step(model, optimizer, batch, mesh):
        _placed_params(model, mesh)
        return step(model, optimizer, batch, mesh)


    wrong_group_step = shardcheck.Candidate(
        name="wrong_group_step",
        step=step,
        make_optimizer=lambda model, optimizer: nnx.Optimizer(model, make_tx(moved=True), wrt=nnx.Param),
        pass_mesh=True,
    )
    """
)

REFUSAL = "the loss couples the rows of a batch"


@pytest.fixture
def task_file(tmp_path):
    path = tmp_path / "tiny27.py"
    path.write_text(TASK)
    return path


def _flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


@require_devices(2)
def test_refused_builtins_are_said_once_and_a_passing_candidate_exits_0(task_file, capsys):
    """Item 1: the row-coupling refusal of dp and accumulation is one short cell per row and one message on
    stderr (it was 4 messages and 4 cells), and the passing candidate beside them exits 0 (it exited 2)."""
    argv = ["verify", "--task", f"{task_file}:task", "--mesh", "data=2", "--strategies", "dp,accumulation"]
    assert main([*argv, "--candidate", f"{task_file}:step"]) == 0
    out, err = capsys.readouterr()
    flat_out, flat_err = _flat(out), _flat(err)
    assert flat_out.count("refused: the loss couples rows (below)") == 2
    assert flat_out.count("REFUSED") == 2 and "candidate PASS" in flat_out
    assert REFUSAL not in flat_out  # the whole reason is said once, on stderr
    assert flat_err.count(REFUSAL) == 1 and flat_err.count("note: ") == 1 and "error:" not in flat_err
    assert flat_err.startswith(
        "note: shardcheck verify: the built-in strategies 'dp' and 'accumulation' refused this task: cannot "
        "compute this task's loss"
    )
    assert "(--strategies none runs without them)" in flat_err
    assert "strategy 'dp')" not in flat_err  # the strategy's own name is not repeated inside the reason


@require_devices(2)
def test_refused_builtins_do_not_hide_a_failing_candidate_nor_pass_an_unchecked_run(task_file, capsys):
    """Item 1, the other side: a candidate whose gradients are doubled FAILs (exit 1) beside the refusals, and
    a run whose every row is refused checked nothing (exit 2, ok false, verdict REFUSED in --json)."""
    argv = ["verify", "--task", f"{task_file}:task", "--mesh", "data=2", "--strategies", "dp"]
    assert main([*argv, "--candidate", f"{task_file}:doubled_step"]) == 1
    out, _ = capsys.readouterr()
    assert "candidate FAIL" in _flat(out) and "dp REFUSED" in _flat(out)
    assert main([*argv, "--json", "-"]) == 2
    out, err = capsys.readouterr()
    document = json.loads(out)
    row = document["strategies"]["dp"]
    assert document["ok"] is False and row["verdict"] == "REFUSED" and row["codes"] == ["refused"]
    assert row["error"]["refused"] is True and row["error"]["type"] == "RowCouplingError"
    assert "no other row checked it (exit status 2): pass --strategies gspmd or a --candidate" in _flat(err)


@require_devices(4)
def test_the_hint_names_the_axis_and_spec_the_error_names(task_file, capsys):
    """Item 2: the batch placed by P('data') on --mesh foo=4 raised on 'data'; the hint named the annotation
    P(None, 'expert') of another leaf. Now the error's own axis and spec come first, the annotation after; where
    the annotated leaf's placement raised (it names 'expert'), that leaf's annotation is the hint."""
    argv = ["verify", "--task", f"{task_file}:annotated_task", "--mesh", "foo=4", "--strategies", "none"]
    assert main([*argv, "--candidate", f"{task_file}:batch_first_step"]) == 2
    err = _flat(capsys.readouterr().err)
    assert err.startswith(
        "error: shardcheck verify: the candidate step raised ValueError at step 0 (the step names mesh axis 'data', "
        "and the mesh has ('foo',): give the mesh that axis (--mesh data=4, or a mesh whose axes include 'data'), "
        "or name the mesh's axes in the step's P('data',); the model's annotations also name axes the mesh lacks: "
        "leaf 'b.kernel' is annotated P(None, 'expert'), naming 'expert'): Resource axis: data of P('data',)"
    ), err
    assert main([*argv, "--candidate", f"{task_file}:params_first_step"]) == 2
    err = _flat(capsys.readouterr().err)
    assert err.startswith(
        "error: shardcheck verify: the candidate step raised ValueError at step 0 (leaf 'b.kernel' is annotated "
        "P(None, 'expert') but the mesh has no axis 'expert' (its axes: ('foo',)); build the mesh with that axis "
        "(e.g. --mesh expert=2 among its axes, or expert=1 to keep the annotation and split nothing) or change the annotation): Resource axis: expert of "
    ), err


@require_devices(2)
@pytest.mark.parametrize("which, sizes", [("task", "B=8,"), ("uneven_task", "B=8, 6 (by step),")])
def test_the_header_says_each_batchs_size_where_they_differ(task_file, capsys, which, sizes):
    """Item 3: a task whose second batch has 6 rows read "2 steps of B=8"; equal batches keep "B=8"."""
    argv = ["verify", "--task", f"{task_file}:{which}", "--mesh", "data=2", "--strategies", "none"]
    assert main([*argv, "--candidate", f"{task_file}:step"]) == 0
    assert f"task tiny27, 2 steps of {sizes} S=2 on mesh data=2" in _flat(capsys.readouterr().out)


@require_devices(2)
def test_a_leaf_in_one_run_only_reads_as_such_live_and_in_its_replay(task_file, tmp_path, capsys):
    """Item 4: the optimizer state of a kernel sent to another multi_transform group is in one run only: its
    cells read "in one run only" and "-" (they read "inf" and an allowance of "0"); the replay's sentence keeps
    "opt_state" as spelt and counts "1 more leaf" (it read "Opt_state ... (and 1 more leaf/leaves)"). The right
    optimizer: numbers in the cells, no such words."""
    base = ["verify", "--task", f"{task_file}:task", "--mesh", "data=2", "--strategies", "none"]
    assert main([*base, "--candidate", f"{task_file}:wrong_group_step"]) == 1
    out = _flat(capsys.readouterr().out)
    leaf = "inner_states.adam.inner_state.0.mu.b.kernel"
    assert f"opt_state {leaf} 0 in one run only - - FAIL" in out, out
    assert "candidate FAIL opt_state in one run only - - localized" in out  # the summary (its leaf wraps)
    assert " inf " not in out
    assert main([*base, "--candidate", f"{task_file}:step"]) == 0
    assert "in one run only" not in capsys.readouterr().out
    rec = tmp_path / "rec.npz"
    record = ["record", "--task", f"{task_file}:task", "--mesh", "data=2", "--candidate", f"{task_file}:step"]
    assert main([*record, "--out", str(rec)]) == 0
    capsys.readouterr()
    replay = ["verify", "--task", f"{task_file}:task", "--against", str(rec)]
    assert main([*replay, "--candidate", f"{task_file}:wrong_group_step"]) == 1
    out = _flat(capsys.readouterr().out)
    assert f"Leaf opt_state {leaf} is recorded but this run has none (and 1 more leaf)." in out, out
    assert "Opt_state" not in out and "leaf/leaves" not in out
