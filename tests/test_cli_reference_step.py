"""``verify --reference FILE.py:ATTR``: a reference step of the user's own from the command line (trial 37: a
mean-teacher EMA that the task's step never writes is not compared, and only Python's ``check_parity(...,
reference=step)`` could compare it)."""

import json
import textwrap

import pytest
from conftest import require_devices

from shardcheck.cli import main

TASK = textwrap.dedent(
    '''
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    import shardcheck


    class EMA(nnx.Variable):
        """The parameters' moving average: written by the step after the optimizer, read by no loss."""


    class Net(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
            self.ema = nnx.List([EMA(p) for p in jax.tree.leaves(nnx.state(self, nnx.Param))])

        def __call__(self, x):
            return self.lin(x)


    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


    rng = np.random.default_rng(0)
    task = shardcheck.Task(
        model=Net,
        optimizer=optax.sgd(0.1),
        loss_fn=loss_fn,
        batches=[
            {"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.normal(size=(8, 3)).astype(np.float32)}
            for _ in range(2)
        ],
    )


    def _ema(model, decay):
        for e, p in zip(model.ema, jax.tree.leaves(nnx.state(model, nnx.Param))):
            e[...] = decay * e[...] + (1 - decay) * p


    def ref_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        _ema(model, 0.9)
        return loss


    def _sharded(decay):
        @nnx.jit
        def train(model, optimizer, batch):
            loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
            optimizer.update(model, grads)
            _ema(model, decay)
            return loss

        def step(model, optimizer, batch, mesh):
            state = nnx.state((model, optimizer))
            nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh, P())))
            return train(model, optimizer, jax.device_put(batch, NamedSharding(mesh, P("data"))))

        return step


    step = _sharded(0.9)
    swapped = _sharded(0.1)  # (1 - d) * ema + d * p: the decay's two weights swapped
    '''
)


@pytest.fixture
def task_file(tmp_path):
    path = tmp_path / "ema_task.py"
    path.write_text(TASK)
    return path


def _verify(task_file, candidate, *extra):
    spec = f"{task_file}:"
    args = ["verify", "--task", spec + "task", "--candidate", spec + candidate, "--devices", "2"]
    return main([*args, "--strategies", "none", *extra])


@require_devices(2)
def test_a_reference_step_of_ones_own_compares_the_ema(task_file, capsys):
    # against the task's step the EMA is not compared: the swapped decay passes, and the note says so
    assert _verify(task_file, "swapped") == 0
    assert "not compared" in " ".join(capsys.readouterr().out.split())
    reference = f"{task_file}:ref_step"
    assert _verify(task_file, "step", "--reference", reference) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "candidate: PASS" in out and f"against {reference}" in out
    assert _verify(task_file, "swapped", "--reference", reference) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "state model.ema.0 (step 0)" in out or "state model.ema.1 (step 0)" in out, out
    assert "state_amount" in out


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        (
            "gspdm",
            "--reference 'gspdm' is neither one of reference, dp, fsdp, gspmd, multiprocess nor a step's "
            "FILE.py:ATTR or MODULE:ATTR; did you mean 'gspmd'?",
        ),
        ("{file}:no_such_step", "has no attribute 'no_such_step'"),
        ("{file}:task", "names a Task; pass a function (model, optimizer, batch)"),
        (  # trial 55: a step that takes a mesh was told "or (model, optimizer, batch, mesh) with mesh= given"
            "{file}:step",
            "it must take (model, optimizer, batch) and update model and optimizer in place: a reference step "
            "runs on one device, with no mesh (a step that takes a mesh is a candidate)",
        ),
    ],
)
def test_a_bad_reference_step_is_refused(task_file, capsys, reference, message):
    code = _verify(task_file, "step", "--reference", reference.format(file=task_file))
    captured = capsys.readouterr()
    assert code == 2
    assert message in " ".join(captured.err.split())


@require_devices(2)
def test_a_reference_of_ones_own_checks_the_candidate_alone_by_default(task_file, tmp_path, capsys):
    """Trial 39: with a reference step of the user's own, the built-in strategies (which run the task's step, not
    the user's sync) all FAILed 'the forward pass's writes were dropped'; they run only where --strategies names
    them, and without a candidate there is nothing to compare."""
    spec, out = f"{task_file}:", tmp_path / "r.json"
    args = ["verify", "--task", spec + "task", "--devices", "2", "--reference", spec + "ref_step"]
    assert main([*args, "--candidate", spec + "step", "--json", str(out)]) == 0
    assert list(json.loads(out.read_text())["strategies"]) == ["candidate"]
    capsys.readouterr()
    assert main(args) == 2
    assert (
        f"--reference {spec}ref_step is a step of your own, compared with --candidate; pass --candidate FILE.py:ATTR"
    ) in " ".join(capsys.readouterr().err.split())
