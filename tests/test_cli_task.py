"""``--task`` on the command line: a user's task file that imports a sibling module, with a user's own step.

The files are written as a user writes them: a model module (embeddings, causal self-attention with biases,
LayerNorm), a task file importing it (int32 tokens, dict batches with padded rows, a token-weighted
cross-entropy returned as (sum, count), Adam), and a steps file with a correct jitted GSPMD-free step and the
planted fault of normalizing every shard by its own token count.
"""

import json
import textwrap

import pytest
from conftest import require_devices

from shardcheck.cli import main

MODEL = textwrap.dedent(
    """
    import jax.numpy as jnp
    import optax
    from flax import nnx


    class TinyDecoder(nnx.Module):
        def __init__(self, vocab, width, rngs):
            self.embed = nnx.Embed(vocab, width, rngs=rngs)
            self.ln = nnx.LayerNorm(width, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=width, decode=False, rngs=rngs)
            self.head = nnx.Linear(width, vocab, rngs=rngs)

        def __call__(self, tokens, pad):
            mask = nnx.combine_masks(nnx.make_causal_mask(tokens), nnx.make_attention_mask(pad, pad))
            h = self.embed(tokens)
            h = h + self.attn(self.ln(h), mask=mask)
            return self.head(h)


    def loss_fn(model, batch):
        logits = model(batch["tokens"], batch["mask"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.sum(ce * batch["mask"]), jnp.sum(batch["mask"])
    """
)

TASK = textwrap.dedent(
    """
    import numpy as np
    import optax
    from flax import nnx

    import shardcheck
    from model import TinyDecoder, loss_fn  # a sibling module


    def batches(steps=3, b=16, t=8, vocab=24):
        rng = np.random.default_rng(0)
        out = []
        for _ in range(steps):
            tokens = rng.integers(1, vocab, size=(b, t)).astype(np.int32)
            mask = np.ones((b, t), np.float32)
            for i, n in enumerate(rng.integers(2, t + 1, size=b)):
                mask[i, n:] = 0
            tokens = np.where(mask > 0, tokens, 0).astype(np.int32)
            out.append({"tokens": tokens, "targets": np.roll(tokens, -1, axis=1), "mask": mask})
        return out


    task = shardcheck.Task(
        model=lambda: TinyDecoder(24, 16, nnx.Rngs(0)),
        optimizer=optax.adam(3e-3),
        loss_fn=loss_fn,
        batches=batches(),
        name="user-decoder",
    )
    """
)

STEPS = textwrap.dedent(
    """
    from functools import cache, partial

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from model import loss_fn


    @cache  # one compiled function per model structure, mesh and variant
    def _loss_and_grads(graphdef, mesh, per_shard):
        @jax.jit
        @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
        def grads(params, rest, batch):
            params = jax.lax.pcast(params, "data", to="varying")
            count = jax.lax.psum(jnp.sum(batch["mask"]), "data")

            def local(p):
                total, weight = loss_fn(nnx.merge(graphdef, p, rest), batch)
                return total / weight if per_shard else total / count

            loss, g = jax.value_and_grad(local)(params)
            if per_shard:
                return jax.lax.pmean(loss, "data"), jax.lax.pmean(g, "data")
            return jax.lax.psum(loss, "data"), jax.lax.psum(g, "data")

        return grads


    def _step(model, optimizer, batch, mesh, per_shard):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        batch = jax.device_put(batch, jax.NamedSharding(mesh, P("data")))
        loss, g = _loss_and_grads(graphdef, mesh, per_shard)(params, rest, batch)
        optimizer.update(model, g)
        return loss


    def good_step(model, optimizer, batch, mesh):
        return _step(model, optimizer, batch, mesh, per_shard=False)


    def per_shard_mean_step(model, optimizer, batch, mesh):
        return _step(model, optimizer, batch, mesh, per_shard=True)
    """
)


@pytest.fixture
def user_files(tmp_path):
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "task.py").write_text(TASK)
    (tmp_path / "steps.py").write_text(STEPS)
    return tmp_path


@require_devices(4)
def test_a_task_file_and_a_good_step_pass(user_files, capsys):
    out = user_files / "report.json"
    code = main(
        [
            "verify",
            "--task",
            f"{user_files / 'task.py'}:task",
            "--candidate",
            f"{user_files / 'steps.py'}:good_step",
            "--devices",
            "4",
            "--strategies",
            "dp,gspmd",
            "--json",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    assert code == 0, capsys.readouterr().out
    assert report["task"] == "user-decoder" and report["steps"] == 3
    assert set(report["strategies"]) == {"dp", "gspmd", "candidate"}
    assert all(r["verdict"] == "PASS" for r in report["strategies"].values())
    assert any(p.endswith("attn.key.bias") for p in report["strategies"]["candidate"]["unresolved"])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("missing.py:task", "does not exist"),
        ("broken.py:task", "importing task file"),
        ("task.py:nothing", "has no attribute 'nothing'"),
        ("task.py:nothing", "or define nothing = shardcheck.Task(model=..., optimizer=..."),
        ("no-such-builtin", "load_task"),
    ],
)
def test_bad_task_specs_exit_2_with_the_reason(user_files, capsys, spec, message):
    (user_files / "broken.py").write_text("import no_such_module_here\n")
    target = spec if spec == "no-such-builtin" else str(user_files / spec)
    code = main(["verify", "--task", target, "--devices", "2"])
    assert code == 2
    assert message in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--seed", "3"],
            "--seed 3 applies to the built-in tasks only (its model's nnx.Rngs seed its parameters)",
        ),
        (
            ["--dataset", "linnerud"],
            "--dataset linnerud applies to the built-in tasks only (it brings its own",
        ),
        (["--model", "mlp"], "--model mlp applies to the built-in tasks only (it builds its own model)"),
    ],
)
def test_a_flag_of_the_builtin_tasks_beside_a_task_file_is_refused(user_files, capsys, flags, message):
    """Trial 36: --seed 3 and --dataset linnerud beside a task file ran seed 0's check and exited 0."""
    code = main(["verify", "--task", f"{user_files / 'task.py'}:task", "--devices", "2", *flags])
    assert code == 2
    assert message in " ".join(capsys.readouterr().err.split())


@require_devices(2)
def test_a_builtin_task_against_a_recording_of_a_user_step_is_another_task(user_files, capsys):
    """Trial 40: a built-in --task against a recording of a task file's step was told to pass --candidate, and
    only after following that, that the recording is of another task: the task is said first."""
    task, out = f"{user_files / 'task.py'}:task", user_files / "rec.npz"
    step = f"{user_files / 'steps.py'}:good_step"
    args = ["--task", task, "--candidate", step, "--devices", "2", "--steps", "1"]
    assert main(["record", *args, "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["verify", "--task", "digits", "--against", str(out)]) == 2
    assert (
        "records another task (it records task 'user-decoder', this run's is 'digits'); replay it with the "
        in (" ".join(capsys.readouterr().err.split()))
    )


@require_devices(2)
def test_verify_takes_the_compute_dtype_of_a_builtin_task(tmp_path, capsys):
    out = tmp_path / "report.json"
    # the MLP task (tiny-lm under bfloat16: tests/test_precision.py and, all strategies at S = 8, docs/parity.md)
    args = ["verify", "--task", "digits", "--devices", "2", "--compute-dtype", "bfloat16"]
    code = main(
        [*args, "--strategies", "simulation", "--steps", "2", "--batch-size", "32", "--json", str(out)]
    )
    assert code == 0, capsys.readouterr().out
    report = json.loads(out.read_text())["strategies"]["simulation"]
    assert (
        report["verdict"] == "PASS"
        and "compute bfloat16: gradients + 4 * (max|g_S - g|" in report["tolerance_rule"]
    )
    assert main([*args[:3], "--compute-dtype", "bfloat16", "--task", "diabetes"]) == 2
    assert "--compute-dtype applies to --task digits or tiny-lm" in capsys.readouterr().err


@require_devices(2)
def test_a_task_files_compute_dtype_policy_is_said_beside_the_matmul_precision(user_files, capsys):
    """Trial 16: --compute-dtype bfloat16 on a float32 task file widened the tolerances and the output never said
    bfloat16; the setup line says the policy and that the file's model keeps its own dtypes (without the flag it
    says nothing of a compute dtype)."""
    args = ["verify", "--task", f"{user_files / 'task.py'}:task", "--devices", "2", "--strategies", "gspmd"]
    said = (
        "compute dtype bfloat16 (--compute-dtype: the tolerances' policy; the task file's model computes in the "
        "dtypes it is written with, so a fault below that dtype's rounding passes)"
    )
    assert main([*args, "--steps", "1", "--compute-dtype", "bfloat16"]) == 0
    assert said in " ".join(capsys.readouterr().out.split())
    assert main([*args, "--steps", "1"]) == 0
    assert "compute dtype" not in " ".join(capsys.readouterr().out.split())


@require_devices(4)
def test_a_loss_divided_by_each_shards_own_count_is_named_live_and_replayed(user_files, capsys):
    """The mean of per-shard means (each shard divides its loss sum by its own token count, then the shards are
    averaged): ``normalization`` live, and replayed from a recording (trial 11: named live, a generic 'computed
    or reduced differently' replayed); the correct step PASSes the same replay."""
    task = f"{user_files / 'task.py'}:task"
    run = user_files / "run.npz"
    common = ["--task", task, "--devices", "4", "--steps", "2"]
    assert main(["record", *common, "--out", str(run)]) == 0
    codes = {}
    for kind, extra in (("live", ["--strategies", "none"]), ("replayed", ["--against", str(run)])):
        for step in ("per_shard_mean_step", "good_step"):
            out = user_files / f"{kind}-{step}.json"
            candidate = f"{user_files / 'steps.py'}:{step}"
            main(["verify", *common, "--candidate", candidate, *extra, "--json", str(out)])
            codes[kind, step] = json.loads(out.read_text())["strategies"]["candidate"]
    capsys.readouterr()
    for kind in ("live", "replayed"):
        assert codes[kind, "good_step"]["verdict"] == "PASS"
        assert codes[kind, "per_shard_mean_step"]["verdict"] == "FAIL"
        assert "normalization" in codes[kind, "per_shard_mean_step"]["codes"], codes[
            kind, "per_shard_mean_step"
        ]
