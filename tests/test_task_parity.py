"""The user's own task through every strategy and the harness: built-in tasks pass, user-written faults fail.

The faults are planted in a data-parallel step written the way users write one (``jax.shard_map`` over the
batch, ``lax.pcast`` of the replicated parameters, a reduction of the gradients, ``optimizer.update``), on the
tiny-lm task (int32 tokens, dict batches, padded rows, a token-weighted cross-entropy returned as (sum, count),
``nnx.MultiHeadAttention`` with biases, Adam).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices, small_lm_config
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardcheck
from shardcheck import Task, check_parity
from shardcheck.tasks import digits_task, load_task, tiny_lm_task
from shardcheck.tasks.tiny_lm import lm_loss

STRATEGIES = ("simulation", "dp", "fsdp", "accumulation")


@functools.cache
def lm(optimizer="adam", steps=4):
    """The one-block tiny-lm (conftest.small_lm_config)."""
    return tiny_lm_task(config=small_lm_config(), optimizer=optimizer, steps=steps, seed=0)


@require_devices(8)
@pytest.mark.parametrize(
    "strategy", ("accumulation",)
)  # dp, fsdp, gspmd (with Adam, sgd, clip + AdamW): test_topology; simulation: test_cli_task
def test_tiny_lm_passes_every_strategy_at_8_shards(strategy):
    report = check_parity(strategy, lm(), num_shards=8)
    assert report.ok, str(report)
    assert report.codes[0] == "parity"
    # the attention key biases have a true gradient of 0: recognised, reported, and not a false FAIL
    unresolved = {p for r in report.steps for p in r.unresolved}
    assert any(p.endswith("attn.key.bias") for p in unresolved), unresolved
    assert "rounding_level" in report.codes


@require_devices(8)
# sgd and clip + adamw on 2-D meshes: tests/test_topology.py
@pytest.mark.parametrize(("opt", "num_shards"), [("momentum", 8), ("adam", 2)])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_digits_passes_every_strategy(strategy, opt, num_shards):
    task = digits_task(optimizer=opt, steps=3, seed=0)
    report = check_parity(strategy, task, num_shards=num_shards)
    assert report.ok, str(report)
    assert report.steps[0].candidate_step_count == 1


@functools.cache
def diabetes(model, opt):
    return load_task("diabetes", model=model, optimizer=opt, steps=3)


@require_devices(8)
@pytest.mark.parametrize(("opt", "num_shards"), [("sgd", 8), ("adam", 2)])
@pytest.mark.parametrize("model", ["linear", "mlp"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_diabetes_task_passes_every_strategy(strategy, model, opt, num_shards):
    report = check_parity(strategy, diabetes(model, opt), num_shards=num_shards)
    assert report.ok and report.codes[0] == "parity", str(report)


def test_int_tokens_stay_int_and_dict_batches_are_kept():
    task = lm()
    batch = task.batches[0]
    assert set(batch) == {"tokens", "targets", "mask"}
    assert batch["tokens"].dtype == np.int32 and batch["targets"].dtype == np.int32
    assert task.terms(batch) == batch["tokens"].size  # the reduction length is B * T, not a y width


# ------------------------------------------------------------------- a user's data-parallel step, with faults


@nnx.jit  # the optimizer's update compiled, as in a user's jitted train step (eagerly, each op compiles alone)
def apply_update(model, optimizer, grads):
    optimizer.update(model, grads)


@functools.cache
def user_dp_step(fault=None):
    """A hand-written DP step: each device normalizes by the mean token count per shard, then pmean."""

    @functools.cache  # one compiled step per model structure and mesh, as a user's jitted step is
    def compiled(graphdef, mesh):
        s = mesh.shape["data"]

        @jax.jit
        @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
        def loss_and_grads(params, rest, batch):
            params = jax.lax.pcast(params, "data", to="varying")
            total_weight = jax.lax.psum(jnp.sum(batch["mask"]), "data")

            def local(p):
                total, weight = lm_loss(nnx.merge(graphdef, p, rest), batch)
                if fault == "per_shard_mean":
                    return total / weight  # each shard by its own token count
                return total / (total_weight / s)  # the shard's share of the global mean

            loss, grads = jax.value_and_grad(local)(params)
            if fault == "sum":
                grads = jax.lax.psum(grads, "data")
            elif fault == "mean_twice":
                grads = jax.tree.map(lambda g: g / s, jax.lax.pmean(grads, "data"))
            else:
                grads = jax.lax.pmean(grads, "data")
            return jax.lax.pmean(loss, "data"), grads

        return loss_and_grads

    def step(model, optimizer, batch, mesh):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        batch = jax.device_put(batch, jax.NamedSharding(mesh, P("data")))
        loss, grads = compiled(graphdef, mesh)(params, rest, batch)
        apply_update(model, optimizer, grads)
        return loss

    return step


@functools.partial(jax.jit, static_argnums=0)
def _shard_mean_and_grads(graphdef, params, rest, shard):
    def mean(p):
        total, weight = lm_loss(nnx.merge(graphdef, p, rest), shard)
        return total / weight

    return jax.value_and_grad(mean)(params)


def per_shard_optimizer_step(model, optimizer, batch, mesh):
    """The fault of stepping the optimizer once per shard, each on its own shard's mean."""
    s = mesh.shape["data"]
    b = batch["tokens"].shape[0] // s
    loss = 0.0
    for i in range(s):
        shard = jax.tree.map(lambda a, i=i: a[i * b : (i + 1) * b], batch)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        value, grads = _shard_mean_and_grads(graphdef, params, rest, shard)
        apply_update(model, optimizer, grads)
        loss += value / s
    return loss


@require_devices(8)
def test_a_users_correct_dp_step_passes():
    # the planted faults' task (two steps): the reference's compiled step is shared with them
    report = check_parity(user_dp_step(), lm(steps=2), mesh=shardcheck.make_mesh(8), num_shards=8)
    assert report.ok, str(report)


@require_devices(8)
@pytest.mark.parametrize(
    ("step", "code", "phrase"),
    [
        (user_dp_step("sum"), "summed", "summed instead of averaged (x8"),
        (user_dp_step("mean_twice"), "averaged_twice", "averaged twice"),
        (user_dp_step("per_shard_mean"), "normalization", "own weight (token count)"),
        (per_shard_optimizer_step, "step_counter", "stepped 8 times per step"),
    ],
    ids=["sum_for_mean", "mean_twice", "per_shard_token_mean", "stepped_per_shard"],
)
def test_planted_faults_fail_with_their_cause(step, code, phrase):
    report = check_parity(step, lm(steps=2), mesh=shardcheck.make_mesh(8), num_shards=8)
    assert not report.ok and report.verdict == "FAIL"
    assert code in report.codes, str(report)
    assert phrase in report.diagnosis, report.diagnosis


# ------------------------------------------------------------------------ the zero-gradient attention key bias


class Attention(nnx.Module):
    """The tutorials' self-attention block with default biases: softmax ignores the key bias."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(16, 8, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False, rngs=rngs)
        self.out = nnx.Linear(8, 16, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        return self.out(h + self.attn(h, mask=nnx.make_causal_mask(tokens)))


def attention_loss(model, batch):
    ce = optax.softmax_cross_entropy_with_integer_labels(model(batch["tokens"]), batch["targets"])
    return jnp.mean(ce)


def attention_task(steps=6):
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(steps):
        tokens = rng.integers(0, 16, size=(8, 6)).astype(np.int32)
        batches.append({"tokens": tokens, "targets": np.roll(tokens, -1, axis=1)})
    return Task(
        model=lambda: Attention(nnx.Rngs(0)),
        optimizer=optax.adam(3e-3),
        loss_fn=attention_loss,
        batches=batches,
    )


@require_devices(4)
def test_a_zero_gradient_key_bias_under_adam_is_no_false_fail():
    task = attention_task()
    model = task.new_model()
    grads = nnx.grad(attention_loss)(model, task.batches[0])
    # the key bias's true gradient is exactly 0; what is computed is rounding noise
    assert float(jnp.max(jnp.abs(grads["attn"]["key"]["bias"][...]))) < 1e-6
    report = check_parity("dp", task, num_shards=4)
    assert report.ok, str(report)
    assert len(report.steps) == 6
    assert "param attn.key.bias" in report.steps[0].unresolved and "rounding_level" in report.codes


@require_devices(4)
def test_a_fault_on_the_zero_gradient_model_still_fails():
    def sum_step(model, optimizer, batch):
        grads = nnx.grad(lambda m: 4 * attention_loss(m, batch))(model)  # a sum over 4 shards' means
        optimizer.update(model, grads)
        return attention_loss(model, batch)

    report = check_parity(sum_step, attention_task(), num_shards=4)
    assert not report.ok and "summed" in report.codes, str(report)


def test_a_zero_gradient_leaf_moved_ten_times_as_far_fails():
    """The parameters of a leaf whose gradient is rounding noise are allowed the sum of both sides' largest
    updates at a step that gets the update check (Adam turns noise into a step of either sign sized by each
    side's own noise: tests/test_rounding_floor.py), so an update 10x the optimizer's stays within its allowance
    against the reference (0.00484 of 0.00591) and fails the update check, naming the leaf and its form. (The
    sum without that check let a candidate's own divergence widen its tolerance: tests/kinked.py's flipped ReLU,
    whose step returns its loss alone, keeps twice the reference's update and still splits its trajectory.)"""

    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(attention_loss)(model, batch)
        before = model.attn.key.bias[...]
        optimizer.update(model, grads)
        model.attn.key.bias[...] = before + 10 * (model.attn.key.bias[...] - before)
        return {"loss": loss, "grads": grads}

    report = check_parity(step, attention_task(steps=2), num_shards=1)
    assert report.verdict == "FAIL" and report.first_worst.name == "update attn.key.bias", str(report)
    assert report.codes[0] == "update_rerun" and report.localization.form.kind == "factor", report.codes


# ------------------------------------------------------------------------------------------------ bad input


def test_task_bad_input_is_named():
    good = {"model": lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(0)), "optimizer": optax.sgd(0.1)}
    loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)  # noqa: E731
    batch = {"x": np.ones((4, 2), np.float32), "y": np.ones((4, 1), np.float32)}
    with pytest.raises(TypeError, match="Task: model must be a zero-argument callable"):
        Task(
            model=nnx.Linear(2, 1, rngs=nnx.Rngs(0)), optimizer=optax.sgd(0.1), loss_fn=loss, batches=[batch]
        )
    with pytest.raises(TypeError, match="Task: optimizer must be an optax.GradientTransformation"):
        Task(model=good["model"], optimizer="adam", loss_fn=loss, batches=[batch])
    with pytest.raises(ValueError, match="Task: batches is empty"):
        Task(**good, loss_fn=loss, batches=[])
    with pytest.raises(TypeError, match="Task: batches must be a sequence"):
        Task(**good, loss_fn=loss, batches=iter([batch]))
    with pytest.raises(
        ValueError, match=r"leaves differ in leading \(batch\) size: 'x' has 4 rows but 'y' has 3"
    ):
        Task(**good, loss_fn=loss, batches=[{"x": np.ones((4, 2)), "y": np.ones((3, 1))}])
    with pytest.raises(TypeError, match="factory returned int"):
        check_parity(
            "simulation",
            Task(model=lambda: 3, optimizer=optax.sgd(0.1), loss_fn=loss, batches=[batch]),
            num_shards=2,
        )
    with pytest.raises(ValueError, match="loss_fn returned a sequence of 3 values"):
        check_parity(
            "simulation",
            Task(**good, loss_fn=lambda m, b: (loss(m, b), 1.0, 2.0), batches=[batch]),
            num_shards=2,
        )
    with pytest.raises(ValueError, match="loss_fn returned weight of shape"):
        check_parity(
            "simulation",
            Task(**good, loss_fn=lambda m, b: (loss(m, b), b["x"][:, 0]), batches=[batch]),
            num_shards=2,
        )
    with pytest.raises(ValueError, match="loss_fn returned loss of shape"):
        check_parity(
            "simulation", Task(**good, loss_fn=lambda m, b: m(b["x"]), batches=[batch]), num_shards=2
        )
    with pytest.raises(ValueError, match="loss_fn returned a non-finite loss"):
        check_parity(
            "simulation",
            Task(**good, loss_fn=lambda m, b: jnp.log(-1.0 + 0 * loss(m, b)), batches=[batch]),
            num_shards=2,
        )
    with pytest.raises(ValueError, match="batch size 4 .* is not divisible by num_shards=3"):
        check_parity("dp", Task(**good, loss_fn=loss, batches=[batch]), num_shards=3)
    with pytest.raises(
        TypeError, match=r"candidate <lambda>\(model\) cannot be called as candidate\(model, optimizer, batch"
    ):
        check_parity(lambda model: None, Task(**good, loss_fn=loss, batches=[batch]), num_shards=2)

    # trial 58 D: a step of parameters swapped was called with the model as its batch, and read never_stepped
    def swapped(batch, model, optimizer):
        return None

    with pytest.raises(
        TypeError,
        match=r"candidate swapped\(batch, model, optimizer\) names its parameters \(batch, model, optimizer\), "
        r"but a step is called as candidate\(model, optimizer, batch\), positionally; reorder its parameters",
    ):
        check_parity(swapped, Task(**good, loss_fn=loss, batches=[batch]), num_shards=2)


# ---------------------------------------------------------------------------- a bfloat16 gradient all-reduce


@functools.cache
def reduce_in(dtype, reverse=False):
    """A DP step of the float32 tiny-lm task whose gradient all-reduce runs in ``dtype``, shard by shard in
    device order (or reversed): the bf16 reduction of public reports, made explicit."""

    @functools.cache  # one compiled step per model structure and mesh
    def compiled(graphdef, mesh):
        @jax.jit
        @functools.partial(
            jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P("data"))
        )
        def loss_and_grads(params, rest, batch):
            params = jax.lax.pcast(params, "data", to="varying")
            count = jax.lax.psum(jnp.sum(batch["mask"]), "data")

            def local(p):
                return lm_loss(nnx.merge(graphdef, p, rest), batch)[0] / count

            loss, grads = jax.value_and_grad(local)(params)

            def reduce(g):
                parts = jax.lax.all_gather(g.astype(dtype), "data")
                parts = parts[::-1] if reverse else parts
                total = parts[0]
                for i in range(1, parts.shape[0]):
                    total = (total + parts[i]).astype(dtype)
                return total.astype(g.dtype)[None]  # every device holds the same total

            return jax.lax.psum(loss, "data"), jax.tree.map(reduce, grads)

        return loss_and_grads

    def step(model, optimizer, batch, mesh):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        batch = jax.device_put(batch, jax.NamedSharding(mesh, P("data")))
        loss, stacked = compiled(graphdef, mesh)(params, rest, batch)
        grads = jax.tree.map(lambda a: a[0], stacked)
        optimizer.update(model, grads)
        return loss

    return step


@require_devices(8)
@pytest.mark.parametrize("reverse", [False, True], ids=["device_order", "reversed"])
def test_a_bf16_gradient_all_reduce_is_named_and_a_float32_one_passes(reverse):
    mesh = shardcheck.make_mesh(8)
    bad = check_parity(reduce_in(jnp.bfloat16, reverse), lm(steps=2), mesh=mesh, num_shards=8)
    assert bad.verdict == "FAIL" and bad.codes[0] == "low_precision_reduction", str(bad)
    message = " ".join(bad.diagnosis.split())
    assert "the gradients were likely all-reduced in bfloat16" in message and "reduce in float32" in message
    # trial 55: a correct step whose matmuls ran TF32, checked at float32, read this alone; the other reading
    assert "TF32 on a GPU, where the step runs so, is checked with --matmul-precision tf32" in message
    good = check_parity(reduce_in(jnp.float32, reverse), lm(steps=2), mesh=mesh, num_shards=8)
    assert good.ok, str(good)


# ------------------------------------------------------------------ any optax transformation, FSDP included


def llm_optimizer():
    """The optimizer of an LLM recipe: global-norm clipping, then AdamW on a warm-up + cosine schedule."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=2, decay_steps=10)
    return optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(schedule, weight_decay=0.1))


def without_grads(task):
    """The task's correct single-device step, returning its loss and no gradients."""

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: shardcheck.task.mean_loss(task.loss_fn, m, batch))(model)
        optimizer.update(model, grads)
        return loss

    return step


@require_devices(2)
def test_a_warm_up_from_zero_checked_for_one_step_names_the_schedule():
    """At lr 0 the parameters do not move and the binding clip keeps the moments blind to the gradient's scale: a
    step that returns no gradients, checked for its first step only, is CANNOT VERIFY, naming the schedule as
    the cause and more steps as the fix. The simulation returns its gradients, which show a factor of 2 either
    way (PASS); checked for two steps (the second at lr 1.5e-3), the correct step PASSes too."""
    task = load_task("digits", optimizer=llm_optimizer(), steps=1)
    report = check_parity(without_grads(task), task, num_shards=2)
    assert report.verdict == "CANNOT VERIFY", str(report)
    assert "did not move in any of the 1 steps" in report.cannot_verify
    assert "warm-up schedule" in report.cannot_verify and "verify --steps" in report.cannot_verify
    shown = check_parity("simulation", task, num_shards=2)
    assert shown.verdict == "PASS" and all(n.startswith("grad ") for n in shown.steps[0].scale_evidence[0])
    two = load_task("digits", optimizer=llm_optimizer(), steps=2)
    assert check_parity("simulation", two, num_shards=2).verdict == "PASS"


@require_devices(8)
@pytest.mark.parametrize(
    ("name", "strategy"),
    # dp, fsdp and gspmd on digits and an annotated transformer, on 2-D meshes: tests/test_topology.py
    [("digits", "simulation"), ("digits", "accumulation")],
)
def test_clipping_and_adamw_on_a_schedule_pass_every_strategy(name, strategy):
    """The clip binds at every step, so only a step whose gradients are compared can show their scale: every
    built-in strategy returns the gradients it applied (accumulation the mean of its micro-gradients) and
    PASSes, its evidence in the gradients."""
    task = load_task(name, optimizer=llm_optimizer(), steps=3)
    report = check_parity(strategy, task, num_shards=8)
    assert report.ok and report.verdict == "PASS", str(report)
    assert all(
        n.startswith("grad ") for n in report.steps[0].scale_evidence[0] + report.steps[0].scale_evidence[1]
    )
    # the clip is active: the reference's global gradient norm is above 0.1 at step 0
    model = task.new_model()
    grads = nnx.grad(lambda m: shardcheck.task.mean_loss(task.loss_fn, m, task.batches[0]))(model)
    assert float(optax.tree.norm(grads)) > 0.1


@require_devices(2)
def test_a_gradient_scale_that_binding_clipping_hides_is_not_a_pass():
    """Global-norm clipping that binds maps g, 2 g and g / 2 to one update: a sum for a mean (or a mean taken
    twice) reproduces the reference's parameters and moments exactly, which is CANNOT VERIFY, not PASS; a step
    whose gradients are compared, or a clip that does not bind, tells the fault apart."""

    def tx(clip):
        return optax.chain(optax.clip_by_global_norm(clip), optax.adam(1e-2))

    def scaled(task, c):
        def step(model, optimizer, batch):
            loss, grads = nnx.value_and_grad(lambda m: c * task.loss_fn(m, batch))(model)
            optimizer.update(model, grads)
            return loss / c

        return step

    binding = dataclasses.replace(digits_task(steps=2, batch_size=32), optimizer=tx(1e-3))
    for c in (2.0, 0.5):
        report = check_parity(scaled(binding, c), binding, num_shards=2)
        assert report.verdict == "CANNOT VERIFY" and report.codes == ("cannot_verify",), str(report)
        assert all(r.scale_hidden and r.ok for r in report.steps)
        assert "Cannot verify the gradient's scale" in report.cannot_verify
        assert "global-norm clipping that binds" in report.cannot_verify
    assert check_parity("simulation", binding, num_shards=2).verdict == "PASS"  # its gradients are compared
    loose = dataclasses.replace(binding, optimizer=tx(1e6))
    expected = {2.0: "summed", 0.5: "averaged_twice"}
    for c, code in expected.items():
        report = check_parity(scaled(loose, c), loose, num_shards=2)
        assert report.verdict == "FAIL" and code in report.codes, str(report)
        assert not any(r.scale_hidden for r in report.steps)

    def scaled_with_grads(c, loss_factor=1.0):  # the fault's gradients returned; its loss times loss_factor
        def step(model, optimizer, batch):
            loss, grads = nnx.value_and_grad(lambda m: c * binding.loss_fn(m, batch))(model)
            optimizer.update(model, grads)
            return {"loss": loss / c * loss_factor, "grads": grads}

        return step

    # under the binding clip the returned gradients show the factor, and the diagnosis says why the update hides it
    for c, code in expected.items():
        report = check_parity(scaled_with_grads(c), binding, num_shards=2)
        assert report.verdict == "FAIL" and report.codes[0] == code, str(report)
        assert "grads_differ" not in report.codes and "clipping that binds" in report.diagnosis, (
            report.diagnosis
        )
    # a loss off by 1/S with no gradients returned: named, with the gradients' scale left unseen
    report = check_parity(lambda m, o, b: scaled(binding, 0.5)(m, o, b) / 2, binding, num_shards=2)
    assert report.codes[0] == "loss_differs", str(report)
    message = " ".join(report.diagnosis.split())
    assert "It is 0.5 x the reference's: the loss was averaged twice" in message
    assert "the gradients may be off by the same factor" in message


@require_devices(2)
def test_a_mean_taken_twice_under_clipping_is_named_by_rerunning_the_optimizer():
    """A clip between |g| / 2 and |g| binds on the reference's gradient but not on half of it: the moments of a
    mean taken twice are then a distorted factor of the reference's (not 1/2), and the harness names the fault by
    rerunning the reference's optimizer on g / 2, which the candidate's state equals."""
    task = digits_task(steps=1, batch_size=32)
    model = task.new_model()
    norm = float(
        optax.tree.norm(
            nnx.grad(lambda m: shardcheck.task.mean_loss(task.loss_fn, m, task.batches[0]))(model)
        )
    )
    clipped = dataclasses.replace(
        task, optimizer=optax.chain(optax.clip_by_global_norm(0.75 * norm), optax.adam(1e-2))
    )

    def halved(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: clipped.loss_fn(m, batch) / 2)(model)
        optimizer.update(model, grads)
        return loss * 2

    report = check_parity(halved, clipped, num_shards=2)
    assert report.verdict == "FAIL" and report.codes[0] == "averaged_twice", str(report)
    assert report.steps[0].matches == ("times_1/S",)
    assert "averaged twice" in " ".join(report.diagnosis.split())
    moments = [e.ratio for e in report.steps[0].leaves if e.kind == "opt_state" and ".mu." in f".{e.path}."]
    assert all(abs(r - 0.5) > 0.05 for r in moments if r is not None)  # the clip distorted the factor


def _linear_task(schedule) -> Task:
    """A linear regression (8 -> 4, MSE) under SGD on ``schedule``, three batches of 8 rows."""
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(8, 8)).astype(np.float32), "y": rng.normal(size=(8, 4)).astype(np.float32)}
        for _ in range(3)
    ]
    return Task(
        model=lambda: nnx.Linear(8, 4, rngs=nnx.Rngs(0)),
        optimizer=optax.sgd(schedule),
        loss_fn=lambda model, b: jnp.mean((model(b["x"]) - b["y"]) ** 2),
        batches=batches,
        name="linear",
    )


@require_devices(2)
@pytest.mark.parametrize(
    ("schedule", "weak"),
    [
        (optax.linear_schedule(0.0, 0.1, 2), False),  # lr 0, 0.05, 0.1: the first update is exactly 0
        (optax.warmup_cosine_decay_schedule(0.0, 0.1, warmup_steps=2, decay_steps=10), False),
        (optax.linear_schedule(0.0, 1e-9, 2), True),  # every update far below the tolerance
        (1e-9, True),
    ],
)
def test_a_warm_up_from_zero_passes_without_the_weak_update_warning(schedule, weak):
    """Issue #34: every PASS of a run warming up linearly from lr 0 warned "the reference's first update ... is not
    larger than the tolerance". The warning is kept for a run whose updates are below tolerance at every step."""
    report = check_parity("dp", _linear_task(schedule), num_shards=2)
    assert report.ok and report.verdict == "PASS", str(report)
    assert report.steps[0].leaves and len(report.steps) == 3
    # step 0's update is exactly 0 under lr 0: below its tolerance (what the warning once read alone)
    first = next(e for e in report.steps[0].leaves if e.name == "param kernel")
    lr0 = float(schedule(0)) if callable(schedule) else schedule
    assert first.reference_change <= first.tolerance and (lr0 != 0.0 or first.reference_change == 0.0)
    assert report.codes == (("parity", "weak_check") if weak else ("parity",))
    if weak:
        assert "update at every one of the run's 3 steps of param " in report.diagnoses[1].message
