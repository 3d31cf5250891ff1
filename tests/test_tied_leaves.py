"""A tied leaf (one ``nnx.Param`` held by two module paths) is named as such by the grouping (issue #36).

A tiny language model whose output head holds the input embedding table itself (``self.head.table =
self.embed.embedding``: one Variable, two paths). Planted fault: the head's use of the table is cut from the
gradient (``stop_gradient``), as a tied table whose two copies' gradients are never summed (a pipeline's
unsynchronized tied embedding): only the table's gradient differs, and the localization says it is tied and by
which paths. Both sides: the same model with its own head table (untied) never says "tied", nor does any leaf
of an untied model. A table read by two operations through one path (the head reading ``embed.embedding``, as
``nnx.Embed.attend`` does) is named by its uses in the loss instead.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from conftest import require_devices
from flax import nnx

from shardcheck import Task, check_parity
from shardcheck.parity.harness.candidates import as_candidate
from shardcheck.parity.harness.leaf_facts import leaf_facts, shared_paths

V, D, N, T = 12, 8, 8, 6


class Head(nnx.Module):
    def __init__(self, table: nnx.Param):
        self.table = table


class LM(nnx.Module):
    """``(N, T)`` int32 tokens -> ``(N, T, V)`` logits ``tanh(hidden(embed(tokens))) @ head.table.T``; the head's
    ``(V, D)`` table is the embedding's own Variable (``tied``) or its own."""

    def __init__(self, tied: bool | str, rngs: nnx.Rngs):
        self.embed = nnx.Embed(V, D, embedding_init=nnx.initializers.normal(0.5), rngs=rngs)
        self.hidden = nnx.Linear(D, D, rngs=rngs)
        if tied == "one path":  # the head reads the embedding's table itself, as nnx.Embed.attend does
            self.head = None
            return
        table = self.embed.embedding if tied else nnx.Param(0.5 * jax.random.normal(rngs.params(), (V, D)))
        self.head = Head(table)

    def __call__(self, tokens, cut: bool = False):
        table = self.embed.embedding[...] if self.head is None else self.head.table[...]
        table = jax.lax.stop_gradient(table) if cut else table
        return jnp.tanh(self.hidden(self.embed(tokens))) @ table.T


def _loss(cut: bool):
    def loss(model, batch):
        logits = model(batch["tokens"], cut)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return loss


def _task(tied: bool | str) -> Task:
    tokens = jax.random.randint(jax.random.key(1), (N, T + 1), 0, V)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    return Task(
        model=lambda: LM(tied, nnx.Rngs(0)),
        optimizer=optax.adam(1e-2),
        loss_fn=_loss(False),
        batches=[batch],
        name=str(tied),
    )


def _cut(task: Task):
    """``task``'s dp candidate on 2 shards whose loss cuts the head's use of its table from the gradient."""
    return as_candidate("t", "dp", dataclasses.replace(task, loss_fn=_loss(True)), 2, None, None)


def test_a_param_held_by_two_module_paths_is_tied_and_no_leaf_of_an_untied_model_is():
    tied = leaf_facts(LM(True, nnx.Rngs(0)))
    assert shared_paths(LM(True, nnx.Rngs(0))) == {"embed.embedding": ("embed.embedding", "head.table")}
    assert tied["embed.embedding"].tied and tied["embed.embedding"].shared_by == (
        "embed.embedding",
        "head.table",
    )
    assert "head.table" not in tied  # one leaf in the state, under its first path
    assert not any(f.tied or f.shared_by for f in tied.values() if f is not tied["embed.embedding"])
    untied = leaf_facts(LM(False, nnx.Rngs(0)))
    assert set(untied) == {"embed.embedding", "hidden.kernel", "hidden.bias", "head.table"}
    assert not any(f.tied or f.shared_by for f in untied.values())


@require_devices(2)
def test_a_tied_tables_gradient_missing_one_use_is_localized_to_the_tied_leaf():
    task = _task(True)
    report = check_parity(_cut(task), task, num_shards=2)
    loc = report.localization
    assert not report.ok and loc.stage == "gradients"
    assert loc.group == (
        "every failing leaf is tied: embed.embedding is shared by embed.embedding and head.table; every untied "
        "leaf matches"
    )
    assert "every failing leaf is tied: embed.embedding is shared by" in report.diagnosis


@require_devices(2)
def test_the_same_fault_on_an_untied_head_never_says_tied():
    task = _task(False)
    report = check_parity(_cut(task), task, num_shards=2)
    loc = report.localization
    assert not report.ok and loc.stage == "gradients"
    bad = [e.path for e in report.steps[0].leaves if e.kind == "grad" and not e.ok]
    assert bad == ["head.table"]  # its gradient is cut whole: zero
    assert "tied" not in report.diagnosis and "shared by" not in report.diagnosis
    assert loc.form.kind == "zero"


@require_devices(2)
def test_a_table_read_twice_through_one_path_is_named_by_its_uses_in_the_loss():
    task = _task("one path")
    assert shared_paths(LM("one path", nnx.Rngs(0))) == {}  # one path: the graph shows no sharing
    facts = leaf_facts(LM("one path", nnx.Rngs(0)), task)
    assert facts["embed.embedding"].uses == ("gather", "transpose")  # looked up, then multiplied as the head
    assert facts["hidden.kernel"].uses == ("dot_general",)
    loc = check_parity(_cut(task), task, num_shards=2).localization
    assert loc.stage == "gradients"
    assert loc.group == (
        "every failing leaf is read by several operations of the loss, one weight with several uses (shared or "
        "tied): embed.embedding by gather and transpose; every leaf read by one operation matches"
    )
    # without the task, the uses are not known and nothing is said of them
    assert leaf_facts(LM("one path", nnx.Rngs(0)))["embed.embedding"].uses is None
