"""A tied embedding whose gradient lacks one use's term (trial 61).

A character LM's output head is its token embedding's table (``nnx.Embed.attend``). A step that stops the head's
gradient (``jax.lax.stop_gradient`` on the table there) returns the lookup's term alone; it read "no constant
factor ... median 0". Each call's term is computed with an offset of the module's parameters per call; the failing
gradient is the lookup's alone, and the head's call is named as missing. A correct step passes, and a fault of
another kind on the same module (its gradient scaled) is not read as a use left out.
"""

import jax
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx

import shardcheck
from shardcheck import check_parity
from shardcheck.parity.diagnosis.shared_uses import _call_terms
from shardcheck.parity.harness.state import _PreStep

V, D, S = 12, 8, 2


class Tied(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.mix = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, tokens, head_gradient=True):
        x = nnx.tanh(self.mix(self.embed(tokens)))
        if head_gradient:
            return self.embed.attend(x)
        return x @ jax.lax.stop_gradient(self.embed.embedding[...]).T  # the fault: the head's term stopped


def _loss(model, batch, head_gradient=True):
    logits = model(batch["tokens"], head_gradient)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def _task():
    rng = np.random.default_rng(0)
    batches = [
        {
            "tokens": rng.integers(0, V, (8, 5)).astype(np.int32),
            "targets": rng.integers(0, V, (8, 5)).astype(np.int32),
        }
        for _ in range(2)
    ]
    return shardcheck.Task(lambda: Tied(nnx.Rngs(0)), optax.adam(1e-2), _loss, batches, name="tied")


def _step(head_gradient=True, scale=1.0):
    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(_loss)(model, batch, head_gradient)
        grads = jax.tree_util.tree_map_with_path(
            lambda path, g: g * scale if "embed" in jax.tree_util.keystr(path) else g, grads
        )
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    return step


def test_the_calls_terms_sum_to_the_gradient():
    """The lookup's and the head's terms, in call order, add up to the table's gradient (float32 sums)."""
    task = _task()
    model = task.model()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    pre = _PreStep(graphdef, nnx.as_pure(params), nnx.as_pure(rest), None)
    batch = task.batches[0]
    terms = _call_terms(task.loss_fn, pre, batch, "embed")
    assert [name for name, _ in terms] == ["embed.__call__", "embed.attend"]
    whole = nnx.grad(_loss)(model, batch)["embed"]["embedding"][...]
    total = terms[0][1]["embedding"] + terms[1][1]["embedding"]
    np.testing.assert_allclose(total, whole, rtol=1e-5, atol=1e-7)
    assert np.abs(terms[0][1]["embedding"]).max() > 0 and np.abs(terms[1][1]["embedding"]).max() > 0


@require_devices(S)
def test_a_head_behind_a_stop_gradient_is_named_and_the_correct_step_passes():
    task = _task()
    report = check_parity(_step(head_gradient=False), task, num_shards=S)
    assert report.codes[0] == "localized", report.codes
    assert (
        "embed's parameters are read by 2 calls in the forward pass (embed.__call__ and embed.attend), and the "
        "returned gradient is the term of embed.__call__ alone: the term of embed.attend is missing"
    ) in report.diagnoses[0].message, report.diagnoses[0].message
    assert check_parity(_step(), task, num_shards=S).verdict == "PASS"


@require_devices(S)
@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_a_scaled_table_gradient_is_no_use_left_out(scale):
    report = check_parity(_step(scale=scale), _task(), num_shards=S)
    assert report.verdict == "FAIL"
    assert "is missing" not in str(report.diagnosis)
