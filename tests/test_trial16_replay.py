"""A replay says a form only where its recorded samples show it (issue #36, trial 16: a DLRM with row-sharded
embedding tables, adagrad on the tables and adamw elsewhere, replayed against a recording of its correct step).

A digest keeps 8 fixed-index samples of each leaf; an embedding table's gradient is 0 on every row the batch does
not look up, so its samples are usually all 0 and the replay fell back to the whole leaf's norm ratio, which the
form then said as "a constant factor per group ... (10th-90th percentile per leaf): x0.9848 ...; x1.593 ..." for a
gradient whose elements were 0 or 2 x the reference's. Now such a leaf (``LeafError.samples == 0``) shows no
factor: the form is "no simple form", said with its whole-leaf ratio, while a factor its samples show is still
named. Beside it: a factor read from the optimizer's moments is not claimed where the gradients carry different
factors by group; an initial state whose optimizer state alone differs is said as another optimizer
initialization, not another seed; a replay's table prints the initial state's step as ``initial``.
"""

from __future__ import annotations

import dataclasses
import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from shardcheck import Task, check_parity
from shardcheck.cli.verify import render_report, step_cell
from shardcheck.parity.comparison.digest import _INITIAL, DigestError, initial_cause
from shardcheck.parity.comparison.leaf_digest import sample_indices
from shardcheck.parity.diagnosis.evidence import LeafError, one_factor_across
from shardcheck.parity.diagnosis.form import form_from_leaves
from shardcheck.parity.harness.recorded import record_run
from shardcheck.steps import Candidate

ROWS, DIM, B = 1024, 8, 8


class Ranker(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.emb = nnx.Embed(ROWS, DIM, rngs=rngs)
        self.head = nnx.Linear(DIM, 1, rngs=rngs)

    def __call__(self, ids):
        return self.head(self.emb(ids))[:, 0]


def _loss(model, batch):
    return jnp.mean((model(batch["ids"]) - batch["y"]) ** 2)


def _labels(params):
    return jax.tree_util.tree_map_with_path(lambda p, _: "emb" if "emb" in str(p) else "dense", params)


def _tx(acc: float = 0.1):
    return optax.multi_transform(
        {"emb": optax.adagrad(0.05, initial_accumulator_value=acc), "dense": optax.adam(1e-2)}, _labels
    )


@functools.cache
def _task(sampled: bool = False) -> Task:
    """Batches that look up rows 8..15 only (which no digest samples: every sampled row's gradient is 0), or
    (``sampled``) the rows the embedding gradient's digest samples."""
    rng = np.random.default_rng(0)
    rows = np.arange(B, 2 * B) if not sampled else sample_indices("grad emb.embedding", (ROWS, DIM)) // DIM
    batches = [
        {"ids": rows.astype(np.int32), "y": rng.normal(size=(B,)).astype(np.float32)} for _ in range(2)
    ]
    return Task(
        model=lambda: Ranker(nnx.Rngs(0)), optimizer=_tx(), loss_fn=_loss, batches=batches, name="rank"
    )


def _step(emb_rows=(1.0, 1.0), head: float = 1.0, acc: float | None = None) -> Candidate:
    """The task's step with the embedding's gradient scaled by ``emb_rows[0]`` on even rows and ``emb_rows[1]`` on
    odd ones, and the head's by ``head``; ``acc``: adagrad's initial accumulator of its own optimizer."""
    scale = jnp.asarray(np.where(np.arange(ROWS) % 2 == 0, *emb_rows), jnp.float32)[:, None]

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(_loss)(model, batch)
        grads["emb"]["embedding"] = jax.tree.map(lambda g: g * scale, grads["emb"]["embedding"])
        grads["head"] = jax.tree.map(lambda g: g * head, grads["head"])
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    own = None if acc is None else (lambda m, o: nnx.Optimizer(m, _tx(acc), wrt=nnx.Param))
    return Candidate("step", step, num_shards=1, make_optimizer=own)


@functools.cache
def _recording(sampled: bool = False):
    return record_run(_task(sampled), _step())


def _grad_leaf(report, path):
    first = next(r for r in report.steps if not r.ok)
    return next(e for e in first.leaves if e.kind == "grad" and e.path == path)


def test_the_recorded_samples_of_the_embedding_gradient_are_all_zero():
    rec = _recording()
    col = rec.names.index("grad emb.embedding")
    assert np.all(rec.steps.samples[0, col][rec.sample_index[col] >= 0] == 0)  # no sample on rows 8..15
    assert check_parity(_step(), _task(), reference=rec).verdict == "PASS"


def test_a_gradient_of_elements_0_or_2_x_is_no_constant_factor():
    """Trial 16's emb_no_data_psum: the replay said a constant factor per group from norm ratios; live: no simple
    form, its elementwise ratio from 0 to 2."""
    report = check_parity(_step((2.0, 0.0)), _task(), reference=_recording())
    assert report.verdict == "FAIL"
    e = _grad_leaf(report, "emb.embedding")
    assert e.samples == 0 and e.spread is None and not one_factor_across(e)
    assert 1.1 < e.ratio < 1.9  # the whole leaf's L2 norm ratio: neither 0 nor 2
    form = report.localization.form
    assert form.kind == "none" and form.factor is None and not form.groups
    assert form.sentence.startswith(
        "no simple form read from the records of the one failing leaf: none of the "
    )
    assert "emb.embedding (1 leaf) holds a nonzero value in the recording" in form.sentence
    assert f"its L2 norm is {e.ratio:.4g} x the reference's (a whole-leaf ratio" in form.sentence
    assert "constant factor" not in report.diagnosis and "percentile" not in form.sentence
    said = (
        "grad emb.embedding has no elementwise ratio read: none of its recorded samples holds a nonzero value"
    )
    assert said in report.diagnosis and f"whole-leaf L2 norm ratio {e.ratio:.4g})" in report.diagnosis


def test_a_true_factor_is_still_named_where_the_samples_show_it():
    """The head's gradient x3: its samples show 3 on every element, said as a constant factor by the replay as
    live; the embedding's x3 is not (its samples are 0), so the failing set reads no simple form with both."""
    report = check_parity(_step(head=3.0), _task(), reference=_recording())
    form = report.localization.form
    assert form.kind == "factor" and abs(form.factor - 3.0) < 1e-4
    assert "recorded sample" in form.sentence
    both = check_parity(_step((3.0, 3.0), head=3.0), _task(), reference=_recording())
    form = both.localization.form
    assert form.kind == "none" and form.factor is None
    assert "its L2 norm is 3 x the reference's (a whole-leaf ratio: no factor across a leaf" in form.sentence
    said = "the other leaves' ratios are constant across their recorded samples: x3 on head.bias, head.kernel"
    assert said in form.sentence


def test_no_one_factor_from_the_moments_where_the_gradients_differ_by_group():
    """Trial 16's psum_local_div: gradients x1.333 and x2.667 by group, and the replay said "optimizer moments are
    1.141 x the reference's: a constant factor that is not a shard count" (the dense group's moments agreed on
    one factor). Here the head (adam) x2 and the embedding (adagrad: no moment) x4, on rows its samples show."""
    report = check_parity(_step((4.0, 4.0), head=2.0), _task(True), reference=_recording(True))
    assert report.verdict == "FAIL"
    assert _grad_leaf(report, "emb.embedding").samples >= 4  # its samples show x4
    form = report.localization.form
    assert form.kind == "per_group" and [round(f, 4) for f, _ in form.groups] == [2.0, 4.0]
    assert "scaled" not in report.codes
    assert "optimizer moments are" not in report.diagnosis
    assert "a constant factor that is not a shard count" not in report.diagnosis
    # the records alone: per group where both groups' samples show their factors
    grad = [
        LeafError(0, "grad", "a", 1.0, 1.0, 1e-6, False, 2.0, None, (2.0, 2.0), (4,), 8),
        LeafError(0, "grad", "b", 1.0, 1.0, 1e-6, False, 4.0, None, (4.0, 4.0), (4,), 8),
    ]
    assert form_from_leaves(grad, update=False).kind == "per_group"


def test_form_from_leaves_reads_a_whole_leaf_ratio_of_zero_as_a_zero_update():
    """A whole leaf's largest update of 0 is 0 on every element: still a zero update."""
    zero = LeafError(0, "param", "emb", 1.0, 1.0, 1e-6, False, 0.0, 0.5, None, (4, 2), 0)
    assert form_from_leaves([zero]).kind == "zero"
    half = dataclasses.replace(zero, ratio=0.5)
    form = form_from_leaves([half])
    assert form.kind == "none" and "its largest update is 0.5 x the reference's" in form.sentence


def test_an_optimizer_state_that_starts_elsewhere_is_no_other_seed():
    """Trial 16's adagrad_init_item: initial_accumulator_value 0.0 against the recorded 0.1, the parameters
    identical; said as another seed, initializer or model."""
    report = check_parity(_step(acc=0.0), _task(), reference=_recording())
    assert report.verdict == "FAIL" and report.codes[0] == "initial_state"
    said = next(d.message for d in report.diagnoses if d.code == "initial_state")
    assert said.startswith(
        "The initial state differs from the recorded one: the parameters match (3 leaves); "
    )
    assert "1 optimizer-state leaf differs (e.g. opt_state " in said
    assert "max|x| 0.1 recorded, 0 replayed): another optimizer initialization" in said
    assert "adagrad's initial_accumulator_value" in said and "seed" not in said
    # the table's step of the initial state; the JSON keeps -1
    worst = report.worst_by_kind()["opt_state"]
    assert worst.step == -1 and report.to_dict()["worst_by_kind"]["opt_state"]["step"] == -1
    from rich.console import Console

    out = Console(file=io.StringIO(), width=200, record=True)
    out.print(render_report(report, "setup", against="rec.npz"))
    row = next(line for line in out.export_text().splitlines() if line.startswith("│ opt_state"))
    assert "│ initial │" in row and "-1" not in row


def _digest(name, ok, rec=0.1, rep=0.0, step=-1):
    return DigestError(step, name, "max", rec, rep, abs(rec - rep), 1e-6, ok)


def test_initial_cause_names_the_seed_only_where_the_parameters_differ():
    params = [_digest("param w", False, 0.5, 0.7), _digest("opt_state 0.mu.w", False)]
    assert initial_cause(params) == _INITIAL and "another seed, initializer or model" in _INITIAL
    state = [
        _digest("param w", True, 0.5, 0.5),
        _digest("opt_state 0.nu.w", False),
        _digest("loss", False, step=0),
    ]
    said = initial_cause(state)
    assert said.startswith("The initial state differs from the recorded one: the parameters match (1 leaf); ")
    assert "1 optimizer-state leaf differs (e.g. opt_state 0.nu.w's max|x| 0.1 recorded, 0 replayed)" in said
    assert "seed" not in said


def test_step_cell():
    assert [step_cell(t) for t in (-1, 0, 2)] == ["initial", "0", "2"]
