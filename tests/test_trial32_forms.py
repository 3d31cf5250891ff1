"""Trial 32 (issue #36): a DLRM whose embedding tables were decayed by 5e-4 of their value after the optimizer's
update read "no simple form" (the decay form fitted the parameter before the step only), and Adagrad's
accumulator started at 0.01 for 0.1 (-0.09 on every element) read "no simple form: ... ratio runs from -1820 to
-41.4". On arrays (float64, no JAX), both ways.
"""

import numpy as np

from shardcheck.parity.diagnosis.form import fit_form

RNG = np.random.default_rng(0)
BEFORE = {"emb.embedding": RNG.normal(size=(16, 4)), "emb2.embedding": RNG.normal(size=(8, 4))}
UPDATE = {p: 0.05 * np.sign(RNG.normal(size=b.shape)) for p, b in BEFORE.items()}
REF = {p: b + UPDATE[p] for p, b in BEFORE.items()}


def test_a_decay_of_the_updated_parameter_is_a_decay_form():
    cand = {p: r * (1 - 5e-4) for p, r in REF.items()}  # decayed after the update
    form = fit_form(BEFORE, REF, cand)
    assert form.kind == "decay" and abs(form.coefficient - 5e-4) < 1e-6
    assert "(param after the update: a decay applied after the optimizer's update)" in form.sentence
    before_step = fit_form(BEFORE, REF, {p: REF[p] - 5e-4 * b for p, b in BEFORE.items()})
    assert before_step.kind == "decay" and "after the update" not in before_step.sentence
    # a difference of no such form stays none
    noise = {p: r + 1e-3 * RNG.normal(size=r.shape) for p, r in REF.items()}
    assert fit_form(BEFORE, REF, noise).kind != "decay"


def test_a_state_started_at_another_value_is_an_offset():
    keys = ("opt_state 0.sum_of_squares.emb.embedding", "opt_state 0.sum_of_squares.emb2.embedding")
    before = {k: np.full(b.shape, 0.1) for k, b in zip(keys, BEFORE.values(), strict=True)}
    ref = {k: b + RNG.uniform(0, 1, size=b.shape) for k, b in before.items()}
    form = fit_form(before, ref, {k: r - 0.09 for k, r in ref.items()})
    assert form.kind == "offset" and abs(form.coefficient + 0.09) < 1e-9
    assert form.sentence.startswith("a constant offset -0.09 on every element on all 2 failing leaves")
    # an offset that differs by leaf is no one offset
    mixed = {k: r - (0.09 if i else 0.5) for i, (k, r) in enumerate(ref.items())}
    assert fit_form(before, ref, mixed).kind != "offset"
