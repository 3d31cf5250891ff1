"""Trial 43: the memory figure of an annotated model whose biases and LayerNorm scales are not annotated.

A Perceiver's kernels were annotated ``(None, "fsdp")``, its biases and LayerNorm scales were not (the user's steps
held them replicated, ``P()``), on data=2,fsdp=2. ``shardcheck memory --measure`` said 12,488 B of parameters a
device, est / measured 1.0000, for ``fsdp`` and for ``--strategy gspmd`` alike: every leaf split in two, where the
layout the annotations place (the GSPMD step's, the shard_map step's) holds 13,456 B. ``gspmd`` now places the
annotations alone; ``fsdp`` keeps its rule and says what it splits beyond the annotations.

Hand counts, float32 = 4 B, on data=2 x fsdp=2 (an annotated dimension splits in two; the data axis holds copies):

==============  =======  ==========  ========================  =========================
leaf            shape    annotated   annotations (gspmd)       FSDP rule (fsdp)
==============  =======  ==========  ========================  =========================
up.kernel       (8, 16)  (None, f)   (8, 8) = 64 floats        64
up.bias         (16,)    no          16 (replicated)           8
norm.scale      (16,)    no          16                        8
norm.bias       (16,)    no          16                        8
down.kernel     (16, 4)  (None, f)   (16, 2) = 32              32
down.bias       (4,)     no          4                         2
==============  =======  ==========  ========================  =========================

Parameters a device: gspmd 148 floats = 592 B, fsdp 122 floats = 488 B. Adam holds two moments placed as their
parameter and an int32 count (4 B); NNX's step counter is 4 B. Persistent: gspmd 592 + (4 + 2 * 592) + 4 = 1784 B,
fsdp 488 + (4 + 2 * 488) + 4 = 1472 B.
"""

import json

import jax
from conftest import require_devices
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardcheck import Task, estimate_memory, measure_memory
from shardcheck.cli import main
from shardcheck.memory import measure_step
from shardcheck.mesh import make_mesh

MESH = {"data": 2, "fsdp": 2}
GSPMD_PARAMS, GSPMD_PERSISTENT = 148 * 4, 148 * 4 + 4 + 2 * 148 * 4 + 4
FSDP_PARAMS, FSDP_PERSISTENT = 122 * 4, 122 * 4 + 4 + 2 * 122 * 4 + 4
UNANNOTATED = ("up.bias", "norm.scale", "norm.bias", "down.bias")

TASK_FILE = """
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import shardcheck

ANNOTATED = ANNOTATED_FLAG


def kernel():
    init = nnx.initializers.lecun_normal()
    return nnx.with_partitioning(init, (None, "fsdp")) if ANNOTATED else init


class Net(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(8, 16, kernel_init=kernel(), rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.down = nnx.Linear(16, 4, kernel_init=kernel(), rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.norm(self.up(x))))


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


SMOOTH = 0.1


@nnx.jit
def _train(model, optimizer, batch):
    optimizer.update(model, nnx.grad(loss_fn)(model, batch))


def gspmd_step(model, optimizer, batch, mesh):
    state = nnx.state((model, optimizer))
    nnx.update((model, optimizer), jax.device_put(state, nnx.get_named_sharding(state, mesh)))
    spec = jax.sharding.PartitionSpec(("data", "fsdp"))
    _train(model, optimizer, jax.device_put(batch, jax.sharding.NamedSharding(mesh, spec)))


rng = np.random.default_rng(0)
task = shardcheck.Task(
    model=lambda: Net(nnx.Rngs(0)),
    optimizer=optax.adam(1e-2),
    loss_fn=loss_fn,
    batches=[{"x": rng.normal(size=(8, 8)).astype(np.float32), "y": rng.normal(size=(8, 4)).astype(np.float32)}],
    name="net",
)
"""


def _task(annotated: bool = True) -> Task:
    namespace: dict = {}
    exec(TASK_FILE.replace("ANNOTATED_FLAG", str(annotated)), namespace)
    return namespace["task"]


def _params(est) -> dict:
    return {leaf.path: leaf for leaf in est.leaves if leaf.category == "params"}


def test_gspmd_places_the_annotations_alone_and_fsdp_its_rule():
    task = _task()
    gspmd = estimate_memory(task, mesh=MESH, strategy="gspmd")
    fsdp = estimate_memory(task, mesh=MESH, strategy="fsdp")
    assert (gspmd.params_bytes, gspmd.persistent_bytes) == (GSPMD_PARAMS, GSPMD_PERSISTENT)
    assert (fsdp.params_bytes, fsdp.persistent_bytes) == (FSDP_PARAMS, FSDP_PERSISTENT)
    g, f = _params(gspmd), _params(fsdp)
    for path in UNANNOTATED:  # whole under gspmd, halved by the rule under fsdp
        assert not g[path].sharded and g[path].per_device_bytes == g[path].global_bytes
        assert g[path].replicated_reason == "not annotated: gspmd places the model's annotations alone"
        assert f[path].sharded and f[path].per_device_bytes == f[path].global_bytes // 2
    for path in ("up.kernel", "down.kernel"):  # annotated: the same split under both
        assert g[path].shard_shape == f[path].shard_shape and g[path].split_axes == ("fsdp",)
    opt = {leaf.path: leaf for leaf in gspmd.leaves if leaf.category == "optimizer"}
    assert not opt["0.mu.up.bias"].sharded and opt["0.mu.up.kernel"].shard_shape == (8, 8)
    grads = {leaf.path: leaf for leaf in gspmd.leaves if leaf.category == "grads"}
    assert not grads["up.bias"].sharded and grads["up.kernel"].sharded


def test_a_model_without_annotations_is_placed_by_the_rule_under_gspmd_too():
    """The other side: no annotation at all, so gspmd is fsdp's layout (kernels (8, 16) -> (4, 16) and (16, 4) ->
    (8, 4) by the rule: every leaf halved, 244 / 2 floats = 488 B)."""
    task = _task(annotated=False)
    gspmd = estimate_memory(task, mesh=MESH, strategy="gspmd")
    assert gspmd.leaves == estimate_memory(task, mesh=MESH, strategy="fsdp").leaves
    assert gspmd.params_bytes == 244 // 2 * 4


@require_devices(4)
def test_measured_gspmd_and_a_user_step_placed_by_its_annotations_agree_with_the_estimate():
    task, mesh = _task(), make_mesh(MESH)
    measured = measure_memory(task, strategy="gspmd", mesh=mesh)
    assert measured.state_bytes == GSPMD_PERSISTENT and measured.accuracy_ratio == 1.0

    @nnx.jit
    def train(model, optimizer, batch):
        grads = nnx.grad(task.loss_fn)(model, batch)
        optimizer.update(model, grads)

    def user_step(model, optimizer, batch, mesh):  # the Flax NNX sharding guide's placement
        state = nnx.state((model, optimizer))
        nnx.update((model, optimizer), jax.device_put(state, nnx.get_named_sharding(state, mesh)))
        train(model, optimizer, jax.device_put(batch, NamedSharding(mesh, P(("data", "fsdp")))))

    user = measure_step(user_step, task, mesh)  # strategy="gspmd": the estimate beside it
    assert user.state_bytes == GSPMD_PERSISTENT and user.placement_differs == ()
    fsdp = measure_step(user_step, task, mesh, strategy="fsdp")  # the rule's layout: the user's biases differ
    assert fsdp.placement_bytes == GSPMD_PERSISTENT - FSDP_PERSISTENT
    assert "up.bias: P() holds 64 B a device (the estimate's P('fsdp',): 32 B)" in fsdp.placement_differs
    assert len(fsdp.placement_differs) == 4 * 3  # each unannotated parameter and its two Adam moments


@require_devices(4)
def test_the_fsdp_report_says_what_its_rule_splits_beyond_the_annotations(tmp_path, capsys):
    f = tmp_path / "net_task.py"
    f.write_text(TASK_FILE.replace("ANNOTATED_FLAG", "True"))
    assert (
        main(["memory", "--task", f"{f}:task", "--mesh", "data=2,fsdp=2", "--json", str(tmp_path / "m.json")])
        == 0
    )
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "fsdp also splits 4 unannotated parameters that the model's annotations leave replicated (down.bias, "
        "norm.scale, norm.bias, up.bias) by the FSDP rule" in out
    )
    assert f"params {FSDP_PARAMS:,} B a device, persistent {FSDP_PERSISTENT:,} B" in out
    assert f"params {GSPMD_PARAMS:,} B a device, persistent {GSPMD_PERSISTENT:,} B; --strategy gspmd" in out
    rule = json.loads((tmp_path / "m.json").read_text())["strategies"]["fsdp"]["unannotated_split"]
    assert rule["count"] == 4 and rule["annotations_params_bytes"] == GSPMD_PARAMS
    # gspmd itself: the annotations' figure, no note
    assert main(["memory", "--task", f"{f}:task", "--mesh", "data=2,fsdp=2", "--strategy", "gspmd"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "│ gspmd │ 4 │ 592 B │ 592 B │" in out and "fsdp also splits" not in out
    # no annotations: nothing to say
    f.write_text(TASK_FILE.replace("ANNOTATED_FLAG", "False"))
    assert main(["memory", "--task", f"{f}:task", "--mesh", "data=2,fsdp=2"]) == 0
    assert "also splits" not in capsys.readouterr().out


# ------------------------------------------------------------------ finding 2: argument messages with their fix


def test_a_spec_naming_a_float_says_what_a_step_is_and_the_file_s_steps(tmp_path, capsys):
    f = tmp_path / "net_task.py"
    f.write_text(TASK_FILE.replace("ANNOTATED_FLAG", "True"))
    assert (
        main(["verify", "--task", f"{f}:task", "--candidate", f"{f}:SMOOTH", "--mesh", "data=2,fsdp=2"]) == 2
    )
    err = " ".join(capsys.readouterr().err.split())
    assert (
        f"'{f}:SMOOTH' names a float, not a step; a step is a function step(model, optimizer, "
        in err
    )
    assert f"did you mean {f}:gspmd_step (the file's functions that take a step's arguments)?" in err
    assert ":loss_fn" not in err and ":kernel" not in err  # (model, batch) and () are no step's arguments


def test_an_uneven_annotation_and_an_uneven_batch_are_both_named(tmp_path, capsys):
    """data=2,fsdp=3: the kernels' 16 columns do not split in 3 (the step raises on them first), and the batch's
    8 rows do not split over 6 devices: the refusal names both (trial 43 named the leaf alone)."""
    f = tmp_path / "net_task.py"
    f.write_text(TASK_FILE.replace("ANNOTATED_FLAG", "True"))
    args = ["verify", "--task", f"{f}:task", "--candidate", f"{f}:gspmd_step", "--strategies", "none"]
    assert main([*args, "--mesh", "data=2,fsdp=3"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "leaf 'down.kernel' of shape (16, 4) is annotated P(None, 'fsdp'): dimension 1 (4) does not split"
        in (err)
        or "leaf 'up.kernel' of shape (8, 16)" in err
    )
    assert "; and the batch's 8 rows do not split over the 6 devices of the mesh" in err


# ------------------------------------------------------------------ finding 3: refused before JAX and the task


def _cli_in_fresh_process(tmp_path, *argv: str) -> tuple[str, str]:
    """``(stdout, stderr)`` of ``shardcheck.cli.main(argv)`` in a fresh interpreter that prints the exit status
    and whether JAX was imported."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom shardcheck.cli import main\ntry:\n    rc = main(sys.argv[1:])\n"
        "except SystemExit as e:\n    rc = e.code\nprint(rc, 'jax' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=tmp_path)
    return done.stdout.strip(), " ".join(done.stderr.split())


def test_bad_steps_a_missing_file_and_a_malformed_mesh_are_refused_before_jax(tmp_path):
    f = tmp_path / "net_task.py"
    f.write_text(TASK_FILE.replace("ANNOTATED_FLAG", "True"))
    task = ["--task", f"{f}:task", "--candidate", f"{f}:gspmd_step"]
    out, err = _cli_in_fresh_process(tmp_path, "verify", *task, "--steps", "0")
    assert out == "2 False"
    assert (
        "shardcheck verify: --steps must be a positive int, got 0; pass --steps 1 or more (at most the task's "
        "number of batches" in err
    )
    out, err = _cli_in_fresh_process(
        tmp_path, "verify", "--task", f"{f}:task", "--candidate", "nofile.py:step"
    )
    assert out == "2 False"
    assert (
        "shardcheck verify: --candidate: candidate file 'nofile.py' (spec 'nofile.py:step') does not exist"
        in err
    )
    out, err = _cli_in_fresh_process(tmp_path, "record", "--task", "nofile.py:task", "--out", "r.npz")
    assert (
        out == "2 False" and "load_task: task file 'nofile.py' (spec 'nofile.py:task') does not exist" in err
    )
    out, err = _cli_in_fresh_process(tmp_path, "memory", "--task", "nofile.py:task", "--mesh", "fsdp=2")
    assert out == "2 False" and "load_task: task file 'nofile.py'" in err
    out, err = _cli_in_fresh_process(tmp_path, "verify", *task, "--mesh", "data=2,fsdp")
    assert out == "2 False" and "argument --mesh: 'fsdp' is not NAME=SIZE with SIZE >= 1" in err
    # the other side: good arguments go on to load JAX and the task (here to --steps 2 of 1 batch, refused there)
    out, err = _cli_in_fresh_process(tmp_path, "verify", *task, "--mesh", "data=2", "--steps", "5")
    assert out == "2 True" and err


def test_a_spec_naming_an_int_says_an_int(tmp_path, capsys):
    """Trial 51 read "names a int, not a step"."""
    f = tmp_path / "net_task.py"
    f.write_text(TASK_FILE.replace("ANNOTATED_FLAG", "True") + "\nLAYERS = 2\n")
    assert main(["verify", "--task", f"{f}:task", "--candidate", f"{f}:LAYERS", "--mesh", "data=2,fsdp=2"]) == 2
    assert f"'{f}:LAYERS' names an int, not a step; a step is a function" in " ".join(capsys.readouterr().err.split())


def test_a_task_file_that_cannot_give_its_task_is_named_by_its_flag(tmp_path, capsys):
    """Trial 51: "error: load_task: calling empty() of ... raised ValueError" named no flag."""
    f = tmp_path / "broken.py"
    f.write_text("def empty():\n    raise ValueError('no batches yet')\n")
    assert main(["verify", "--task", f"{f}:empty", "--devices", "2"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith(f"error: --task {f}:empty: load_task: calling empty() of ") and "no batches yet" in err
