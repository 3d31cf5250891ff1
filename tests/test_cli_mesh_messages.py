"""What a user's step on a mesh is told before and at its first step (issue #36, trial 6: a tensor-parallel ViT).

A misspelt ``--mesh`` axis (``modle`` for ``model``) is named with the annotation that needs it where a step that
places the state by its annotations raises (a step that ignores them runs on that mesh); the mesh with that axis
runs both. A
batch that does not split into the batch shards is named by its shards and the mesh's devices where the mesh has
more devices than shards (``data=3,model=2``: 3 shards of 6 devices); a mesh of batch axes alone keeps its words.
"""

from __future__ import annotations

import json
import textwrap

import jax
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardcheck import Candidate, Task, check_parity, make_mesh
from shardcheck.cli import main
from shardcheck.parity import CandidateError

ANNOTATED = textwrap.dedent(
    """
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import shardcheck

    MARK = {mark!r}


    class Net(nnx.Module):
        def __init__(self):
            split = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
            self.lin = nnx.Linear(3, 4, kernel_init=split, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.lin(x)


    def loss_fn(model, batch):
        return ((model(batch["x"]) - 1.0) ** 2).mean()


    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    task = shardcheck.Task(model=Net, optimizer=optax.sgd(0.1), loss_fn=loss_fn, batches=[{{"x": x}}], name="tp")


    def step(model, optimizer, batch, mesh):
        open(MARK, "a").write("ran ")
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return {{"loss": loss, "grads": grads}}


    def placed_step(model, optimizer, batch, mesh):
        # the state placed by its annotations, as the Flax NNX sharding guide places it
        state = nnx.state((model, optimizer))
        specs = nnx.get_partition_spec(state)
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))
        nnx.update((model, optimizer), jax.device_put(state, shardings))
        return step(model, optimizer, batch, mesh)
    """
)


@require_devices(4)
@pytest.mark.parametrize("axes", ["data=2,modle=2", "data=2,model=2"])
@pytest.mark.parametrize("which", ["step", "placed_step"])
def test_a_misspelt_mesh_axis_is_named_where_a_step_that_places_by_the_annotations_raises(
    axes, which, tmp_path, capsys
):
    """The typo: a step that places the state by its annotations raises inside JAX ("not found in mesh"), and
    the error names the leaf, its annotation and the mesh's axes first (exit 2); a step that ignores the
    annotations runs on that mesh and PASSes (it is not refused); the right axis: both run and pass."""
    mark = tmp_path / "ran.txt"
    path = tmp_path / "tp_task.py"
    path.write_text(ANNOTATED.format(mark=str(mark)))
    argv = ["verify", "--task", f"{path}:task", "--mesh", axes, "--strategies", "none"]
    code = main([*argv, "--candidate", f"{path}:{which}"])
    err = " ".join(capsys.readouterr().err.split())
    if axes == "data=2,model=2" or which == "step":
        assert code == 0 and mark.read_text() == "ran " and err == ""
        return
    assert code == 2
    # the likely cause first, before JAX's own text (trial 13: a long shard_map error hid it)
    assert err.startswith(
        "error: shardcheck verify: the candidate step raised ValueError at step 0 (leaf 'lin.kernel' is annotated "
        "P(None, 'model') but the mesh has no axis 'model' (its axes: ('data', 'modle')); build the mesh with that "
        "axis (e.g. --mesh model=2 among its axes, or model=1 to keep the annotation and split nothing) or change the annotation): "
    ), err


@require_devices(3)
def test_an_annotation_that_does_not_split_over_the_mesh_is_named_where_the_placing_step_raises(
    tmp_path, capsys
):
    """Trial 16: a row-sharded table on --mesh data=2,model=3 raised JAX's IndivisibleError inside the user's
    step and read 'fix the step'; the step is right and the mesh does not fit the annotation: that leaf, its
    shape and the dimension are named first (as the built-in strategies name them), the fix the mesh or the
    annotation."""
    path = tmp_path / "tp_task.py"
    path.write_text(ANNOTATED.format(mark=str(tmp_path / "ran.txt")))
    argv = ["verify", "--task", f"{path}:task", "--mesh", "data=1,model=3", "--strategies", "none"]
    assert main([*argv, "--candidate", f"{path}:placed_step"]) == 2
    captured = capsys.readouterr()
    assert "task tp, 1 steps of B=4" in " ".join(captured.out.split())  # the steps asked for, not "0 steps"
    err = " ".join(captured.err.split())
    assert err.startswith(
        "error: shardcheck verify: the candidate step raised IndivisibleError at step 0 (leaf 'lin.kernel' of shape "
        "(3, 4) is annotated P(None, 'model'): dimension 1 (4) does not split into 3 equal parts over 'model'; "
        "change the mesh or the annotation): "
    ), err
    assert "fix the step" not in err


def _placing_step(model, optimizer, batch, mesh):
    """A user's step that splits the batch's rows over the mesh's axis 'data' itself (8 rows do not split 3 ways)."""
    x = jax.device_put(batch["x"], NamedSharding(mesh, P("data")))
    loss, grads = nnx.value_and_grad(lambda m: m(x).mean())(model)
    optimizer.update(model, grads)
    return loss


def _task() -> Task:
    return Task(
        model=lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(0)),
        optimizer=optax.sgd(0.1),
        loss_fn=lambda m, b: m(b["x"]).mean(),
        batches=[{"x": np.ones((8, 2), np.float32)}],
        name="eight rows",
    )


@require_devices(6)
@pytest.mark.parametrize(
    ("shape", "hint"),
    [
        (
            {"data": 3, "model": 2},
            "the batch's 8 rows do not split into the 3 batch shards (axis data of the mesh's 6 devices): a likely "
            "cause; give a batch size divisible by 3, or fewer batch shards (a size of axis data that divides 8)",
        ),
        (
            {"data": 3},
            "the batch's 8 rows do not split over the 3 devices of the mesh: a likely cause; give a batch size "
            "divisible by the device count, or fewer devices",
        ),
    ],
)
def test_a_batch_that_does_not_split_names_its_shards_and_the_meshs_devices(shape, hint):
    """data=3,model=2: 3 batch shards on 6 devices (the trial read "the 3 devices of the mesh"); data=3: its 3
    devices are its 3 shards, said as before."""
    with pytest.raises(CandidateError) as caught:
        check_parity(_placing_step, _task(), mesh=make_mesh(shape))
    assert caught.value.hint == hint and caught.value.step == 0
    assert f"at step 0 ({hint}): " in str(caught.value)


def test_a_candidate_with_an_optimizer_of_its_own_laid_out_otherwise_needs_a_view():
    """Trial 7: a Candidate whose make_optimizer wraps the task's optax.MultiSteps, without view_optimizer, crashed
    in the harness (KeyError: '0.count'); it is refused before any step, naming the fix; with the view it runs."""
    import dataclasses

    task = dataclasses.replace(_task(), optimizer=optax.adam(1e-2))

    def wrapped(model, optimizer):
        return nnx.Optimizer(model, optax.MultiSteps(task.optimizer, every_k_schedule=2), wrt=nnx.Param)

    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: m(batch["x"]).mean())(model)
        optimizer.update(model, grads)
        return loss

    with pytest.raises(
        TypeError,
        match=r"candidate 'ms' steps an optimizer of its own \(make_optimizer\) whose "
        r"state is not laid out as the task optimizer's \(it lacks opt_state ",
    ):
        check_parity(Candidate(name="ms", step=step, make_optimizer=wrapped), task)
    view = lambda o: (nnx.state(o)["opt_state"]["inner_opt_state"], o.opt_state.gradient_step[...])  # noqa: E731
    seen = check_parity(Candidate(name="ms", step=step, make_optimizer=wrapped, view_optimizer=view), task)
    # it ran: MultiSteps(k=2) stepped once a batch applies no update at the first step, as the view tells
    assert seen.codes[0] == "never_stepped" and seen.steps[0].candidate_step_count == 0


def test_the_header_says_model_over_an_axis_only_where_a_leaf_is_split_over_it():
    """Trial 7: on mesh data=1,fsdp=2,model=2 the header said "model over model" where no leaf names 'model'; an
    axis that splits neither the batch nor any leaf is said as the batch replicated over it."""
    from shardcheck.cli.verify import _model_axes_text

    def task(axes):
        split = nnx.with_partitioning(nnx.initializers.lecun_normal(), axes)
        return Task(
            model=lambda: nnx.Linear(2, 4, kernel_init=split, rngs=nnx.Rngs(0)),
            optimizer=optax.sgd(0.1),
            loss_fn=lambda m, b: m(b["x"]).mean(),
            batches=[{"x": np.ones((8, 2), np.float32)}],
            name="annotated",
        )

    assert _model_axes_text(task((None, "model")), ["model"]) == "model annotated over model"
    assert _model_axes_text(task(("fsdp", None)), ["model"]) == "replicated over model"
    assert (
        _model_axes_text(task((None, "model")), ["model", "expert"])
        == "model annotated over model; replicated over expert"
    )


def test_an_error_reason_that_goes_on_after_a_colon_is_kept_on_one_line():
    """Trial 19: a built-in strategy's ERROR row and memory's refusal read JAX's "... but they differ:" and
    stopped there; the reason on the next line is joined (at most two more lines, 400 characters)."""
    from shardcheck.cli._common import reason_line

    carry = TypeError(
        "scan body function carry input and carry output must have equal types, but they differ:\n\n  The input "
        "carry component loop_carry[1] has type float32[4] but the corresponding output carry component has "
        "type float32[4]{V:data}, so the varying manual axes do not match.\n\nThis might be fixed by ..."
    )
    assert reason_line(carry) == (
        "scan body function carry input and carry output must have equal types, but they differ: The input carry "
        "component loop_carry[1] has type float32[4] but the corresponding output carry component has type "
        "float32[4]{V:data}, so the varying manual axes do not match."
    )
    assert reason_line(ValueError("one\ntwo")) == "one" and reason_line(ValueError("")) == "ValueError"
    assert reason_line(ValueError("x" * 500)) == "x" * 397 + "..."


@require_devices(4)
@pytest.mark.parametrize("axes", ["data=2,modle=2", "data=2,model=2"])
def test_a_strategy_that_cannot_place_the_annotations_is_its_own_error_row(axes, tmp_path, capsys):
    """Trial 56: one annotation naming an axis the mesh lacks stopped the whole run, dp's row unseen. Now the
    strategies that place by the annotations (fsdp, gspmd) read ERROR with the leaf, its annotation and the fix
    in their row and in --json, and dp, which replicates the state, still checks the task (exit 2, the worst
    row's); the mesh with that axis: every row PASSes."""
    path = tmp_path / "tp_task.py"
    path.write_text(ANNOTATED.format(mark=str(tmp_path / "ran.txt")))
    out = tmp_path / "report.json"
    argv = ["verify", "--task", f"{path}:task", "--mesh", axes, "--strategies", "dp,fsdp,gspmd"]
    code = main([*argv, "--json", str(out)])
    rows = json.loads(out.read_text())["strategies"]
    err = " ".join(capsys.readouterr().err.split())
    if axes == "data=2,model=2":
        assert code == 0 and {r["verdict"] for r in rows.values()} == {"PASS"} and err == ""
        return
    assert code == 2 and rows["dp"]["verdict"] == "PASS"
    for name in ("fsdp", "gspmd"):
        assert rows[name]["verdict"] == "ERROR" and rows[name]["error"]["type"] == "ValueError"
        assert rows[name]["error"]["message"] == (  # the cause in the summary's cell; the fix in the message
            "leaf 'lin.kernel' is annotated P(None, 'model') but the mesh has no axis 'model' (its axes: ('data', "
            "'modle'))"
        )
        assert (
            f"error: shardcheck verify: the built-in strategy '{name}' cannot place this task on this mesh: leaf "
            "'lin.kernel' is annotated P(None, 'model') but the mesh has no axis 'model' (its axes: ('data', "
            "'modle')); build the mesh with that axis (e.g. --mesh model=2 among its axes, or model=1 to keep the "
            f"annotation and split nothing) or change the annotation; the other rows stand (or leave {name} out "
            "with --strategies)"
        ) in err


@require_devices(4)
def test_the_summary_cell_of_a_step_that_raised_names_the_likely_cause(tmp_path, capsys):
    """Trial 56: the ERROR cell of a step whose annotations name an axis the mesh lacks read JAX's "Resource
    axis: model of P(None, 'model') is not found in mesh"; it reads the leaf and its annotation, as the message
    does (JAX's own text stays in the message)."""
    path = tmp_path / "tp_task.py"
    path.write_text(ANNOTATED.format(mark=str(tmp_path / "ran.txt")))
    out = tmp_path / "report.json"
    argv = ["verify", "--task", f"{path}:task", "--mesh", "data=2,modle=2", "--strategies", "none"]
    assert main([*argv, "--candidate", f"{path}:placed_step", "--json", str(out)]) == 2
    row = json.loads(out.read_text())["strategies"]["candidate"]
    assert row["verdict"] == "ERROR" and row["error"]["type"] == "ValueError"
    assert row["error"]["message"] == (
        "leaf 'lin.kernel' is annotated P(None, 'model') but the mesh has no axis 'model' (its axes: ('data', "
        "'modle'))"
    )
    assert "Resource axis: model" in row["diagnosis"]
    assert "Resource axis" not in capsys.readouterr().out


@require_devices(4)
@pytest.mark.parametrize("axes", ["data=2,modle=2", "data=2,model=2"])
def test_train_names_an_annotation_the_mesh_lacks_as_its_own_error(axes, tmp_path, capsys):
    """Trial 56's task under train: the error read "error: fsdp: leaf ..." (the strategy's name where the command
    belongs); it reads "shardcheck train: leaf ...", before any step (exit 2). The right mesh trains (exit 0)."""
    path = tmp_path / "tp_task.py"
    path.write_text(ANNOTATED.format(mark=str(tmp_path / "ran.txt")))
    code = main(["train", "--task", f"{path}:task", "--mesh", axes, "--strategy", "fsdp"])
    err = " ".join(capsys.readouterr().err.split())
    if axes == "data=2,model=2":
        assert code == 0 and err == ""
        return
    assert code == 2 and err.startswith(
        "error: shardcheck train: leaf 'lin.kernel' is annotated P(None, 'model') but the mesh has no axis 'model' "
        "(its axes: ('data', 'modle'))"
    ), err
