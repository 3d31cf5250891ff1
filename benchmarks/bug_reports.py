"""Public bug reports that no shardcheck issue described, reproduced on fake CPU devices: is the cause found?

Issue #36's measure of the diagnosis. Eight public reports of a sharded or distributed training step that computed
the wrong update, each with a mistake outside the diagnosis catalog (not a sum for a mean, a per-shard
normalization, a missing psum over an axis, a local clip norm, an optimizer step per micro-batch or a step
counter), each reproduced in JAX / Flax NNX on a tiny model as a pair of ``shard_map`` data-parallel steps: the
correct one and the faulty one. :func:`run_case` checks both with :func:`shardcheck.check_parity` and
:func:`classify` grades the faulty one's diagnosis by a rule written per case (:class:`Expect`), before any run:

- ``named``: the text names the cause (every regex of ``Expect.named`` matches) and says nothing false;
- ``localized``: it names the first stage at which the steps part (``Expect.stage``) and the failing leaf group
  (``Expect.group``), and says nothing false;
- ``false``: a sentence the evidence contradicts (:func:`contradictions`: "Only the loss matches" while a
  gradient or optimizer-state leaf matched, "only the returned loss differs" while more did, "no one factor"
  while one factor fits, a factor claimed for every gradient while some match, "k optimizer steps instead of
  one" while the step counters match, a catalog cause that this case does not have, or a regex of
  ``Expect.false``);
- ``generic``: anything else.

Run it with::

    python benchmarks/bug_reports.py                 # every case: the table, and benchmarks/bug_reports.json
    python benchmarks/bug_reports.py --out FILE.json --cases warmup_off_by_one tied_embedding_unsynced

It creates 8 fake CPU devices before JAX starts; each check uses 4 of them (``data=4``). About a minute on 2
cores. ``tests/test_bug_reports.py`` checks the verdicts (each correct step PASSes, each faulty one FAILs at step
0) and the grades (named or localized in at least 7 of 8, none false).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

if "jax" not in sys.modules:  # run as a script: 8 fake CPU devices and the command line's compile flags
    from shardcheck.cli._xla import use_cpu_thread_pool, with_cpu_compile_flags

    os.environ["XLA_FLAGS"] = with_cpu_compile_flags(os.environ.get("XLA_FLAGS", ""))
    use_cpu_thread_pool(8)
    import jax

    jax.config.update("jax_num_cpu_devices", 8)

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardcheck import check_parity, make_mesh
from shardcheck.task import Task

DEVICES = 4  # the data-parallel mesh of every case: data=4
AXIS = "data"
B = 16  # examples per batch (4 per device)
STEPS = 2  # batches per check
LR, WD = 0.05, 0.1

# ------------------------------------------------------------------------------------------------ the models


class StackedNet(nnx.Module):
    """``L`` residual layers whose weights are stacked along a leading layer axis, as a scan over layers stores
    them (MaxText, jaxformer): ``w (L, D, D)``, a LayerNorm's ``ln.scale``/``ln.bias`` ``(L, D)`` (2-D, not 1-D),
    then a ``head`` ``nnx.Linear(D, 2)``. ``x (N, D) -> (N, 2)``."""

    def __init__(self, rngs: nnx.Rngs, layers: int = 2, d: int = 8):
        self.w = nnx.Param(0.3 * jax.random.normal(rngs.params(), (layers, d, d)))
        self.ln = nnx.Dict(
            scale=nnx.Param(1.0 + 0.2 * jax.random.normal(rngs.params(), (layers, d))),
            bias=nnx.Param(0.2 * jax.random.normal(rngs.params(), (layers, d))),
        )
        self.head = nnx.Linear(d, 2, bias_init=nnx.initializers.normal(0.5), rngs=rngs)

    def __call__(self, x):
        for i in range(self.w.shape[0]):
            mu = x.mean(-1, keepdims=True)
            h = (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
            x = x + jnp.tanh((h * self.ln["scale"][i] + self.ln["bias"][i]) @ self.w[i])
        return self.head(x)


class MLP(nnx.Module):
    """``Linear(4, 16) -> LayerNorm(16) -> tanh -> Linear(16, 2)``, biases drawn (a decay of them shows)."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.5)
        self.inp = nnx.Linear(4, 16, bias_init=init, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.out = nnx.Linear(16, 2, bias_init=init, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.norm(self.inp(x))))


E_EXPERTS, AUX = 4, 0.5  # experts; weight of the load-balancing loss


class MoE(nnx.Module):
    """A soft mixture of ``E`` experts on ``x (N, 8)``: ``router`` (no bias) gives ``probs (N, E)``, the
    experts ``w_in (E, 8, 16)``, ``w_out (E, 16, 8)``, then ``head`` ``Linear(8, 2)``. Returns ``(y (N, 2),
    probs)``."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.router = nnx.Linear(8, E_EXPERTS, use_bias=False, rngs=rngs)
        self.experts = nnx.Dict(
            w_in=nnx.Param(init(rngs.params(), (E_EXPERTS, 8, 16))),
            w_out=nnx.Param(init(rngs.params(), (E_EXPERTS, 16, 8))),
        )
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        probs = jax.nn.softmax(self.router(x), axis=-1)
        h = nnx.gelu(jnp.einsum("nd,edh->neh", x, self.experts["w_in"][...]))
        y = jnp.einsum("neh,ehd,ne->nd", h, self.experts["w_out"][...], probs)
        return self.head(y), probs


V, DIM = 16, 8  # vocabulary, width of the language models


class LM(nnx.Module):
    """Tokens ``(N, T)`` int32 -> logits ``(N, T, V)``: ``embed`` ``(V, D)``, ``hidden`` ``Linear(D, D)``, tanh,
    then the tied head ``embed.attend`` (``tied=True``) or its own ``head`` ``Linear(D, V)``."""

    def __init__(self, rngs: nnx.Rngs, tied: bool):
        self.embed = nnx.Embed(V, DIM, embedding_init=nnx.initializers.normal(0.5), rngs=rngs)
        self.hidden = nnx.Linear(DIM, DIM, rngs=rngs)
        self.head = None if tied else nnx.Linear(DIM, V, rngs=rngs)

    def __call__(self, tokens, head_table=None):
        h = jnp.tanh(self.hidden(self.embed(tokens)))
        if self.head is not None:
            return self.head(h)
        table = self.embed.embedding[...] if head_table is None else head_table
        return h @ table.T


# ------------------------------------------------------------------------------------------------ the losses


def mse(model, batch):
    """Mean squared error of ``model(batch["x"])`` against ``batch["y"]`` (a float32 scalar)."""
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def moe_loss(model, batch, aux_scale=1.0, axis=None):
    """Mean squared error plus ``AUX`` x the Switch load-balancing loss ``E sum_i f_i P_i`` (``f_i``: the
    fraction of tokens whose top expert is ``i``, no gradient; ``P_i``: the mean router probability). Inside
    ``shard_map`` (``axis``), ``f`` and the token count are the global ones while ``P``'s sum is this shard's,
    as Megatron's ``global_aux_loss`` computes it, times ``aux_scale``."""
    y, probs = model(batch["x"])
    tokens = jax.nn.one_hot(jnp.argmax(probs, -1), E_EXPERTS).sum(0)
    n = jnp.asarray(probs.shape[0], jnp.float32)
    if axis is not None:
        tokens, n = jax.lax.psum(tokens, axis), jax.lax.psum(n, axis)
    f = jax.lax.stop_gradient(tokens / n)
    aux = E_EXPERTS * jnp.sum(f * probs.sum(0) / n)
    return jnp.mean((y - batch["y"]) ** 2) + AUX * aux_scale * aux


def lm_ce(model, batch, head_table=None):
    """Mean next-token cross-entropy of ``model(batch["tokens"])`` against ``batch["targets"]``."""
    logits = model(batch["tokens"], head_table) if head_table is not None else model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def regression_batches(d_in: int, seed: int = 1) -> list[dict[str, np.ndarray]]:
    """``STEPS`` batches ``{"x": (B, d_in), "y": (B, 2)}`` float32."""
    rng = np.random.default_rng(seed)
    return [
        {"x": rng.normal(size=(B, d_in)).astype(np.float32), "y": rng.normal(size=(B, 2)).astype(np.float32)}
        for _ in range(STEPS)
    ]


def token_batches(seed: int = 2) -> list[dict[str, np.ndarray]]:
    """``STEPS`` batches ``{"tokens", "targets": (B, 4) int32}`` of random ids below ``V``."""
    rng = np.random.default_rng(seed)
    return [
        {k: rng.integers(0, V, size=(B, 4)).astype(np.int32) for k in ("tokens", "targets")}
        for _ in range(STEPS)
    ]


# ------------------------------------------------------------------------------------------------ the optimizers


def by_path(predicate: Callable[[str], bool]):
    """A mask function for optax: ``params -> tree of predicate("a.b.c")`` over each leaf's dotted path."""

    def mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: predicate(".".join(str(getattr(k, "key", k)) for k in path)), params
        )

    return mask


def scale_group(factors: dict[str, float]) -> optax.GradientTransformation:
    """Multiply the update of every leaf whose dotted path starts with a key of ``factors`` by its value (a
    per-group learning-rate multiplier, as a parameter group's ``lr`` gives it); the state is empty."""

    def update(updates, state, params=None):
        def one(path, u):
            name = ".".join(str(getattr(k, "key", k)) for k in path)
            return u * next((f for prefix, f in factors.items() if name.startswith(prefix)), 1.0)

        return jax.tree_util.tree_map_with_path(one, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def newton_schulz(g, steps: int = 5):
    """Muon's quintic Newton-Schulz orthogonalization of a 2-D ``g`` (Keller Jordan's coefficients)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    wide = g.shape[0] <= g.shape[1]
    x = g if wide else g.T
    x = x / (jnp.linalg.norm(x) + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x if wide else x.T


def orthogonalize(blocks: int = 1) -> optax.GradientTransformation:
    """Replace each 2-D update by its Newton-Schulz orthogonalization (1-D leaves pass); ``blocks > 1``
    orthogonalizes each of ``blocks`` column blocks on its own, as a tensor-parallel rank does with its shard."""

    def one(u):
        if u.ndim != 2:
            return u
        return jnp.concatenate([newton_schulz(part) for part in jnp.split(u, blocks, axis=1)], axis=1)

    def update(updates, state, params=None):
        return jax.tree.map(one, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def muon_like(blocks: int = 1) -> optax.GradientTransformation:
    """Momentum, then Muon's orthogonalization of the 2-D leaves, then ``-LR``: the state is the momentum."""
    return optax.chain(optax.trace(0.9), orthogonalize(blocks), optax.scale(-LR))


def warmup(offset: int):
    """Linear warmup over 4 updates to ``LR``: the learning rate of the update counted ``count`` (from 0) is
    ``LR min(1, (count + offset) / 4)``; ``offset=1`` is the right one (the first update at ``LR / 4``)."""
    return lambda count: LR * jnp.minimum(1.0, (count + offset) / 4.0)


# ------------------------------------------------------------------------------------------------ the steps


def update_with(optimizer: nnx.Optimizer, model: nnx.Module, grads, tx: optax.GradientTransformation):
    """``optimizer.update(model, grads)`` with ``tx`` in place of ``optimizer.tx`` (same state structure)."""
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    updates, state = tx.update(
        nnx.as_pure(nnx.state(grads, nnx.Param)), nnx.as_pure(optimizer.opt_state), params
    )
    nnx.update(model, optax.apply_updates(params, updates))
    nnx.update(optimizer.opt_state, nnx.state(state))
    optimizer.step[...] += 1


def decay(model: nnx.Module, before: dict, select: Callable[[str], bool], sign: float = 1.0):
    """After an update: ``p -= sign LR WD p_before`` on every parameter whose dotted path ``select`` picks (a
    decoupled weight decay applied, ``sign=1``, or taken back, ``sign=-1``)."""
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = ".".join(map(str, path))
        if select(name):
            var[...] = var[...] - sign * LR * WD * before[name]


def dp_step(loss=None, reduce=None, tx=None, after=None):
    """A data-parallel step by hand: each device's gradient of ``loss(model, batch)`` (default: the task's, by
    name in ``batch``'s case) on its quarter of the batch inside ``jax.shard_map``, averaged with ``pmean`` over
    ``data`` (or by ``reduce(grads)``), then the update (``optimizer.update``, or ``tx`` in its place), then
    ``after(model, params_before)``. Returns ``{"loss": (), "grads": the reduced gradients}``."""
    compiled = {}

    def step(model, optimizer, batch, mesh):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def body(params, rest, batch):
            value, grads = jax.value_and_grad(lambda p: loss(nnx.merge(graphdef, p, rest), batch))(params)
            grads = reduce(grads) if reduce else jax.tree.map(lambda g: jax.lax.pmean(g, AXIS), grads)
            return jax.lax.pmean(value, AXIS), grads

        key = (mesh, graphdef)
        if key not in compiled:
            compiled[key] = jax.jit(
                jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(AXIS)), out_specs=P(), check_vma=False)
            )
        value, grads = compiled[key](params, rest, batch)
        before = {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
        if tx is None:
            optimizer.update(model, grads)
        else:
            update_with(optimizer, model, grads, tx)
        if after is not None:
            after(model, before)
        return {"loss": value, "grads": grads}

    return step


def expert_reduce(ep: int):
    """Gradient reduction of an expert-parallel MoE: the dense leaves averaged over all ``data`` devices; the
    expert leaves summed and divided by the expert-data-parallel size ``|data| / ep``, as if each expert's
    gradient did not already hold the tokens of its ``ep`` expert-parallel ranks (``ep`` x too large)."""

    def reduce(grads):
        size = jax.lax.psum(1, AXIS)

        def one(path, g):
            expert = str(getattr(path[0], "key", path[0])) == "experts"
            return jax.lax.psum(g, AXIS) / (size // ep if expert else size)

        return jax.tree_util.tree_map_with_path(one, grads)

    return reduce


# ------------------------------------------------------------------------------------------------ the cases


@dataclasses.dataclass(frozen=True)
class Expect:
    """What a diagnosis must say to be graded ``named`` or ``localized`` (regexes, case-insensitive, searched in
    the report's whole diagnosis text), and what it must not say.

    Attributes:
        named: every one must match for the cause to count as named.
        stage: the first stage at which the steps part, stated.
        group: the failing leaves' group, stated (by name or by what they share).
        false: sentences that this case's evidence contradicts.
        allowed_codes: catalog codes that describe this case truly (exempt from :data:`CAUSE_CODES`).
    """

    named: tuple[str, ...]
    stage: str
    group: str
    false: tuple[str, ...] = ()
    allowed_codes: frozenset[str] = frozenset()


# The catalog's codes that name a cause (diagnosis/rules.py): claimed for a case that has none of them, false.
CAUSE_CODES = frozenset(
    {
        "summed",
        "averaged_twice",
        "clip_norm",
        "clip_coefficient",
        "local_clip_norm",
        "clip_per_shard",
        "local_normalization",
        "low_precision_reduction",
        "normalization",
        "per_shard_loss",
        "replicated_reduced",
        "wrong_axis_reduction",
        "replicas_differ",
        "model_state",
        "never_stepped",
        "step_counter",
    }
)
PARAMS_STAGE = r"the parameters differ|parameters? stage|update was applied differently|applied update"
GRADS_STAGE = r"the gradients differ|gradients? stage"
FORWARD_STAGE = r"the loss differs|loss (?:at equal parameters )?differs|forward (?:pass|stage)"


@dataclasses.dataclass(frozen=True)
class Case:
    """One public bug report and its reproduction.

    Attributes:
        name: a short id.
        source: the public report(s): ``owner/repo#N`` and its URL.
        summary: what the report says, in one line.
        cause: the real cause, as the reproduction plants it.
        task: builds the :class:`~shardcheck.task.Task` (the reference).
        correct: the correct step (``(model, optimizer, batch, mesh) -> {"loss", "grads"}``).
        faulty: the faulty step, same signature.
        expect: the grading rule of the faulty step's diagnosis.
    """

    name: str
    source: str
    summary: str
    cause: str
    task: Callable[[], Task]
    correct: Callable
    faulty: Callable
    expect: Expect


def _stacked_task(tx, name):
    return Task(
        model=lambda: StackedNet(nnx.Rngs(0)),
        optimizer=tx,
        loss_fn=mse,
        batches=regression_batches(8),
        name=name,
    )


def _mlp_task(tx, name):
    return Task(
        model=lambda: MLP(nnx.Rngs(0)), optimizer=tx, loss_fn=mse, batches=regression_batches(4), name=name
    )


def _moe_task():
    return Task(
        model=lambda: MoE(nnx.Rngs(0)),
        optimizer=optax.adam(LR),
        loss_fn=moe_loss,
        batches=regression_batches(8),
        name="moe",
    )


def _lm_task(tied, tx, name):
    return Task(
        model=lambda: LM(nnx.Rngs(0), tied), optimizer=tx, loss_fn=lm_ce, batches=token_batches(), name=name
    )


def _is_norm(name):
    return name.startswith("ln.")


def _is_matrix(name):
    return name.endswith("kernel")


def _moe_local(aux_scale):
    """Each shard's objective: its mean MSE plus ``aux_scale`` x its share of the global load-balancing loss."""
    return lambda model, batch: moe_loss(model, batch, aux_scale=aux_scale, axis=AXIS)


def _tied_head_unsynced(model, batch):
    """The head's copy of the tied table is another stage's: its gradient never reaches the input table."""
    return lm_ce(model, batch, head_table=jax.lax.stop_gradient(model.embed.embedding[...]))


MASK_BY_NAME = by_path(lambda n: not n.startswith("ln.") and not n.endswith("bias"))
MASK_2D = by_path(lambda n: n.endswith("kernel"))

CASES = (
    Case(
        name="stacked_norm_decay",
        source="salesforce/jaxformer#28 https://github.com/salesforce/jaxformer/issues/28",
        summary="Weight decay is applied to the LayerNorm in the transformer block: the decay mask tests a "
        "tensor's ndim, and the scanned layers' stacked norm scale and bias are 2-D.",
        cause="an ndim >= 2 decay mask on scan-stacked parameters decays the stacked LayerNorm scale and bias "
        "(L, D); the gradients and Adam's moments are right, the applied update has -lr wd p on ln.*",
        task=lambda: _stacked_task(optax.adamw(LR, weight_decay=WD, mask=MASK_BY_NAME), "stacked-adamw"),
        correct=dp_step(mse),
        faulty=dp_step(mse, after=lambda m, before: decay(m, before, _is_norm)),
        expect=Expect(named=(r"decay",), stage=PARAMS_STAGE, group=r"\bln\b|ln\.(?:scale|bias)"),
    ),
    Case(
        name="decay_mask_flattened",
        source="mlfoundations/open_clip#358 https://github.com/mlfoundations/open_clip/pull/358 (also "
        "pytorch/pytorch#101343)",
        summary="With FSDP's flattened parameters every p.ndim is < 2, so the 'no decay for 1-D parameters' "
        "rule puts every parameter in one group: the weight matrices lose their weight decay.",
        cause="the decay mask is evaluated on flattened (1-D) shards, so no kernel is decayed; gradients and "
        "Adam's moments are right, the kernels' update lacks -lr wd p",
        task=lambda: _mlp_task(optax.adamw(LR, weight_decay=WD, mask=MASK_2D), "mlp-adamw"),
        correct=dp_step(mse),
        faulty=dp_step(mse, after=lambda m, before: decay(m, before, _is_matrix, sign=-1.0)),
        expect=Expect(named=(r"decay",), stage=PARAMS_STAGE, group=r"kernel|ndim >= 2|2-d"),
    ),
    Case(
        name="warmup_off_by_one",
        source="verl-project/verl#3674 https://github.com/verl-project/verl/issues/3674 (also "
        "pytorch/torchtitan#1261)",
        summary="With linear warmup the learning rate is zero for the first update: the scheduler is read one "
        "step behind (step 0 of the warmup is lr = 0).",
        cause="the warmup schedule is evaluated at count instead of count + 1: the first update has lr 0 (no "
        "parameter moves) while Adam's moments and the counters advance",
        task=lambda: _stacked_task(optax.adam(warmup(1)), "stacked-warmup"),
        correct=dp_step(mse),
        faulty=dp_step(mse, tx=optax.adam(warmup(0))),
        expect=Expect(
            named=(r"learning rate|schedul|\blr\b", r"zero|no update|did not move|not moved|missing update"),
            stage=PARAMS_STAGE,
            group=r"\((\d+) of \1 leaves\)|every (?:parameter|leaf)|all (?:the )?(?:parameters|leaves)",
        ),
    ),
    Case(
        name="expert_grads_x_ep",
        source="pytorch/pytorch#160285 https://github.com/pytorch/pytorch/issues/160285 (also "
        "NVIDIA/Megatron-LM#5956)",
        summary="Expert gradients come out ep_size times too large under expert parallelism: an expert's "
        "gradient already holds its expert-parallel group's tokens, and the average divides by the "
        "expert-data-parallel size only.",
        cause="the expert leaves' gradients are summed over data and divided by |data| / ep (ep = 2): the "
        "experts.* gradients are x2, every other leaf is right",
        task=_moe_task,
        correct=dp_step(_moe_local(float(DEVICES))),
        faulty=dp_step(_moe_local(float(DEVICES)), reduce=expert_reduce(2)),
        expect=Expect(
            named=(r"expert", r"\b2(?:\.0+)?\s*x|x\s*2\b|factor (?:of )?2\b|twice"),
            stage=GRADS_STAGE,
            group=r"experts|w_in|w_out",
        ),
    ),
    Case(
        name="aux_loss_over_dp",
        source="NVIDIA/Megatron-LM#3769 https://github.com/NVIDIA/Megatron-LM/pull/3769 (issue "
        "NVIDIA/Megatron-LM#3672)",
        summary="global_aux_loss divides by the global token count squared while the router probabilities are "
        "local: the load-balancing loss and its gradient are dp_size times too small.",
        cause="each shard's share of the global load-balancing loss is not multiplied by |data| before the "
        "gradients are averaged: the aux term of the loss and of the router's gradient is 1/4 of the "
        "reference's; the experts and head are right",
        task=_moe_task,
        correct=dp_step(_moe_local(float(DEVICES))),
        faulty=dp_step(_moe_local(1.0)),
        expect=Expect(
            named=(r"aux|load.balanc", r"router"),
            stage=FORWARD_STAGE,
            group=r"router",
            false=(r"[Oo]nly the returned loss differs",),
        ),
    ),
    Case(
        name="tied_embedding_unsynced",
        source="uw-syfi/piper#13 https://github.com/uw-syfi/piper/issues/13 (the all-reduce it needs: "
        "NVIDIA/Megatron-LM#299)",
        summary="Tied embeddings on different pipeline stages are duplicated and their gradients are not "
        "synchronized before the optimizer step.",
        cause="the tied table's gradient holds only the input lookup's part; the output head's part (the other "
        "stage's copy) is never added: embed.embedding's gradient differs, every other leaf is right",
        task=lambda: _lm_task(True, optax.adam(LR), "tied-lm"),
        correct=dp_step(lm_ce),
        faulty=dp_step(_tied_head_unsynced),
        expect=Expect(named=(r"tied|shared|both uses", r"embed"), stage=GRADS_STAGE, group=r"embed"),
    ),
    Case(
        name="muon_per_shard",
        source="deepspeedai/DeepSpeed#8437 https://github.com/deepspeedai/DeepSpeed/issues/8437",
        summary="Muon under AutoTP orthogonalizes each rank's shard, so the update depends on the TP degree: "
        "the gradients agree to 7e-7, the updates differ by 39%.",
        cause="each 2-D update is orthogonalized per column block of a 2-way tensor-parallel split, not as one "
        "matrix: gradients and momentum are right, the kernels' applied update is not",
        task=lambda: _mlp_task(muon_like(1), "mlp-muon"),
        correct=dp_step(mse),
        faulty=dp_step(mse, tx=muon_like(2)),
        expect=Expect(
            named=(r"orthogonali|newton|muon|the optimizer's transform", r"shard|block|per rank|split"),
            stage=PARAMS_STAGE,
            group=r"kernel|ndim >= 2|2-d",
        ),
    ),
    Case(
        name="embedding_lr_ignored",
        source="unslothai/unsloth#10887 https://github.com/unslothai/unsloth/pull/10887 (also "
        "facebookresearch/fairscale#539)",
        summary="Under FSDP with flattened parameters the embedding parameter group is not recognised, so the "
        "requested embedding_learning_rate is silently ignored.",
        cause="the embedding's learning-rate multiplier (0.1) is lost: embed.embedding's update is 10 x the "
        "reference's; gradients and Adam's moments are right",
        task=lambda: _lm_task(
            False,
            optax.chain(optax.scale_by_adam(), scale_group({"embed": 0.1}), optax.scale(-LR)),
            "lm-embed-lr",
        ),
        correct=dp_step(lm_ce),
        faulty=dp_step(lm_ce, tx=optax.chain(optax.scale_by_adam(), scale_group({}), optax.scale(-LR))),
        expect=Expect(
            named=(r"learning rate|\blr\b|param(?:eter)? group", r"embed"), stage=PARAMS_STAGE, group=r"embed"
        ),
    ),
)

# ------------------------------------------------------------------------------------------------ grading


def contradictions(report, expect: Expect) -> list[str]:
    """The diagnosis's sentences that the report's own records (or the case) contradict, each as a short reason.

    Args:
        report: the faulty step's :class:`~shardcheck.ParityReport`.
        expect: the case's :class:`Expect`.

    Returns:
        A list of reasons (empty: nothing false found).
    """
    text = report.diagnosis
    first = next((r for r in report.steps if not r.ok), None)
    found = []
    if first is not None:
        ok_kinds = {e.kind for e in first.leaves if e.ok}
        bad_kinds = {e.kind for e in first.leaves if not e.ok}
        if "Only the loss matches" in text and ok_kinds & {"grad", "opt_state"}:
            found.append("'Only the loss matches' while some gradient or optimizer-state leaves match")
        if "loss_differs" in report.codes and bad_kinds - {"loss"}:
            found.append(
                "'only the returned loss differs' while "
                + ", ".join(sorted(bad_kinds - {"loss"}))
                + " differ"
            )
        if "grads_differ" in report.codes and bad_kinds - {"grad"}:
            found.append(
                "'only the exposed gradients differ' while "
                + ", ".join(sorted(bad_kinds - {"grad"}))
                + " differ"
            )
        found += _false_forms(report, first)
        counters = [e for e in first.leaves if e.kind == "counter" and not e.path.startswith("model.")]
        if "optimizer steps instead of one" in text and counters and all(e.ok for e in counters):
            found.append("'k optimizer steps instead of one' while the step counters match")
    for code in report.codes:
        if code in CAUSE_CODES and code not in expect.allowed_codes:
            found.append(f"claims the catalog cause {code!r}, which this case does not have")
    for pattern in expect.false:
        if re.search(pattern, text):
            found.append(f"says {pattern!r}")
    return found


def _one_factor(leaves) -> float | None:
    """The factor every leaf's change shares, read from the records: each leaf's ratio constant across it (its
    10th-90th percentile within 2% of the median, or within 1e-6 of a zero median) and the same on every leaf;
    ``None`` when they share none."""
    ratios = []
    for e in leaves:
        if e.ratio is None or e.spread is None:
            return None
        if any(abs(q - e.ratio) > max(0.02 * abs(e.ratio), 1e-6) for q in e.spread):
            return None
        ratios.append(e.ratio)
    if not ratios or max(ratios) - min(ratios) > max(0.02 * max(abs(r) for r in ratios), 1e-6):
        return None
    return ratios[0]


def _false_forms(report, first) -> list[str]:
    """Claims about the form of the difference that ``first``'s records contradict: "no one factor" while every
    failing leaf of the stage it names changed by one constant factor, and "gradients are f x the reference's"
    (every gradient) while some gradient leaves match."""
    found = []
    for d in report.diagnoses:
        if "by no one factor" in d.message:
            kind = next(
                (
                    k
                    for k, noun in (
                        ("param", "the parameters differ"),
                        ("opt_state", "the optimizer state differs"),
                        ("grad", "the gradients differ"),
                    )
                    if noun in d.message
                ),
                None,
            )
            bad = [e for e in first.leaves if e.kind == kind and not e.ok]
            factor = _one_factor(bad) if bad else None
            if factor is not None:
                found.append(f"'no one factor' while every failing {kind} leaf changed by {factor:.4g} x")
        grads = [e for e in first.leaves if e.kind == "grad"]
        if re.search(r"gradients are -?[\d.]+(?:e-?\d+)? x the reference", d.message) and any(
            e.ok for e in grads
        ):
            matched = sum(e.ok for e in grads)
            found.append(
                f"'gradients are f x the reference's' while {matched} of {len(grads)} gradient leaves match"
            )
    return found


def classify(report, expect: Expect) -> tuple[str, list[str]]:
    """Grade a faulty step's diagnosis: ``"false"``, ``"named"``, ``"localized"`` or ``"generic"`` (module
    docstring), with the reasons (the contradictions, or the regexes that matched)."""
    false = contradictions(report, expect)
    if false:
        return "false", false
    text = report.diagnosis
    hits = [p for p in expect.named if re.search(p, text, re.IGNORECASE)]
    if len(hits) == len(expect.named):
        return "named", hits
    where = [p for p in (expect.stage, expect.group) if re.search(p, text, re.IGNORECASE)]
    if len(where) == 2:
        return "localized", where
    return "generic", hits + where


def run_case(case: Case, mesh=None) -> dict:
    """Check the case's correct and faulty steps on ``mesh`` (default ``data=4``); grade the faulty one.

    Returns:
        ``{"name", "source", "summary", "cause", "correct_verdict", "correct_passes", "faulty_verdict",
        "faulty_fails_at_step_0", "first_failing_step", "codes", "diagnosis", "grade", "reasons", "seconds"}``.
    """
    mesh = make_mesh(DEVICES) if mesh is None else mesh
    start = time.perf_counter()
    good = check_parity(case.correct, case.task(), mesh=mesh, name=f"{case.name}-correct")
    bad = check_parity(case.faulty, case.task(), mesh=mesh, name=f"{case.name}-faulty")
    first = next((r.step for r in bad.steps if not r.ok), None)
    grade, reasons = classify(bad, case.expect)
    return {
        "name": case.name,
        "source": case.source,
        "summary": case.summary,
        "cause": case.cause,
        "correct_verdict": good.verdict,
        "correct_passes": good.verdict == "PASS",
        "correct_codes": list(good.codes),
        "faulty_verdict": bad.verdict,
        "faulty_fails_at_step_0": bad.verdict == "FAIL" and first == 0,
        "first_failing_step": first,
        "codes": list(bad.codes),
        "diagnosis": bad.diagnosis,
        "grade": grade,
        "reasons": reasons,
        "seconds": round(time.perf_counter() - start, 2),
    }


def table(rows: list[dict]) -> str:
    """The results as a Markdown table, with the grade counts below it."""
    lines = ["| case | correct | faulty | codes | grade |", "|---|---|---|---|---|"]
    for r in rows:
        step = "" if r["first_failing_step"] is None else f" at step {r['first_failing_step']}"
        lines.append(
            f"| {r['name']} | {r['correct_verdict']} | {r['faulty_verdict']}{step} | {', '.join(r['codes'])} | "
            f"{r['grade']} |"
        )
    counts = {g: sum(r["grade"] == g for r in rows) for g in ("named", "localized", "generic", "false")}
    lines.append("")
    lines.append(
        f"named {counts['named']}, localized {counts['localized']}, generic {counts['generic']}, false "
        f"{counts['false']} of {len(rows)}; the target: named or localized >= 7 of 8, false 0"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the cases, print the table, write the JSON (``--out``, default ``benchmarks/bug_reports.json``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).with_name("bug_reports.json")))
    parser.add_argument("--cases", nargs="*", help="case names (default: all)")
    parser.add_argument("--label", default="", help="what was measured (e.g. a commit), stored in the JSON")
    args = parser.parse_args(argv)
    names = {c.name for c in CASES}
    unknown = sorted(set(args.cases or ()) - names)
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {sorted(names)}")
    rows = [run_case(c) for c in CASES if not args.cases or c.name in args.cases]
    print(table(rows))
    counts = {g: sum(r["grade"] == g for r in rows) for g in ("named", "localized", "generic", "false")}
    result = {
        "cases": rows,
        "counts": counts,
        "named_or_localized": counts["named"] + counts["localized"],
        "target": "named or localized in at least 7 of 8, nothing false",
        "measured": args.label,
        "jax": jax.__version__,
        "devices": DEVICES,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
