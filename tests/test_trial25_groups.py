"""Trial 25 (issue #36): a weight decay applied to every BatchNorm's scale and bias of a ResNet, beside conv and
dense biases that matched, read "the failing leaves ... share no ndim, name or module that the matching ones
lack": no name, ndim or path prefix separates them, their module's class does (``LeafFacts.module``)."""

from flax import nnx

from shardcheck.parity.diagnosis.grouping import NO_PROPERTY, LeafFacts, shared_property
from shardcheck.parity.harness.leaf_facts import leaf_facts, module_classes


class ResNetLet(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.conv1 = nnx.Conv(3, 4, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(4, rngs=rngs)
        self.conv2 = nnx.Conv(4, 4, (3, 3), rngs=rngs)
        self.bn2 = nnx.BatchNorm(4, rngs=rngs)
        self.head = nnx.Linear(4, 10, rngs=rngs)


def _split(model):
    facts = leaf_facts(model)
    shapes = {p: f.shape for p, f in facts.items()}
    failing = {p: s for p, s in shapes.items() if p.startswith("bn")}
    return failing, {p: s for p, s in shapes.items() if p not in failing}, facts


def test_module_classes_name_each_parameters_module():
    classes = module_classes(ResNetLet())
    assert classes["bn1.scale"] == classes["bn2.bias"] == "BatchNorm"
    assert classes["conv1.bias"] == "Conv" and classes["head.kernel"] == "Linear"


def test_a_group_held_by_one_module_class_is_named_by_it():
    failing, matching, facts = _split(ResNetLet())
    assert shared_property(failing, matching, facts) == (
        "every failing leaf is held by a BatchNorm module; every leaf held by a Conv or Linear module matches"
    )
    # without the module facts: the modules' names, bn1 and bn2 (trial 37: head1 and head2)
    plain = {p: LeafFacts(f.shape, f.dtype) for p, f in facts.items()}
    assert shared_property(failing, matching, plain) == (
        "every failing leaf is under bn* (bn1, bn2); every other leaf matches"
    )
    # where a matching leaf lies under a module of that name too, nothing is shared
    assert NO_PROPERTY in shared_property(failing, {**matching, "bn3.scale": (4,)}, plain)
    # a class that holds a matching leaf too is no property of the failing ones
    some = {p: s for p, s in failing.items() if p.startswith("bn1")}
    assert "BatchNorm" not in shared_property(some, {**matching, "bn2.scale": (4,)}, facts)


def test_a_decay_missing_from_the_candidates_momentum_may_sit_after_it():
    """Trial 25: a weight decay applied after the momentum (decoupled) instead of before it (coupled) read only
    "the reference applies a decay the candidate skips"; the candidate applied it, elsewhere in its chain."""
    import numpy as np

    from shardcheck.parity.diagnosis.form import state_decay

    p = np.linspace(-1.0, 1.0, 12).reshape(3, 4)
    dr = 0.5 * p + 0.1
    form = state_decay({"opt_state 0.trace.w": (p, dr, dr - 5e-4 * p)}, {"opt_state 0.trace.w": p})
    assert form.kind == "state_decay" and abs(form.coefficient - 5e-4) < 1e-9
    assert (
        "the reference applies it where the candidate skips it, or applies it elsewhere in its chain (after "
        "the momentum" in form.sentence
    )
    added = state_decay({"opt_state 0.trace.w": (p, dr, dr + 5e-4 * p)}, {"opt_state 0.trace.w": p})
    assert "after the momentum" not in added.sentence
