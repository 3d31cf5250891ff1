"""Trials 28 and 29 (issue #36): the likely cause said beside a step that raised.

- Trial 29: an unreduced gradient made ``optax.apply_if_finite``'s ``lax.cond`` raise "branches must have equal
  output types" on a data=4 mesh, and the hint blamed the model's annotations over 'fsdp' (which the correct
  step, placing nothing by them, never used): the annotations are a likely cause only of an error about placement.
- Trial 28: "the batch's 16 rows do not split over the 6 devices" for an IndivisibleError on a (3, 32) stacked
  LayerNorm bias over fsdp=3: an error naming the full shape of a leaf the batch lacks is not the batch's.
"""

import numpy as np
import pytest

from shardcheck.parity.harness.candidates import _about_placement, _names_other_shape, _varying_hint

INDIVISIBLE = (
    "Sharding NamedSharding(mesh=Mesh('data': 2, 'fsdp': 3, axis_types=(Auto, Auto)), spec=P(None, 'fsdp'), "
    "memory_kind=device) implies that array axis 1 is partitioned 3 times, but the dimension size is 32 (full "
    "shape: (3, 32), per-dimension tiling factors: [1, 3] should evenly divide the shape)"
)
COND = (
    "cond branches must have equal output types but they differ.\n\ntrue_fun is do_update at optax ...: the "
    "output of true_fun at path [1][1][0].mu['head']['bias'] has type float32[10] but the corresponding output "
    "of false_fun has type bfloat16[10], so the dtypes do not match"
)
VARYING = (
    "cond branches must have equal output types but they differ.\n\n  * the output of true_fun at path "
    "[0]['l1']['bias'] has type float32[64]{V:data} but the corresponding output of false_fun has type "
    "float32[64], so the manual axis types do not match;\n  * the output of true_fun at path [0]['l2']['bias'] "
    "has type float32[64]{V:data} but ..., so the manual axis types do not match"
)


@pytest.mark.parametrize(
    "err, placement",
    [
        (ValueError(INDIVISIBLE), True),
        (ValueError("Resource axis: data of P('data',) is not found in mesh: ('foo',)."), True),
        (KeyError("fsdp"), True),
        (TypeError(COND), False),
        (TypeError(VARYING), False),
    ],
)
def test_only_an_error_about_placement_may_blame_the_annotations(err, placement):
    assert _about_placement(err) is placement


def test_an_uneven_split_of_another_shape_is_not_the_batchs():
    batch = {"tokens": np.zeros((16, 8), np.int32), "mask": np.ones((16, 8), np.float32)}
    assert _names_other_shape(ValueError(INDIVISIBLE), batch)
    assert not _names_other_shape(ValueError(INDIVISIBLE.replace("(3, 32)", "(16, 8)")), batch)
    assert not _names_other_shape(ValueError("no shape named"), batch)


def test_values_varying_over_an_axis_are_said_as_left_unreduced():
    hint = _varying_hint(TypeError(VARYING))
    assert hint.startswith(
        "values vary over 'data' inside the step's jax.shard_map where they must not (2 values), e.g. "
        "[0]['l1']['bias'] (float32[64]{V:data}): a value computed per device and never reduced over 'data'"
    )
    assert _varying_hint(TypeError(COND)) == ""


def test_an_uneven_annotation_is_said_beside_an_uneven_batch():
    """Trial 40: on data=2,fsdp=3 a step placing a (16, 4) kernel annotated P('fsdp', None) raised; the hint
    named only the batch's 16 rows over 6 devices (true too), never the annotation that raised."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import shardcheck

    if jax.device_count() < 6:
        pytest.skip("needs 6 devices")

    class Net(nnx.Module):
        def __init__(self):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("fsdp", None))
            self.lin = nnx.Linear(16, 4, kernel_init=init, rngs=nnx.Rngs(0))

    def loss_fn(model, batch):
        return jnp.mean((model.lin(batch["x"]) - batch["y"]) ** 2)

    rng = np.random.default_rng(0)
    task = shardcheck.Task(
        model=Net,
        optimizer=optax.sgd(0.1),
        loss_fn=loss_fn,
        batches=[{"x": rng.normal(size=(16, 16)).astype(np.float32), "y": np.zeros((16, 4), np.float32)}],
    )

    def step(model, optimizer, batch, mesh):
        state = nnx.state(model)
        nnx.update(model, jax.device_put(state, nnx.get_named_sharding(state, mesh)))
        return loss_fn(model, batch)

    with pytest.raises(Exception, match="do not split") as raised:
        shardcheck.check_parity(step, task, mesh=shardcheck.make_mesh({"data": 2, "fsdp": 3}))
    said = " ".join(str(raised.value).split())
    assert "the batch's 16 rows do not split over the 6 devices of the mesh: a likely cause" in said
    assert (
        "and leaf 'lin.kernel' of shape (16, 4) is annotated P('fsdp', None): dimension 0 (16) does not split"
        in said
    )
