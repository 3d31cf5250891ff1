"""Trial 40 and 37's readings (issue #36): an accumulation's micro-batch means averaged under a ``(sum, count)``
loss, a returned loss off by one constant factor at every step, an EMA written from the parameters before the
update, and ``replicas_compared`` in ``verify --json`` live and replayed. Small tasks of their own, 2-4 fake
devices."""

from __future__ import annotations

import json
import textwrap

from conftest import require_devices

from shardcheck.cli import main

LINEAR_TASK = textwrap.dedent(
    """
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


    def summed_step(model, optimizer, batch):
        return _step(model, optimizer, batch, 2.0)


    def placed_step(model, optimizer, batch, mesh):
        # the mean step on state it places itself: every leaf replicated, or (SPLIT) the kernel's columns split
        # over the mesh's first axis
        from jax.sharding import NamedSharding, PartitionSpec as P

        def spec(x):
            return P(None, mesh.axis_names[0]) if SPLIT and x.ndim == 2 else P()

        state = nnx.state((model, optimizer))
        nnx.update((model, optimizer), jax.device_put(state, jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), state)))
        return _step(model, optimizer, batch, 1.0)


    SPLIT = False
    """
)


@require_devices(2)
def test_replicas_compared_is_in_the_json_live_and_replayed(tmp_path):
    """Each strategy's JSON entry says how many replicated leaves had their copies compared across how many
    devices: live, the candidate's parameters and optimizer state after each step (kernel and bias; sgd keeps no
    arrays); replayed, the leaves the replay's own run compared and recorded (``meta["replicas"]``: the counter
    too). Split state (the kernel's columns over the mesh, the update's bias following it) holds no copies, and one
    device none: nothing compared (``null``)."""
    path, split = tmp_path / "linear.py", tmp_path / "split.py"
    path.write_text(LINEAR_TASK)
    split.write_text(LINEAR_TASK.replace("SPLIT = False", "SPLIT = True"))
    task = ["--task", f"{path}:task", "--devices", "2"]
    recording, live, replay, one, cut = (
        tmp_path / n for n in ("mean.npz", "live.json", "replay.json", "one.json", "split.json")
    )
    placed = ["--candidate", f"{path}:placed_step"]
    assert main(["record", *task, *placed, "--out", str(recording)]) == 0
    assert main(["verify", *task, *placed, "--strategies", "none", "--json", str(live)]) == 0
    assert main(["verify", *task, *placed, "--against", str(recording), "--json", str(replay)]) == 0
    split_args = ["--task", f"{split}:task", "--devices", "2", "--candidate", f"{split}:placed_step"]
    assert main(["verify", *split_args, "--strategies", "none", "--json", str(cut)]) == 0
    one_args = ["--task", f"{path}:task", "--devices", "1", "--candidate", f"{path}:mean_step"]
    assert main(["verify", *one_args, "--strategies", "none", "--json", str(one)]) == 0
    a, b, c, d = (json.loads(p.read_text())["strategies"]["candidate"] for p in (live, replay, cut, one))
    assert a["replicas_compared"] == {"leaves": 2, "devices": 2, "steps": 1}
    assert b["replicas_compared"] == {"leaves": 3, "devices": 2, "steps": 1}
    assert c["replicas_compared"] is None  # nothing held copies to compare
    assert d["replicas_compared"] is None
