"""Recorded runs (``shardcheck.parity.harness.recorded``, ``shardcheck record``, ``verify --against``).

``record`` then ``verify --against`` of the same run PASSes bitwise on one machine; a planted change (the learning
rate doubled, a sum for a mean) FAILs at step 0 naming the leaf and the factor; a recording of another task or
mesh, a damaged file and another format version are refused with one line (exit 2).
"""

import dataclasses
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import require_devices
from hypothesis import given
from hypothesis import strategies as st

from shardcheck.cli import main
from shardcheck.parity.comparison.digest import REPLAY_FIELDS

ROOT = Path(__file__).resolve().parents[1]
ANNOTATED = f"{ROOT / 'examples' / 'annotated_lm.py'}:task"
TINY = ["--task", "tiny-lm", "--steps", "3"]

# One pytest-xdist worker runs this file (``--dist loadgroup``, pyproject.toml): its recordings and replays of the
# same tasks compile the same programs, which that worker's compilation cache (tests/conftest.py) then loads.
pytestmark = pytest.mark.xdist_group("record")

STEPS = textwrap.dedent(
    """
    import jax
    from flax import nnx

    from shardcheck.tasks.tiny_lm import lm_loss

    S = 4


    @nnx.jit
    def _step(model, optimizer, batch, scale):
        def mean_loss(model):
            loss_sum, count = lm_loss(model, batch)
            return loss_sum / count

        loss, grads = nnx.value_and_grad(mean_loss)(model)
        grads = jax.tree.map(lambda g: g * scale, grads)
        optimizer.update(model, grads)
        return loss, grads


    def mean_step(model, optimizer, batch):
        loss, grads = _step(model, optimizer, batch, 1.0)
        return {"loss": loss, "grads": grads}


    def loss_only_step(model, optimizer, batch):
        # the same update, its gradients not returned
        loss, _ = _step(model, optimizer, batch, 1.0)
        return loss


    def summed_step(model, optimizer, batch):
        # the S shards' gradients added where their mean was meant: S times the mean
        loss, grads = _step(model, optimizer, batch, float(S))
        return {"loss": loss, "grads": grads}
    """
)


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """tiny-lm's fsdp step on a 4-device FSDP mesh, 3 steps, recorded."""
    path = tmp_path_factory.mktemp("record") / "run.npz"
    assert main(["record", *TINY, "--mesh", "fsdp=4", "--out", str(path)]) == 0
    return path


# ----------------------------------------------------------------------------------------------- the library


@pytest.fixture(scope="module")
def identical_pair():
    """Two recordings of the same run (diabetes, the MLP under Adam, fsdp over 2 devices, 2 steps)."""
    from shardcheck.parity.harness.recorded import record_run
    from shardcheck.tasks import load_task

    def run():
        task = load_task("diabetes", model="mlp", hidden=8, optimizer="adam", batch_size=16, steps=2)
        return record_run(task, "fsdp", num_shards=2, settings={"lr": 0.01})

    return run(), run()


@require_devices(2)
def test_two_identical_runs_compare_pass_and_bitwise(identical_pair):
    from shardcheck.parity.comparison.digest import compare_run

    recorded, replayed = identical_pair
    comparison = compare_run(recorded, replayed)
    assert comparison.ok and comparison.verdict == "PASS" and comparison.first_failure is None
    assert comparison.bitwise and comparison.hashes_matched == comparison.hashes_compared > 0
    assert all(e.err == 0 for e in comparison.leaves)
    # loss, 4 gradients, 4 parameters, Adam's 8 moments, its count and the optimizer's step
    kinds = [n.split(" ")[0] for n in recorded.names]
    assert {k: kinds.count(k) for k in set(kinds)} == {
        "loss": 1,
        "grad": 4,
        "param": 4,
        "opt_state": 8,
        "counter": 2,
    }
    assert recorded.meta["mesh"] == {"data": 2} and recorded.meta["num_shards"] == 2
    assert recorded.steps.norm.shape == (2, len(recorded.names))
    # the digests are the arrays': an update size > 0 on every parameter, counters 1 then 2
    step = recorded.names.index("counter step")
    assert recorded.steps.samples[:, step, 0].tolist() == [1.0, 2.0]
    params = [i for i, n in enumerate(recorded.names) if n.startswith("param ")]
    assert np.all(recorded.steps.update[:, params] > 0) and np.all(np.isnan(recorded.initial.update))


@require_devices(2)
@given(
    leaf=st.integers(0, 1000),
    step=st.integers(0, 1),
    evidence=st.sampled_from(["max", "norm", "sample"]),
    factor=st.sampled_from([0.5, 0.9, 1.5, 4.0]),
)
def test_a_digest_moved_past_its_tolerance_fails_there_and_within_it_passes(
    identical_pair, leaf, step, evidence, factor
):
    """Move one float leaf's digest by ``factor`` times what it is allowed: under 1 it passes (not bitwise: its hash
    is kept, the values not), over 1 it fails at that step and leaf, with that evidence."""
    from shardcheck.parity.comparison.digest import compare_run

    recorded, replayed = identical_pair
    floats = [i for i, n in enumerate(recorded.names) if not n.startswith("counter")]
    j = floats[leaf % len(floats)]
    name = recorded.names[j]
    allowed = next(e for e in compare_run(recorded, replayed).leaves if e.step == step and e.name == name)
    r = recorded.steps
    size = int(np.prod(recorded.shapes[j]))
    moved = {field: getattr(r, field).copy() for field in ("max", "norm", "samples")}
    if evidence == "max":
        moved["max"][step, j] += factor * allowed.allowed
    elif evidence == "norm":  # the norm's allowance: sqrt(size) times the elementwise one, plus its rounding
        eps = float(np.finfo(np.float32).eps)
        moved["norm"][step, j] += factor * (
            np.sqrt(size) * allowed.allowed + 2 * eps * np.sqrt(size) * r.norm[step, j]
        )
    else:
        moved["samples"][step, j, 0] -= factor * allowed.allowed
    changed = dataclasses.replace(replayed, steps=dataclasses.replace(r, **moved))
    comparison = compare_run(recorded, changed)
    if factor < 1:
        assert comparison.ok
        return
    assert not comparison.ok
    first = comparison.first_failure
    assert (first.step, first.name, first.evidence) == (step, name, evidence)


def _changed(recording, **fields):
    """``recording`` with some of its steps' digest arrays replaced (``{field: function of a copy}``)."""
    r = recording.steps
    moved = {field: change(getattr(r, field).copy()) for field, change in fields.items()}
    return dataclasses.replace(recording, steps=dataclasses.replace(r, **moved))


@require_devices(2)
def test_a_nan_where_the_recording_has_a_number_fails_as_nan(identical_pair):
    from shardcheck.parity.comparison.digest import compare_run

    recorded, replayed = identical_pair
    j = recorded.names.index(next(n for n in recorded.names if n.startswith("param ")))

    def nan_sample(a):
        a[1, j, 0] = np.nan
        return a

    def nan_update(a):
        a[0, j] = np.nan
        return a

    for field, change in (("samples", nan_sample), ("update", nan_update)):
        comparison = compare_run(recorded, _changed(replayed, **{field: change}))
        first = comparison.first_failure
        assert not comparison.ok and first.evidence == "nan" and first.name == recorded.names[j], field
        assert first.step == (1 if field == "samples" else 0)


@require_devices(2)
def test_a_passing_replay_on_a_mesh_says_once_that_it_compared_no_replicas(identical_pair):
    """From trial 6: a step whose only fault is replicas that differ (a clip per device) replayed against a correct
    recording PASSed; the pass said once that a replay does not compare the copies and a live check does. A run
    recorded now compares its copies (``meta["replicas"]``, trial 37: the replay FAILs as live) and says nothing;
    a replayed run recorded before that keeps the note. A failing replay (its localization says "the replicas:
    not observed") and a run on one device say nothing."""
    from shardcheck.parity.comparison.digest import REPLICAS_UNSEEN, compare_run

    recorded, replayed = identical_pair
    compared = compare_run(recorded, replayed)
    assert (
        compared.ok and compared.replicas_compared and not any(REPLICAS_UNSEEN in n for n in compared.notes)
    )
    replayed = dataclasses.replace(replayed, meta={k: v for k, v in replayed.meta.items() if k != "replicas"})
    passed = compare_run(recorded, replayed)
    assert passed.ok and [n for n in passed.notes if REPLICAS_UNSEEN in n] == [
        "A replay compares digests, which hold no device's own copy: the replicas' agreement was not compared "
        "(whether each replicated leaf holds the same values on every device of mesh data=2). A live check "
        "compares them (check_parity against the reference; verify without --against)."
    ]
    assert str(passed.report()).count(REPLICAS_UNSEEN) == 1
    j = recorded.names.index(next(n for n in recorded.names if n.startswith("param ")))
    failed = compare_run(recorded, _changed(replayed, max=lambda a: a + (np.arange(a.shape[1]) == j)))
    assert not failed.ok and not any(REPLICAS_UNSEEN in n for n in failed.notes)
    one = [dataclasses.replace(r, meta={**r.meta, "mesh": {"data": 1}}) for r in identical_pair]
    alone = compare_run(*one)
    assert alone.ok and not any(REPLICAS_UNSEEN in n for n in alone.notes)


@require_devices(2)
def test_a_loss_off_with_gradients_at_ratio_1_is_named_a_forward_change(identical_pair):
    """A missing reduction in the forward pass (a psum over a tensor axis) moves the loss and the gradients' values
    but not their scale: the cause names the forward pass, never "a changed learning rate" at a ratio of 1."""
    from shardcheck.parity.comparison.digest import compare_run

    recorded, replayed = identical_pair
    loss = recorded.names.index("loss")
    grads = [i for i, n in enumerate(recorded.names) if n.startswith(("grad ", "param "))]

    def off(a):
        a[0, loss] *= 1.3
        return a

    def shuffled(a):  # the same norm and max, other values at the sampled indices (no one factor)
        a[0, grads] *= np.array([1.0, -1.0, 1.5, 0.5, 1.0, -1.0, 2.0, 0.3])
        return a

    comparison = compare_run(recorded, _changed(replayed, max=off, norm=off, samples=shuffled))
    assert comparison.first_failure.name == "loss" and comparison.first_failure.step == 0
    # the live check's rule: the loss differs too, and no one factor (not one reduced step)
    assert comparison.codes[0] == "update_differs", comparison.cause
    assert "The update differs from the reference at step 0" in comparison.cause
    assert "the loss it returns is not the full-batch loss at its starting parameters" in comparison.cause
    assert "learning rate" not in comparison.cause


@require_devices(2)
@pytest.mark.parametrize("gradients_in", ["recording", "replay"])
def test_a_rounding_level_gradient_of_either_run_sets_the_allowance(identical_pair, gradients_in):
    """A parameter whose gradient is at rounding level under Adam may move by twice its update between two
    correct runs: the allowance is read from the recording's gradients, or from the replay's where the
    recording's step returned none (and the other way round)."""
    from shardcheck.parity.comparison.digest import _only, compare_run

    recorded, replayed = identical_pair
    param = next(n for n in recorded.names if n.startswith("param ") and n.endswith("bias"))
    grad, p = recorded.names.index("grad " + param.removeprefix("param ")), recorded.names.index(param)
    update = float(recorded.steps.update[0, p])

    def rounding_level(a):  # the gradient is rounding noise
        a[:, grad] = 0.0
        return a

    def moved(a):  # the noise's lr-sized step taken with another sign: 1.5 times the update
        a[0, p, 0] += 1.5 * update
        return a

    zeroed = {f: rounding_level for f in ("max", "norm")}
    without = [n for n in recorded.names if not n.startswith("grad ")]
    if gradients_in == "recording":
        recording, replay = _changed(recorded, **zeroed), _only(_changed(replayed, samples=moved), without)
    else:
        recording, replay = _only(recorded, without), _changed(replayed, samples=moved, **zeroed)
    assert compare_run(recording, replay).ok
    # without the allowance the same move fails: the gradient is not at rounding level
    assert not compare_run(recorded, _changed(replayed, samples=moved)).ok


@require_devices(2)
def test_a_rounding_level_allowance_is_both_runs_update_and_names_no_learning_rate(identical_pair):
    """Adam's update of a rounding-level gradient is lr * noise / (|noise| + eps): its size is each run's own, so
    a correct run whose noise is larger moves 2.46x as far as the recording. The allowance is the two runs' update
    sizes added (not twice the recording's), and a move past it is never read as "a changed learning rate"."""
    from shardcheck.parity.comparison.digest import compare_run
    from shardcheck.parity.tolerance.derive import derive_tolerance

    recorded, replayed = identical_pair
    param = next(n for n in recorded.names if n.startswith("param ") and n.endswith("bias"))
    grad, p = recorded.names.index("grad " + param.removeprefix("param ")), recorded.names.index(param)
    update = float(recorded.steps.update[0, p])

    def rounding_level(a):  # noise: within atol of 0, not exactly 0 (a gradient exactly 0 has no noise)
        a[:, grad] = 1e-12
        return a

    def larger(a):  # the replay's noise-driven update is 2.46x the recording's
        a[0, p] *= 2.46
        return a

    def moved(by):
        def move(a):
            a[0, p, 0] += by * update
            return a

        return move

    noisy = {"max": rounding_level, "norm": rounding_level}
    recording = _changed(recorded, **noisy)
    # 3.1x the recorded update apart: within 1 + 2.46 (the sum), past 2 (twice the recording's, the old rule)
    assert compare_run(recording, _changed(replayed, update=larger, samples=moved(3.1), **noisy)).ok
    comparison = compare_run(recording, _changed(replayed, update=larger, samples=moved(5.0), **noisy))
    first = comparison.first_failure
    assert not comparison.ok and (first.step, first.name, first.evidence) == (0, param, "sample")
    assert first.ratio == pytest.approx(2.46, rel=1e-6)
    tol = derive_tolerance(
        recorded.meta["tolerance_dtype"], batch_size=int(recorded.meta["terms"][0]), step=0
    )
    r_max = float(recorded.steps.max[0, p])
    assert first.allowed == pytest.approx(tol.atol + tol.rtol * r_max + (1 + 2.46) * update, rel=1e-6)
    # the live check's rules: the parameters stage alone, that leaf, and its gradient at rounding level
    assert comparison.codes[:1] == ("localized",) and "rounding_level" in comparison.codes, comparison.cause
    assert "the parameters differ (1 of 4 leaves)" in comparison.cause and param in comparison.cause
    # the test sets the gradient's max to 1e-12 on both sides: rounding noise, said so (a gradient exactly 0 on
    # both sides has no noise to allow: trial 30)
    assert f"1 leaf has a gradient at rounding level (e.g. {param}" in comparison.cause
    assert "learning rate" not in comparison.cause


ATTENTION_STEPS = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    import shardcheck

    V, D, T = 32, 16, 8


    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.LayerNorm(D, rngs=rngs)
            # its key bias has a true gradient of 0: the softmax ignores a shift of a query's every score
            self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=D, decode=False, rngs=rngs)
            self.mlp = nnx.Linear(D, D, rngs=rngs)

        def __call__(self, x):
            x = x + self.attn(self.norm(x))
            return x + nnx.relu(self.mlp(x))


    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(V, D, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(3)])
            self.head = nnx.Linear(D, 4, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(x.mean(axis=1))


    rng = np.random.default_rng(0)
    batches = [
        {"tokens": rng.integers(0, V, (64, T)).astype(np.int32), "label": rng.integers(0, 4, (64,)).astype(np.int32)}
        for _ in range(2)
    ]


    def loss_fn(model, batch):
        ce = optax.softmax_cross_entropy_with_integer_labels(model(batch["tokens"]), batch["label"])
        return jnp.sum(ce), jnp.asarray(ce.size, jnp.float32)


    task = shardcheck.Task(
        model=lambda: Model(nnx.Rngs(params=0)), optimizer=optax.adamw(1e-2), loss_fn=loss_fn, batches=batches,
        name="attention",
    )


    def _shard_map_step(kind):
        def step(model, optimizer, batch, mesh):
            axes = tuple(mesh.axis_names)
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)

            def body(params, rest, batch):
                def local(p):
                    loss_sum, count = loss_fn(nnx.merge(graphdef, p, rest), batch)
                    if kind == "summed":  # each shard's mean, then a psum where a pmean was meant
                        return loss_sum / count
                    return loss_sum / jax.lax.psum(count, axes)

                loss, grads = jax.value_and_grad(local)(params)
                return jax.lax.psum(loss, axes), jax.lax.psum(grads, axes)

            mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(axes)), out_specs=P(), check_vma=False)
            loss, grads = jax.jit(mapped)(params, rest, batch)
            before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
            optimizer.update(model, grads)
            if kind == "doubled":  # the update taken twice: a doubled learning rate
                after = nnx.state(model, nnx.Param)
                nnx.update(model, jax.tree.map(lambda b, a: b + 2 * (a - b), before, after))
            return loss if kind == "loss_only" else {"loss": loss, "grads": grads}

        return step


    good = _shard_map_step("good")
    loss_only = _shard_map_step("loss_only")
    summed = _shard_map_step("summed")
    doubled = _shard_map_step("doubled")
    """
)


@require_devices(8)
def test_a_correct_shard_map_step_passes_against_the_fsdp_strategys_recording(tmp_path):
    """The new-user trial's false FAIL: a correct shard_map step (returning its gradients, or only its loss)
    against a recording of the built-in fsdp strategy, whose attention key biases' rounding noise Adam turns into
    updates 2.46x smaller than the step's. It PASSes; a doubled learning rate FAILs with its cause, named on a leaf
    whose gradient is not at rounding level."""
    steps = tmp_path / "attention_steps.py"
    steps.write_text(ATTENTION_STEPS)
    args = ["--task", f"{steps}:task", "--mesh", "data=2,fsdp=4", "--steps", "2"]
    fsdp = tmp_path / "fsdp.npz"
    assert main(["record", *args, "--out", str(fsdp)]) == 0
    out = tmp_path / "against.json"

    def verify(against, *more):
        rc = main(["verify", *args, "--against", str(against), "--json", str(out), *more])
        return rc, _json(out)["strategies"]["candidate" if "--candidate" in more else "fsdp"]

    # checked elsewhere, not rerun here (the suite's time): a loss-only step's replay
    # (test_a_replayed_step_that_returns_no_gradients_is_compared_on_the_rest) and a step replayed against its own
    # recording, bitwise (test_record_then_verify_against_passes_bitwise)
    # and, not rerun here (the suite's time): the other way round (the fsdp strategy against the step's
    # recording), and a sum for a mean replayed (test_a_user_step_summing_for_a_mean_fails_at_step_0_on_...)
    rc, run = verify(fsdp, "--candidate", f"{steps}:good")
    worst = run["worst_by_kind"]["param"]
    assert (rc, run["verdict"], run["bitwise"]) == (0, "PASS", False)
    assert worst["name"].endswith(".attn.key.bias") and worst["err"] > 2 * worst["recorded"] != 0
    rc, run = verify(fsdp, "--candidate", f"{steps}:doubled")
    first = run["first_failure"]
    assert (rc, run["verdict"], first["step"]) == (1, "FAIL", 0)
    assert first["name"].startswith("param ") and not first["name"].endswith(".attn.key.bias")
    assert first["ratio"] == pytest.approx(2.0, rel=1e-3)
    # the live check's rules: the loss, gradients and moments match, the parameters' update is x2
    assert run["codes"][0] == "localized", run["cause"]
    assert "the loss, the gradients and the optimizer state match; the parameters differ" in run["cause"]


@require_devices(8)
def test_a_missing_psum_over_the_tensor_axis_is_named_a_forward_change():
    """The Megatron step without its psum over ``model``, replayed against a recording of the correct one."""
    from test_tensor_parallel import TP_MESH, _megatron_task, megatron_step

    from shardcheck.mesh import make_mesh
    from shardcheck.parity.comparison.digest import compare_run
    from shardcheck.parity.harness.recorded import record_run

    mesh, task = make_mesh(TP_MESH), _megatron_task()
    recorded = record_run(task, megatron_step(), mesh=mesh, steps=2)
    comparison = compare_run(recorded, record_run(task, megatron_step("no_psum"), mesh=mesh, steps=2))
    first = comparison.first_failure
    assert not comparison.ok and (first.step, first.name) == (0, "loss")
    # the live check's rules: the replay compares its copies (trial 37), which differ along 'model' as live
    # (test_tensor_parallel: wrong_axis_reduction first), then the loss that differs on a mesh that splits the
    # model: the sharded forward pass
    assert comparison.codes[:2] == ("wrong_axis_reduction", "replicas_differ"), comparison.codes
    assert "update_differs" in comparison.codes, comparison.cause
    assert "the sharded forward pass computing another function" in comparison.cause
    assert "a row-parallel output not psum-ed over 'model'" in comparison.cause
    assert "learning rate" not in comparison.cause


@require_devices(2)
def test_a_replay_on_another_mesh_or_of_more_steps_is_named_so(identical_pair):
    from shardcheck.mesh import make_mesh
    from shardcheck.parity.comparison.digest import compare_run
    from shardcheck.parity.harness.recorded import record_run
    from shardcheck.tasks import load_task

    recorded, replayed = identical_pair
    task = load_task("diabetes", model="mlp", hidden=8, optimizer="adam", batch_size=16, steps=2)
    elsewhere = record_run(task, "fsdp", mesh=make_mesh({"fsdp": 2}), settings={"lr": 0.01})
    comparison = compare_run(recorded, elsewhere)
    assert not comparison.ok and comparison.first_failure.evidence == "sharding"
    assert comparison.cause.startswith("Recorded on mesh data=2, replayed on fsdp=2: another mesh")
    assert comparison.codes[0] == "structure"
    one = dataclasses.replace(
        recorded,
        meta=recorded.meta | {"steps": 1},
        steps=dataclasses.replace(
            recorded.steps,
            **{
                f: getattr(recorded.steps, f)[:1]
                for f in ("present", "sharding", "norm", "max", "update", "samples", "sha256")
            },
        ),
    )
    comparison = compare_run(one, replayed)
    assert comparison.ok and comparison.steps == 1
    assert any("the replay's 1 later ones have nothing to compare with" in n for n in comparison.notes)


@require_devices(2)
def test_the_recording_api_refuses_bad_arguments_naming_them(identical_pair, tmp_path):
    from shardcheck.mesh import make_mesh
    from shardcheck.parity.comparison.digest import compare_run
    from shardcheck.parity.harness.recorded import load_recording
    from shardcheck.tasks import load_task

    recorded, replayed = identical_pair
    with pytest.raises(ValueError, match=r"Recording.save: path '.*' is a directory; pass a file path"):
        recorded.save(tmp_path)
    path = tmp_path / "run.npz"
    recorded.save(path)
    with pytest.raises(TypeError, match=r"compare_run: recording must be a Recording, got PosixPath"):
        compare_run(path, replayed)
    with pytest.raises(TypeError, match=r"compare_run: replayed must be a Recording, got str"):
        compare_run(recorded, str(path))
    task = load_task("diabetes", model="mlp", hidden=8, optimizer="adam", batch_size=16, steps=2)
    # S follows from the mesh, as record_run's; a mismatch names the arguments, not command-line flags
    loaded = load_recording(path, task=task, mesh=make_mesh({"data": 2}))
    assert compare_run(loaded, replayed).bitwise
    with pytest.raises(ValueError, match=r"not no mesh \(S=1\); replay it with a mesh of data=2") as info:
        load_recording(path, task=task, num_shards=1)
    assert "--" not in str(info.value)
    with pytest.raises(ValueError, match=r"holds 2 step\(s\), not 3; pass steps=2 or fewer"):
        load_recording(path, task=task, mesh=make_mesh({"data": 2}), steps=3)
    with pytest.raises(ValueError, match=r"replay it with num_shards=2 \(or None\)"):
        load_recording(path, task=task, mesh=make_mesh({"data": 2}), num_shards=1)
    # wrong types and values: the function, the argument and the fix, never a library's raw error
    refusals = [
        (lambda: load_recording(123), TypeError, "load_recording: path must be a str or os.PathLike"),
        (
            lambda: load_recording(path, task="diabetes"),
            TypeError,
            "load_recording: task must be a shardcheck.Task",
        ),
        (lambda: load_recording(path, steps="2"), TypeError, "load_recording: steps must be a positive int"),
        (lambda: load_recording(path, steps=0), ValueError, "load_recording: steps must be a positive int"),
        (lambda: recorded.save(123), TypeError, "Recording.save: path must be a str or os.PathLike"),
        (lambda: recorded.save(tmp_path / "notes.txt"), ValueError, "does not end in .npz"),
        (
            lambda: compare_run(recorded, replayed, rtol=-1),
            ValueError,
            "compare_run: rtol must be a number >= 0",
        ),
        (
            lambda: compare_run(recorded, replayed, atol=float("nan")),
            ValueError,
            "atol must be a number >= 0",
        ),
        (
            lambda: compare_run(recorded, replayed, rtol=float("inf")),
            ValueError,
            "rtol must be a number >= 0 and finite",
        ),
    ]
    for call, kind, message in refusals:
        with pytest.raises(kind, match=message):
            call()
    foreign = tmp_path / "data.npz"
    np.savez(foreign, x=np.arange(3))
    with pytest.raises(
        ValueError, match="exists and is not a shardcheck recording, so it is not overwritten"
    ):
        recorded.save(foreign)
    assert np.load(foreign)["x"].tolist() == [0, 1, 2]
    assert recorded.save(path) > 0  # an older recording is overwritten


def test_record_run_refuses_settings_that_are_not_json_before_any_step():
    from shardcheck.parity.harness.recorded import record_run

    for settings in ([1, 2], "abc", {"lr": object()}, {1: 2}):
        with pytest.raises(TypeError, match="record_run: settings must be a mapping of str to JSON values"):
            record_run(None, "dp", settings=settings)
    for name in (5, "  "):
        with pytest.raises(TypeError, match="record_run: name must be a non-empty str"):
            record_run(None, "dp", name=name)


def test_record_run_names_itself_when_a_step_returns_no_loss():
    """A step whose return value holds no loss is refused by ``record_run`` in its own name, the step named."""
    from shardcheck.parity.harness.recorded import record_run
    from shardcheck.tasks import load_task

    task = load_task("diabetes", model="mlp", hidden=8, optimizer="adam", batch_size=16, steps=1)

    def no_loss(model, optimizer, batch):
        return "done"

    with pytest.raises(
        TypeError, match=r"^record_run: the 'no_loss' step returned str at step 0; it must return"
    ):
        record_run(task, no_loss)


@require_devices(2)
def test_first_moments_off_by_s_name_a_sum_for_a_mean_without_gradients(identical_pair):
    """A recording without gradients: Adam's first moments x S carry the gradients' scale."""
    from shardcheck.parity.comparison.digest import _only, compare_run

    recorded, replayed = identical_pair
    mu = [i for i, n in enumerate(recorded.names) if ".mu." in f".{n}."]
    nu = [i for i, n in enumerate(recorded.names) if ".nu." in f".{n}."]

    def times(k, cols):
        def change(a):
            a[0, cols] *= k
            return a

        return change

    without = [n for n in recorded.names if not n.startswith("grad ")]
    # each digest of a moment x k (its norm, max and samples), as the moments of gradients x 2 are
    scaled = replayed
    for k, cols in ((2.0, mu), (4.0, nu)):
        scaled = _changed(scaled, norm=times(k, cols), max=times(k, cols), samples=times(k, cols))
    comparison = compare_run(_only(recorded, without), _only(scaled, without))
    # the live check's rule reads the moments' factor (sqrt of the second's) when no gradient is compared
    assert comparison.codes[0] == "summed", comparison.cause
    assert (
        "optimizer moments are 2 x the reference's (its second moments 4 x: the square): the gradient reduction "
        "summed instead of averaged" in comparison.cause
    )


# ---------------------------------------------------------------------------------------- the command line


@require_devices(4)
def test_record_then_verify_against_passes_bitwise(tiny_run, tmp_path, capsys):
    size = tiny_run.stat().st_size
    assert 1_000 < size < 120_000, size  # small enough to commit
    out = tmp_path / "against.json"
    assert main(["verify", "--task", "tiny-lm", "--against", str(tiny_run), "--json", str(out)]) == 0
    report = _json(out)
    # the recorded run and mesh by default
    assert report["ok"] is True and list(report["strategies"]) == ["fsdp"]
    run = report["strategies"]["fsdp"]
    assert run["verdict"] == "PASS" and run["bitwise"] is True and run["steps"] == 3
    assert run["hashes_matched"] == run["hashes_compared"] > 3 * 40
    assert report["recorded"]["mesh"] == {"fsdp": 4} and report["recorded"]["settings"]["lr"] == 0.01
    text = " ".join(capsys.readouterr().out.split())
    assert "shardcheck verify fsdp against" in text and "PASS (bitwise identical)" in text
    assert "never bitwise across machines" in text


@require_devices(4)
def test_a_doubled_learning_rate_fails_at_step_0_on_a_parameter_update_of_2x(tiny_run, tmp_path):
    out = tmp_path / "against.json"
    args = ["verify", "--task", "tiny-lm", "--lr", "0.02", "--against", str(tiny_run), "--json", str(out)]
    assert main(args) == 1
    run = _json(out)["strategies"]["fsdp"]
    first = run["first_failure"]
    assert run["verdict"] == "FAIL" and first["step"] == 0 and first["name"].startswith("param ")
    assert first["ratio"] == pytest.approx(2.0, rel=0.01)
    # the live check's rules name the stage (the parameters: the loss, gradients and moments match); the
    # settings that differ from the recording's are named beside them
    assert run["codes"][0] == "localized", run["cause"]
    assert "the loss, the gradients and the optimizer state match; the parameters differ" in run["cause"]
    assert "The run's settings differ from the recording's (lr 0.01 -> 0.02)" in run["cause"]
    # the first failure is the first kind a step computes: the step-0 loss, gradients and Adam moments, which do
    # not depend on the rate, matched; the gradients differ from step 1 on (other parameters)
    assert run["worst_by_kind"]["grad"]["step"] >= 1


@require_devices(4)
def test_a_user_step_summing_for_a_mean_fails_at_step_0_on_a_gradient_of_s(tmp_path, capsys):
    steps = tmp_path / "my_steps.py"
    steps.write_text(STEPS)
    recording = tmp_path / "mine.npz"
    args = [*TINY, "--devices", "4"]
    assert main(["record", *args, "--candidate", f"{steps}:mean_step", "--out", str(recording)]) == 0
    assert "recorded mean_step on task tiny-lm" in capsys.readouterr().out
    out = tmp_path / "against.json"
    same = ["verify", *args, "--against", str(recording), "--json", str(out)]
    assert main([*same, "--candidate", f"{steps}:mean_step"]) == 0
    assert _json(out)["strategies"]["candidate"]["bitwise"] is True
    assert main([*same, "--candidate", f"{steps}:summed_step"]) == 1
    run = _json(out)["strategies"]["candidate"]
    first = run["first_failure"]
    assert (
        first["step"] == 0
        and first["name"].startswith("grad ")
        and first["ratio"] == pytest.approx(4.0, rel=1e-3)
    )
    assert run["codes"][0] == "summed", run["cause"]
    assert (
        "gradients are 4 x the reference's: the gradient reduction summed instead of averaged (x4: a sum over 4 "
        "shards)" in run["cause"]
    )
    assert "learning rate" not in run["cause"]  # Adam's update is not 4x; the gradients explain it
    # the recording keeps the step's spec: a replay without --candidate is told which to pass
    assert main(["verify", *args, "--against", str(recording)]) == 2
    assert f"pass it with --candidate {steps}:mean_step" in _one_line_error(capsys)


LINEAR_TASK = """
import jax
import numpy as np
import optax
from flax import nnx

import shardcheck
from shardcheck.losses import mse_batch_loss

rng = np.random.default_rng(0)
task = shardcheck.Task(
    model=lambda: nnx.Linear(3, 2, rngs=nnx.Rngs(0)),
    optimizer=optax.sgd(0.1),
    loss_fn=mse_batch_loss,
    batches=[(rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(8, 2)).astype(np.float32))],
    name="linear",
)


def _step(model, optimizer, batch, scale):
    loss, grads = nnx.value_and_grad(mse_batch_loss)(model, batch)
    grads = jax.tree.map(lambda g: scale * g, grads)
    optimizer.update(model, grads)
    return {"loss": loss, "grads": grads}


def mean_step(model, optimizer, batch):
    return _step(model, optimizer, batch, 1.0)


def summed_step(model, optimizer, batch):  # the 2 shards' gradients added where their mean was meant
    return _step(model, optimizer, batch, 2.0)
"""

# the fields a live check and a replay both give for the same facts (issue #36: one report type)
LIVE_FIELDS = {
    "ok",
    "verdict",
    "codes",
    "diagnosis",
    "localization",
    "worst_by_kind",
    "worst_leaf",
    "worst_step",
    "max_abs_err",
    "max_rel_err",
    "tolerance",
    "matmul_precision",
    "steps",
    "per_step",
}


@require_devices(2)
def test_a_live_check_and_a_replay_write_one_json_shape(tmp_path):
    """The same planted fault (a sum for a mean over 2 shards) checked live and replayed against a recording of the
    correct step: both documents hold ``strategies``, each entry with the live names, and agree on the verdict."""
    path = tmp_path / "linear.py"
    path.write_text(LINEAR_TASK)
    task = ["--task", f"{path}:task", "--devices", "2"]
    recording, live, replay = (tmp_path / n for n in ("mean.npz", "live.json", "replay.json"))
    assert main(["record", *task, "--candidate", f"{path}:mean_step", "--out", str(recording)]) == 0
    summed = ["--candidate", f"{path}:summed_step"]
    assert main(["verify", *task, *summed, "--strategies", "none", "--json", str(live)]) == 1
    assert main(["verify", *task, *summed, "--against", str(recording), "--json", str(replay)]) == 1
    documents = _json(live), _json(replay)
    assert all("runs" not in d and list(d["strategies"]) == ["candidate"] for d in documents)
    a, b = (d["strategies"]["candidate"] for d in documents)
    assert LIVE_FIELDS <= set(a) & set(b), LIVE_FIELDS - set(b)
    # one shape: every field of the live entry, and the replay's own fields beside
    assert set(a) <= set(b) and set(b) - set(a) == set(REPLAY_FIELDS), set(a) ^ set(b)
    assert (a["ok"], a["verdict"], a["codes"][0], a["steps"]) == (False, "FAIL", "summed", 1)
    assert (b["ok"], b["verdict"], b["codes"][0], b["steps"]) == (a["ok"], a["verdict"], a["codes"][0], 1)
    assert "summed instead of averaged (x2: a sum over 2 shards)" in a["diagnosis"]
    assert "summed instead of averaged (x2: a sum over 2 shards)" in b["diagnosis"]
    # the replay's worst leaf is its worst failing record's, with the live names; its digest evidence beside
    worst = b["worst_by_kind"][b["worst_leaf"].split(" ")[0]]
    assert (worst["leaf"], worst["step"], worst["ok"]) == (b["worst_leaf"], b["worst_step"], False)
    assert worst["max_abs_err"] == worst["err"] == b["max_abs_err"] > worst["tolerance"] == worst["allowed"]
    assert b["max_rel_err"] > 0 and b["worst_step"] == a["worst_step"] == 0
    # gradients x2: |max|2g| - max|g|| = max|g| = max|2g - g|, so the digest's error is the live one
    assert b["worst_leaf"] == a["worst_leaf"] == "grad kernel"
    assert b["max_abs_err"] == pytest.approx(a["max_abs_err"], rel=1e-6)
    # the replay's own fields stay: the first failure is a gradient of 2x at step 0
    first = b["first_failure"]
    assert first["step"] == 0 and first["name"].startswith("grad ") and first["ratio"] == pytest.approx(2.0)
    assert b["bitwise"] is False and b["recorded_run"] == "mean_step" and b["hashes_compared"] > 0
    assert {"bitwise", "first_failure", "cause", "placement_changes"}.isdisjoint(a)


@require_devices(4)
def test_a_replayed_step_that_returns_no_gradients_is_compared_on_the_rest(tmp_path):
    """The recording's step returned its gradients, the replayed one returns only its loss: the gradients are left
    out with a note, not read as a fault."""
    steps = tmp_path / "my_steps.py"
    steps.write_text(STEPS)
    recording = tmp_path / "mine.npz"
    args = [*TINY, "--devices", "4"]
    assert main(["record", *args, "--candidate", f"{steps}:mean_step", "--out", str(recording)]) == 0
    out = tmp_path / "against.json"
    verify = ["verify", *args, "--against", str(recording), "--json", str(out)]
    assert main([*verify, "--candidate", f"{steps}:loss_only_step"]) == 0
    run = _json(out)["strategies"]["candidate"]
    assert run["verdict"] == "PASS" and "grad" not in run["worst_by_kind"]
    assert set(run["worst_by_kind"]) == {"loss", "param", "opt_state", "counter"}
    assert any("holds gradients; this run's step returns none" in note for note in run["notes"])


def placed_step(loss_fn, split: bool, factor: float = 1.0):
    """A correct user step (``factor`` 1) that places the whole state itself on ``mesh``: every leaf ``P()``, or
    (``split``) each 2-D leaf whose columns divide by the fsdp axis ``P(None, 'fsdp')``; the same values either
    way. ``factor`` 2 on fsdp=2 is a planted sum for a mean."""
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def step(model, optimizer, batch, mesh):
        import jax

        def spec(x):
            return P(None, "fsdp") if split and x.ndim == 2 and x.shape[1] % mesh.shape["fsdp"] == 0 else P()

        state = nnx.state((model, optimizer))
        placed = jax.device_put(state, jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), state))
        nnx.update((model, optimizer), placed)
        loss, grads = nnx.value_and_grad(lambda m: loss_fn(m, batch))(model)
        grads = jax.tree.map(lambda g: factor * g, grads)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    return step


@pytest.fixture(scope="module")
def placement_runs():
    """diabetes' MLP under Adam on fsdp=2, 2 steps: the recording of the step placing every leaf P(); replays of
    the same values placed P(None, 'fsdp'), and of that placement with its gradients summed (x2)."""
    from shardcheck.mesh import make_mesh
    from shardcheck.parity.harness.recorded import record_run
    from shardcheck.tasks import load_task

    task = load_task("diabetes", model="mlp", hidden=8, optimizer="adam", batch_size=16, steps=2)
    mesh = make_mesh({"fsdp": 2})

    def run(split, factor=1.0):
        return record_run(task, placed_step(task.loss_fn, split, factor), mesh=mesh, steps=2)

    return run(False), run(True), run(True, 2.0)


@require_devices(2)
def test_a_placement_only_change_passes_with_a_note_naming_the_leaves(placement_runs):
    """A refactor that moves leaves from P() to P(None, 'fsdp') computes the same values: PASS, the changed
    leaves listed (recorded spec -> replayed spec) in a note and in placement_changes (issue #34: it FAILed with
    "changed sharding")."""
    from shardcheck.parity.comparison.digest import compare_run

    recorded, moved, _ = placement_runs
    comparison = compare_run(recorded, moved)
    assert comparison.ok and comparison.first_failure is None and comparison.cause is None
    assert all(e.ok and e.evidence != "sharding" for e in comparison.leaves)
    changes = comparison.placement_changes
    assert ("param hidden.kernel", "P()", "P(None, 'fsdp')") in changes
    assert ("grad hidden.kernel", "P()", "P(None, 'fsdp')") in changes
    assert all(was == "P()" and now != "P()" for _, was, now in changes)
    note = next(n for n in comparison.notes if n.startswith("Placement changed"))
    assert note.startswith(f"Placement changed on {len(changes)} leaves, values compared")
    assert "pin_placement=True, fails on it" in note
    assert "grad hidden.kernel: P() -> P(None, 'fsdp')" in note
    assert comparison.to_dict()["placement_changes"][0] == dict(
        zip(("leaf", "recorded", "replayed"), changes[0], strict=True)
    )
    # the same run against itself: nothing moved, no note
    same = compare_run(recorded, recorded)
    assert same.ok and same.placement_changes == () and not any("Placement" in n for n in same.notes)


@require_devices(2)
def test_a_pinned_placement_fails_naming_the_leaves_that_moved(placement_runs):
    from shardcheck.parity.comparison.digest import compare_run

    recorded, moved, _ = placement_runs
    comparison = compare_run(recorded, moved, pin_placement=True)
    first = comparison.first_failure
    assert not comparison.ok and comparison.pin_placement and first.evidence == "sharding"
    assert first.step == 0 and first.recorded == "P()" and first.replayed != "P()"
    assert {e.name for e in comparison.failures} == {name for name, _, _ in comparison.placement_changes}
    assert comparison.cause.startswith("The placement is pinned (--pin-placement, pin_placement=True) and ")
    assert "grad hidden.kernel: P() -> P(None, 'fsdp')" in comparison.cause
    assert not any(n.startswith("Placement changed") for n in comparison.notes)
    with pytest.raises(TypeError, match=r"compare_run: pin_placement must be True or False, got 'yes'"):
        compare_run(recorded, moved, pin_placement="yes")


def test_a_user_steps_leaves_left_on_one_device_are_said_as_such():
    """Trial 59: a pinned replay of a user step that placed its model, not the optimizer state shardcheck made
    unplaced, read "29 leaves changed sharding: P() -> single device" as if the step moved them."""
    from shardcheck.parity.comparison.digest import _left_unplaced

    moved = [
        ("opt_state 0.mu.w", "P()", "single device"),
        ("opt_state 0.mu.b", "P('model',)", "single device"),
    ]
    said = _left_unplaced(moved, {"run_kind": "candidate"})
    assert said.startswith(". shardcheck gives a user step its model and optimizer unplaced, on one device")
    assert "jax.device_put of nnx.state((model, optimizer)) with your shardings" in said
    assert _left_unplaced(moved, {"run_kind": "strategy"}) == ""  # a built-in places its state itself
    assert _left_unplaced([*moved, ("param w", "P()", "P('fsdp',)")], {"run_kind": "candidate"}) == ""


@require_devices(2)
@pytest.mark.parametrize("pin", [False, True])
def test_a_value_fault_beside_a_placement_change_fails_either_way(placement_runs, pin):
    """The gradients summed (x S = 2) and the placement changed: FAIL on the gradients, a sum for a mean named
    first, pinned or not."""
    from shardcheck.parity.comparison.digest import compare_run

    recorded, _, summed = placement_runs
    comparison = compare_run(recorded, summed, pin_placement=pin)
    first = comparison.first_failure
    assert not comparison.ok and (first.step, first.name.split(" ")[0]) == (0, "grad")
    assert first.evidence != "sharding" and first.ratio == pytest.approx(2.0, rel=1e-3)
    assert comparison.codes[0] == "summed" and comparison.cause.startswith(
        "At step 0, gradients are 2 x the reference's: the gradient reduction summed instead of averaged (x2"
    )
    assert ("The placement is pinned" in comparison.cause) is pin


PLACED_STEPS = textwrap.dedent(
    """
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from shardcheck.tasks.tiny_lm import lm_loss


    @nnx.jit
    def _update(model, optimizer, batch):
        def mean_loss(model):
            loss_sum, count = lm_loss(model, batch)
            return loss_sum / count

        loss, grads = nnx.value_and_grad(mean_loss)(model)
        optimizer.update(model, grads)
        return loss, grads


    def _placed(model, optimizer, batch, mesh, split):
        def spec(x):
            return P(None, "fsdp") if split and x.ndim == 2 and x.shape[1] % mesh.shape["fsdp"] == 0 else P()

        state = nnx.state((model, optimizer))
        shardings = jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), state)
        nnx.update((model, optimizer), jax.device_put(state, shardings))
        loss, grads = _update(model, optimizer, jax.device_put(batch, NamedSharding(mesh, P("fsdp"))))
        return {"loss": loss, "grads": grads}  # the gradients set the allowance of the attention key bias


    def replicated_step(model, optimizer, batch, mesh):
        return _placed(model, optimizer, batch, mesh, split=False)


    def split_step(model, optimizer, batch, mesh):
        return _placed(model, optimizer, batch, mesh, split=True)
    """
)


@require_devices(4)
def test_verify_against_passes_a_placement_change_and_pin_placement_fails_it(tmp_path, capsys):
    steps = tmp_path / "placed_steps.py"
    steps.write_text(PLACED_STEPS)
    recording = tmp_path / "replicated.npz"
    args = ["--task", "tiny-lm", "--steps", "2", "--mesh", "fsdp=4"]
    assert main(["record", *args, "--candidate", f"{steps}:replicated_step", "--out", str(recording)]) == 0
    out = tmp_path / "against.json"
    verify = ["verify", *args, "--against", str(recording), "--candidate", f"{steps}:split_step"]
    assert main([*verify, "--json", str(out)]) == 0
    run = _json(out)["strategies"]["candidate"]
    changes = run["placement_changes"]
    assert run["verdict"] == "PASS" and run["pin_placement"] is False and changes
    assert all(c["recorded"] == "P()" and c["replayed"] != "P()" for c in changes)
    assert any(n.startswith(f"Placement changed on {len(changes)} leaves") for n in run["notes"])
    capsys.readouterr()
    assert main([*verify, "--pin-placement", "--json", str(out)]) == 1
    run = _json(out)["strategies"]["candidate"]
    assert run["verdict"] == "FAIL" and run["pin_placement"] is True
    assert run["first_failure"]["evidence"] == "sharding"
    assert run["cause"].startswith("The placement is pinned (--pin-placement, pin_placement=True) and ")
    first = changes[0]
    assert f"{first['leaf']}: P() -> {first['replayed']}" in run["cause"]
    capsys.readouterr()
    assert main(["verify", *args, "--pin-placement"]) == 2
    assert (
        "shardcheck verify: --pin-placement pins a replay's placement to a recording's; pass --against"
        in (_one_line_error(capsys))
    )


@require_devices(4)
def test_a_user_task_file_records_and_replays(tmp_path):
    recording = tmp_path / "annotated.npz"
    args = ["--task", ANNOTATED, "--mesh", "data=2,fsdp=2"]
    assert main(["record", *args, "--steps", "2", "--out", str(recording)]) == 0
    out = tmp_path / "against.json"
    assert main(["verify", "--task", ANNOTATED, "--against", str(recording), "--json", str(out)]) == 0
    report = _json(out)
    assert report["task"] == "annotated-lm" and report["strategies"]["fsdp"]["bitwise"] is True
    assert report["recorded"]["mesh"] == {"data": 2, "fsdp": 2} and report["recorded"]["steps"] == 2


@require_devices(4)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--task", ANNOTATED],
            "records another task (it records task 'tiny-lm', this run's is 'annotated-lm'): another model or "
            "optimizer state (",
        ),
        # another task on another mesh: the task is the cause, said first; no --mesh that cannot make it replay
        (
            ["--task", ANNOTATED, "--mesh", "data=2,fsdp=2"],
            "records another task (it records task 'tiny-lm', this run's is 'annotated-lm'): another model or "
            "optimizer state (",
        ),
        # the same task on another mesh: the mesh, and the flag that replays it
        (
            ["--task", "tiny-lm", "--mesh", "data=2,fsdp=2"],
            "was recorded on mesh fsdp=4 (S=4), not data=2,fsdp=2 (S=4); replay it with --mesh fsdp=4",
        ),
        (["--task", "tiny-lm", "--batch-size", "8"], "recorded batch 0 as ['mask'] 16x32 float32"),
        (["--task", "tiny-lm", "--seed", "1"], "recorded other data at batch 0"),
        (["--task", "tiny-lm", "--steps", "4"], "holds 3 step(s), not 4; pass --steps 3 or fewer"),
    ],
)
def test_a_recording_of_another_run_is_refused_in_one_line(tiny_run, args, message, capsys):
    assert main(["verify", *args, "--against", str(tiny_run)]) == 2
    err = _one_line_error(capsys)
    # the first sentence names the cause
    assert err.startswith(f"error: shardcheck verify: --against {tiny_run} {message}"), err
    if "--mesh" in args and args[1] != "tiny-lm":  # another task: no mesh advice at all
        assert "--mesh" not in err and "mesh" not in err.split(";")[0], err


def _rewritten(source: Path, target: Path, **meta) -> Path:
    with np.load(source, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["meta"] = np.array(json.dumps(json.loads(str(arrays["meta"][()])) | meta))
    np.savez(target, **arrays)
    return target


@require_devices(4)
def test_a_damaged_or_foreign_file_is_refused_in_one_line(tiny_run, tmp_path, capsys):
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(tiny_run.read_bytes()[:500])
    other = tmp_path / "other.npz"
    np.savez(other, x=np.zeros(3))
    cases = [
        (garbage, "is a damaged shardcheck recording (a truncated .npz archive); record it again"),
        (other, "is not a shardcheck recording (no metadata)"),
        (
            _rewritten(tiny_run, tmp_path / "v99.npz", version=99),
            "format version 99; this shardcheck reads version 1",
        ),
        (_rewritten(tiny_run, tmp_path / "short.npz", steps=7), "is a damaged shardcheck recording"),
        (tmp_path / "missing.npz", "does not exist or is not a file"),
    ]
    for path, message in cases:
        assert main(["verify", "--task", "tiny-lm", "--against", str(path)]) == 2, path
        err = _one_line_error(capsys)
        assert err.startswith(f"error: shardcheck verify: --against {path} ") and message in err, err


@require_devices(4)
def test_files_of_another_kind_are_refused_naming_what_they_are(tiny_run, tmp_path, capsys):
    script = tmp_path / "steps.py"
    script.write_text("print('a python file')\n")
    text_meta = tmp_path / "text_meta.npz"
    with np.load(tiny_run, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    np.savez(text_meta, **(arrays | {"meta": np.array("not json")}))
    edited = tmp_path / "edited.npz"
    arrays["steps_norm"] = (
        arrays["steps_norm"] * 1.5
    )  # a digest changed after record wrote it, metadata intact
    np.savez(edited, **arrays)
    cases = [
        (
            script,
            "is not a shardcheck recording (not an .npz archive); record one with shardcheck record ... --out "
            "RUN.npz",
        ),
        (text_meta, "is not a shardcheck recording (its metadata is not JSON)"),
        (edited, "is a damaged shardcheck recording (its contents do not match its checksum"),
    ]
    for path, message in cases:
        assert main(["verify", "--task", "tiny-lm", "--against", str(path)]) == 2, path
        err = _one_line_error(capsys)
        assert message in err, err
    assert script.read_text() == "print('a python file')\n"


@require_devices(4)
def test_outputs_never_overwrite_what_the_command_reads(tiny_run, tmp_path, capsys):
    before = tiny_run.read_bytes()
    other = tmp_path / "other.npz"
    other.write_bytes(before)  # another recording, not read by this command: --json still leaves it alone
    assert main(["verify", "--task", "tiny-lm", "--against", str(tiny_run), "--json", str(other)]) == 2
    assert f"--json {other} exists and is not a JSON file" in _one_line_error(capsys)
    assert other.read_bytes() == before
    for flag, value in (("--rtol", "inf"), ("--atol", "-1")):
        assert main(["verify", "--task", "tiny-lm", "--against", str(tiny_run), flag, value]) == 2
        assert f"shardcheck verify: {flag} must be a number >= 0 and finite" in _one_line_error(capsys)
    assert main(["verify", "--task", "tiny-lm", "--against", str(tiny_run), "--strategies", "none"]) == 2
    assert "--strategies none and no --candidate leave nothing to replay" in _one_line_error(capsys)
    assert main(["verify", "--task", "tiny-lm", "--against", str(tiny_run), "--json", str(tiny_run)]) == 2
    assert f"--json {tiny_run} is the file --against reads" in _one_line_error(capsys)
    steps = tmp_path / "my_steps.py"
    steps.write_text(STEPS)
    args = ["verify", "--task", "tiny-lm", "--devices", "4", "--candidate", f"{steps}:mean_step"]
    assert main([*args, "--json", str(steps)]) == 2
    assert "is the file --candidate reads" in _one_line_error(capsys)
    for out, message in (
        (steps, "does not end in .npz (a recording is an .npz file); pass e.g."),
        (tmp_path / "noext", "does not end in .npz"),
    ):
        assert main(["record", *TINY, "--mesh", "fsdp=4", "--out", str(out)]) == 2
        assert f"shardcheck record: --out {out} {message}" in _one_line_error(capsys)
    assert tiny_run.read_bytes() == before and steps.read_text() == STEPS


@require_devices(4)
def test_a_corrupted_recording_is_named_damaged_and_settings_that_differ_are_named(
    tiny_run, tmp_path, capsys
):
    data = bytearray(tiny_run.read_bytes())
    data[3000] ^= 0xFF  # one byte of a compressed member: its CRC fails
    flipped = tmp_path / "flipped.npz"
    flipped.write_bytes(bytes(data))
    listed = tmp_path / "listed.npz"
    np.savez(listed, meta=np.array("[1, 2]"))
    for path, message in (
        (flipped, "is a damaged shardcheck recording"),
        (listed, "is not a shardcheck recording (its metadata is not a JSON object)"),
    ):
        assert main(["verify", "--task", "tiny-lm", "--against", str(path)]) == 2
        assert message in _one_line_error(capsys)
    assert main(["verify", "--task", "tiny-lm", "--optimizer", "sgd", "--against", str(tiny_run)]) == 2
    err = _one_line_error(capsys)
    assert "(the settings differ from the recording's: " in err and "optimizer 'adam' -> 'sgd'" in err
    out = tmp_path / "against.json"
    args = ["verify", "--task", "tiny-lm", "--compute-dtype", "bfloat16", "--against", str(tiny_run)]
    # the bfloat16 replay of the float32 recording, compared within the looser (bfloat16) rounding: it PASSes (it
    # FAILed on the attention key biases' rounding-level gradients until the replay measured their noise, trial
    # 14), and the settings that differ are named all the same
    assert main([*args, "--json", str(out)]) == 0
    run = _json(out)["strategies"]["fsdp"]
    assert run["verdict"] == "PASS"
    assert any(
        "The settings differ from the recording's: compute_dtype default -> 'bfloat16'" in n
        for n in run["notes"]
    )


def test_settings_a_task_file_leaves_to_itself_read_as_its_own_not_as_a_default():
    from shardcheck.parity.harness.recorded import settings_diff

    built_in = {"optimizer": "adam", "lr": 0.001, "batch_size": 8, "seed": 0}
    task_file = {"optimizer": None, "lr": None, "batch_size": None, "seed": 0}  # run_settings of a task file
    assert settings_diff(built_in, task_file) == [
        "optimizer 'adam' -> the task file's own",
        "lr 0.001 -> the task file's own",
        "batch_size 8 -> default",
    ]
    assert settings_diff(task_file, built_in, skip=("lr",)) == [
        "optimizer the task file's own -> 'adam'",
        "batch_size default -> 8",
    ]


def test_record_help_and_refusals_before_any_step(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["record", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "--strategy" in text
        and "--candidate" in text
        and "--out PATH.npz" in text
        and "verify --against" in text
    )
    out = str(tmp_path / "r.npz")
    assert main(["record", *TINY, "--candidate", "x.py:f", "--strategy", "dp", "--out", out]) == 2
    assert "were both given" in _one_line_error(capsys)
    assert main(["record", *TINY, "--steps", "0", "--out", out]) == 2
    assert "--steps must be a positive int, got 0" in _one_line_error(capsys)
    assert not Path(out).exists()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("task", "mesh"),
    [
        # a built-in task under launch (15 s) went the same path as the task file: the suite's time
        (["--task", ANNOTATED, "--steps", "2"], "data=2,fsdp=2"),  # a user's task file
    ],
    ids=["task-file"],
)
def test_record_and_verify_against_under_launch(tmp_path, task, mesh):
    """Recorded and replayed as 2 processes x 2 devices: process 0 writes the file; the hashes and samples are of
    its own shards, and the replay matches them bitwise."""
    import subprocess
    import sys

    launch = [sys.executable, "-m", "shardcheck", "launch", "--processes", "2", "--devices-per-process", "2"]
    launch += ["--timeout", "200", "--"]
    recording, out = tmp_path / "mp.npz", tmp_path / "mp.json"
    for argv in (
        ["record", *task, "--mesh", mesh, "--out", str(recording)],
        ["verify", *task, "--against", str(recording), "--json", str(out)],
    ):
        done = subprocess.run([*launch, *argv], capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
    report = _json(out)
    run = report["strategies"]["fsdp"]
    assert run["verdict"] == "PASS" and run["bitwise"] and report["recorded"]["platform"]["processes"] == 2
    assert any("the shards process 0 holds" in note for note in run["notes"])


@require_devices(4)
def test_a_recorded_step_is_named_as_the_command_line_names_it(tmp_path):
    """``--candidate FILE.py:ATTR`` is recorded as ``ATTR`` (the function's own ``__name__`` may be a factory's
    inner name): the zoo's ``step`` is ``_lm_steps.gspmd_step``. Its replay carries the same name, so the
    recording and the replay are one run (no 'placements differ by design' note)."""
    from shardcheck.parity.harness.recorded import load_recording

    zoo = Path(__file__).resolve().parents[1] / "examples" / "zoo" / "tied_lm.py"
    run = tmp_path / "tied.npz"
    task, mesh = ["--task", f"{zoo}:task"], ["--mesh", "data=2,fsdp=2"]
    assert (
        main(["record", *task, *mesh, "--candidate", f"{zoo}:step", "--out", str(run), "--steps", "1"]) == 0
    )
    assert load_recording(run).meta["run"] == "step"
    out = tmp_path / "replay.json"
    argv = ["verify", *task, "--against", str(run), "--candidate", f"{zoo}:step", "--strategies", "none"]
    assert main([*argv, "--steps", "1", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["strategies"]["candidate"]
    assert row["bitwise"] is True and not any("by design" in note for note in row["notes"])
