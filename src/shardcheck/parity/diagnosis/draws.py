"""Random numbers drawn in the forward pass, named as a possible cause where a check's forward stage differs.

A model that draws from its RNG streams in ``__call__`` (a VAE's ``eps = jax.random.normal(self.rngs.noise(),
...)``, Dropout at a nonzero rate) is checked as any other (:func:`shardcheck.task.check_model`): a GSPMD step
draws the full batch's numbers however the batch is split. A step that runs the forward pass per shard and draws
there (the same key on every shard) computes another loss at equal parameters, and one that does not write a
stream's count back (:mod:`shardcheck.parity.comparison.rng_counts`) draws the same numbers again at the next
step: either way the forward stage differs first (:mod:`shardcheck.parity.diagnosis.localization`), and the
report's leading finding then says that the draws may be why (issue #36, trial 9).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from shardcheck.parity.diagnosis.evidence import Diagnosis, StepRecord


def _lost(counts: Sequence[str]) -> str:
    """The clause for stream counts left as they were (``counts``: their leaf names), else ``""``."""
    if not counts:
        return ""
    return (
        f"; one that leaves a stream's count as it was ({', '.join(counts)}) draws this step's numbers again at the "
        "next"
    )


def draws_clause(draws: Sequence[str], counts: Sequence[str] = ()) -> str:
    """The sentence naming the streams drawn (``("rngs.noise",)``) as a possible cause of a forward difference,
    with the two ways a step draws other numbers and how to check the rest of the step; ``counts``: the names of
    the stream count leaves that differ (``counter model.rngs.noise.count``)."""
    return (
        f"The forward pass differs, and the model draws random numbers in it ({_what(draws)}): a step that draws "
        "other numbers than the full batch's differs here (a forward pass per shard that draws from the same key "
        "on every shard, or from a key folded with the shard's index: each row must get the numbers it gets in "
        f"the full batch){_lost(counts)}. Check the rest of the step with the draws off (Dropout at rate 0, or "
        "deterministic=True), or draw by the global row index (jax.random.fold_in of each row's index, carried in "
        "the batch)."
    )


UNNAMED = ("update_differs", "forward_differs", "localized", "loss_only", "loss_differs")
"""The leading findings that name no cause of their own: only these get :func:`draws_clause` (where no stream's
count differs); a finding that names one (``normalization``, ``scaled``, ...) is not told the draws may be why."""


def with_draws(
    findings: Sequence[Diagnosis], stage: str | None, draws: Sequence[str], record: StepRecord | None
) -> list[Diagnosis]:
    """``findings`` with :func:`draws_clause` said with the first one's message (before it where it names no
    cause, :data:`UNNAMED`; after it where it names one) where the model draws (``draws``,
    the streams, non-empty), the first stage that differs is the forward pass (``stage``) and the first finding
    names no cause (:data:`UNNAMED`) or a stream's count differs; else as they are, and where no stream's count
    differs at a first failing step after step 0 (the steps before it matched with their draws).
    ``record``: the first failing step's, whose failing stream counts the clause names."""
    findings = list(findings)
    if not draws or stage != "forward" or not findings:
        return findings
    ends = tuple(f"{s}.count" for s in draws)
    counts = [] if record is None else [e.name for e in record.leaves if not e.ok and e.path.endswith(ends)]
    first = findings[0]
    if first.code == "per_shard_loss":  # the loss per shard: the draws per shard first, then a coupled term
        return [
            dataclasses.replace(first, message=per_shard_draws(draws, counts, first.message)),
            *findings[1:],
        ]
    if (
        not counts and first.code not in UNNAMED
    ):  # a cause is named (trial 19: a normalization, a x0.5469 scale)
        return findings
    if DROPPED in first.message:  # the count's own reading (with_count_readings): the loss matched
        return findings
    if not counts and record is not None and record.step > 0:
        # the steps before matched, drawing as the full batch draws (a step drawing other numbers differs from
        # step 0): the draws are not why (trial 60: a mean of per-shard means, first off at the padded batch's
        # step 3, was told its dropout may be the cause)
        return findings
    clause = draws_clause(draws, counts)
    said = (  # before a finding that names no cause (trial 53: after a 10-line list of masks and positions)
        f"{clause} {first.message}" if first.code in UNNAMED else f"{first.message} {clause}"
    )
    return [dataclasses.replace(first, message=said), *findings[1:]]


COUPLED = "a term of the loss that couples the rows"
"""Where a ``per_shard_loss`` finding's message turns from what was measured to the row-coupling reading."""


def _what(draws: Sequence[str]) -> str:
    """What draws, as the user wrote it: Dropout at a nonzero rate where a stream's name says so (``drop``)."""
    named = ", ".join(draws)
    return f"{named}: Dropout at a nonzero rate" if any("drop" in d.lower() for d in draws) else named


def measured_and_coupled(finding: str) -> tuple[str, str]:
    """A ``per_shard_loss`` finding's message in two: what was measured, as a clause that follows "and" (``"the
    step's loss is the one computed per shard"`` where the message says nothing measured), and its reading of a
    term that couples the rows (from :data:`COUPLED` on), so that a likelier cause can be said between them."""
    cut = finding.find(COUPLED)
    measured = finding[:cut].removesuffix(": ") if cut > 0 and finding[:cut].endswith(": ") else ""
    coupled = finding[len(measured) :].lstrip(": ") if measured else finding
    said = (
        f"{measured[0].lower()}{measured[1:]}"
        if measured
        else "the step's loss is the one computed per shard"
    )
    return said, coupled


def per_shard_draws(draws: Sequence[str], counts: Sequence[str] = (), finding: str = "") -> str:
    """The message of a ``per_shard_loss`` finding (``finding``: its own) where the model draws (``draws``): the
    loss computed over each shard's rows is also what a forward pass run per shard gives when every shard draws
    with the same key, so the draws lead, with how to check the rest of the step (the draws off, or the reference's
    keys), and the row-coupling reading follows for a loss that does couple the rows (trial 35: a VAE whose shards
    drew the same noise read only "a term of the loss that couples the rows ... was computed per shard"; trial 42:
    an ensemble with Dropout at rate 0.1 and a mean cross-entropy, which couples no rows, read it first)."""
    said, coupled = measured_and_coupled(finding)
    return (
        f"The model draws random numbers in its forward pass ({_what(draws)}), and {said}: what a forward pass run "
        "per shard computes, every shard drawing from the same key (each shard's rows get other numbers than the "
        "full batch's). Where the loss couples no rows (a mean of per-row losses), the draws per shard are the "
        "cause, not the step's reductions: to check the rest of the step, check it with the draws off (Dropout "
        "at rate 0, or deterministic=True) or have it draw the reference's numbers (each row the numbers it gets "
        "in the full batch); to keep the draws per shard, draw by the global row index (jax.random.fold_in of "
        f"each row's index, carried in the batch) or carry the noise in the batch{_lost(counts)}."
        + (f" Otherwise {coupled[0].lower()}{coupled[1:]}" if coupled else "")
    )


def _count_path(stream: str) -> str:
    return f"model.{stream}.count"


def with_count_readings(
    findings: Sequence[Diagnosis],
    drawn: Sequence[str],
    undrawn: Sequence[str],
    record: StepRecord | None = None,
) -> list[Diagnosis]:
    """``findings`` with a ``model_state`` finding on an RNG stream's count told as draws (trial 52: Dropout on in
    the step and not in the task read "the step must write it as one forward pass over the full batch does"; the
    reverse, the step's model in eval mode, read "the forward pass's writes were dropped or undone"):

    * a stream the task's forward pass does not draw from (``undrawn``) whose count the step moved: the step
      draws numbers the single-device step does not;
    * a stream it draws from (``drawn``) whose count the step left as it was: the step ran the model without
      its draws, or dropped the count's write; where the first failing step's loss (``record``) matches, only
      the latter, with the model's state that differs there too (trial 60: jax.grad of nnx.split parts dropped a
      Dropout count's and BatchNorm's writes, and the statistics were named only as the worst leaf).
    """
    moved = {_count_path(s): s for s in undrawn}
    kept = {_count_path(s): s for s in drawn}
    out = []
    for d in findings:
        path = (d.leaf or "").removeprefix("counter ")
        if d.code == "model_state" and path in moved:
            d = dataclasses.replace(
                d,
                message=(
                    f"The step draws random numbers that the single-device step does not: the count of the RNG "
                    f"stream {moved[path]} moved in the step's model and not in the task's, whose forward pass draws "
                    "nothing from it (Dropout at rate 0, or deterministic). A nonzero dropout rate, "
                    "deterministic=False or model.train() in the step computes another loss: run the model in the "
                    "step as the task's loss runs it."
                ),
            )
        elif (
            d.code == "model_state" and path in kept and "left it as it was" in d.message and _loss_ok(record)
        ):
            d = dataclasses.replace(d, message=_writes_dropped(kept[path], record))
        elif d.code == "model_state" and path in kept and "left it as it was" in d.message:
            d = dataclasses.replace(
                d,
                message=(
                    f"The count of the RNG stream {kept[path]}, which the task's forward pass draws from, did not "
                    "move in the step's model: the step ran the model without its draws (model.eval(), "
                    "deterministic=True, a dropout rate of 0), which computes another loss, or dropped the "
                    "count's write (jax.grad of a function of nnx.split parts discards it: return and nnx.update "
                    "the state, or use nnx.value_and_grad). Run the model in the step as the task's loss runs it."
                ),
            )
        out.append(d)
    return out


DROPPED = "did not move in the step's model, though the loss the step returns"
"""What :func:`_writes_dropped`'s reading says (a count left as it was beside a matching loss)."""


def _loss_ok(record: StepRecord | None) -> bool:
    """Whether ``record`` holds a loss leaf and every one matches."""
    losses = [] if record is None else [e for e in record.leaves if e.kind == "loss"]
    return bool(losses) and all(e.ok for e in losses)


def _writes_dropped(stream: str, record: StepRecord) -> str:
    """A kept count's reading where the step's loss matches: it ran the model with its draws, and dropped what
    the forward pass writes (the count, and the model's state that differs at that step too)."""
    state = sorted(e.path.removeprefix("model.") for e in record.leaves if e.kind == "state" and not e.ok)
    also = (
        f", and the model's state {', '.join(state)}, which the forward pass writes too, differs"
        if state
        else ""
    )
    return (
        f"The count of the RNG stream {stream}, which the task's forward pass draws from, {DROPPED} at step "
        f"{record.step} matches the reference's (it ran the "
        f"model with its draws){also}: the step dropped what its forward pass writes (jax.grad of a function of "
        "nnx.split parts discards it: return and nnx.update the state, or use nnx.value_and_grad). A count left as "
        "it was draws this step's numbers again at the next step."
    )
