"""What the failing leaves of a stage share, and what the matching ones do.

:func:`shared_property` names the property that separates the failing leaves from the matching ones: one ndim,
one set of name suffixes, a module path prefix, one module in every layer of a list (``blocks.*.moe.router``);
with :class:`LeafFacts` (where the harness knows them) also the leaf's role (embedding, norm, bias, kernel), its
dtype, the mesh axes of its placement, and whether it is tied (shared by several modules).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping

# a module whose name holds one of these is a normalization layer
NORM_NAMES = ("norm", "ln")
# the grouping's sentence where no property separates the failing leaves from the matching ones
NO_PROPERTY = "share no ndim, name or module that the matching ones lack"


@dataclasses.dataclass(frozen=True)
class LeafFacts:
    """What the harness knows of a parameter leaf beside its path.

    Attributes:
        shape: the leaf's global shape.
        dtype: its dtype's name, e.g. ``"float32"``.
        axes: the mesh axes its placement splits it over (``()``: replicated on every device).
        tied: the leaf is shared by several modules (one ``nnx.Param`` reached by two paths).
        shared_by: the paths that reach a tied leaf (``("embed.embedding", "head.kernel")``), else ``()``.
        uses: the operations of the loss that read the leaf (primitive names: ``("gather", "transpose")`` for a
            table both looked up and multiplied), ``None`` where not known.
        group: the optimizer's parameter group that updates the leaf (an ``optax.multi_transform`` label,
            read from where its state keeps the leaf), ``None`` where not known or not grouped.
        module: the class name of the module that holds the leaf (``"BatchNorm"``, ``"Linear"``), ``None``
            where not known.
        dims: the dimensions its placement splits, in order (``(2,)`` for a stacked ``(layers, d, h)`` kernel
            split along ``h``), ``None`` where not known.
    """

    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    axes: tuple[str, ...] = ()
    tied: bool = False
    shared_by: tuple[str, ...] = ()
    uses: tuple[str, ...] | None = None
    group: str | None = None
    module: str | None = None
    dims: tuple[int, ...] | None = None


def leaf_name(path: str) -> str:
    """A leaf's name in a group sentence: its last path component, or where that is a bare index (an item of an
    ``nnx.List``: ``model.ema.3``, ``ws.0``) its container's name with ``item`` (``"ema item"``): a sentence
    never calls a leaf "a 3"."""
    parts = path.split(".")
    if not parts[-1].isdigit():
        return parts[-1]
    named = [n for n in parts if not n.isdigit()]
    return f"{named[-1]} item" if named else "list item"


def role(path: str) -> str:
    """A leaf's role from its dotted path: ``"embedding"``, ``"norm scale"`` / ``"norm bias"`` (its module's name
    holds ``norm`` or ``ln``), ``"bias"``, ``"kernel"``, or the last name (:func:`leaf_name`)."""
    parts = path.split(".")
    last = leaf_name(path)
    module = parts[-2].lower() if len(parts) > 1 else ""
    if last == "embedding" or "embed" in module:
        return "embedding"
    if any(n in module for n in NORM_NAMES) and last in ("scale", "bias"):
        return f"norm {last}"
    if last in ("kernel", "weight"):
        return "kernel"
    return last


def along(axes) -> str:
    """``" along 'data'"`` (``" along 'data', 'fsdp'"``) for the mesh axes a leaf's copies differ along, ``""``
    where none was found (a leaf split over 'model' is replicated along 'data' only: trial 32)."""
    return f" along {', '.join(repr(a) for a in axes)}" if axes else ""


def n_leaves(n: int) -> str:
    """``"1 leaf"``, ``"2 leaves"``."""
    return f"{n} leaf" if n == 1 else f"{n} leaves"


def words_and(words) -> str:
    """``"a, b and c"``; ``"a"``; ``""`` for none."""
    words = [str(w) for w in words]
    return ", ".join(words[:-1]) + f" and {words[-1]}" if len(words) > 1 else "".join(words)


def article(noun: str) -> str:
    """``noun`` with its indefinite article: ``"an embedding"``, ``"a bias or kernel"``."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def param_path(path: str, params) -> str:
    """The parameter path an optimizer-state path ends in (``"0.mu.a.kernel"`` -> ``"a.kernel"``), the path
    itself where none of ``params`` is its tail."""
    if path in params:
        return path
    tails = [p for p in params if path.endswith("." + p)]
    return max(tails, key=len) if tails else path


def as_parameters(
    failing: dict[str, tuple[int, ...] | None],
    matching: dict[str, tuple[int, ...] | None],
    params: Mapping[str, tuple[int, ...] | None],
) -> tuple[dict, dict] | None:
    """Optimizer-state leaves read as the parameters they belong to (``"0.mu.a.kernel"`` -> ``"a.kernel"``):
    ``(failing parameters, the matching ones)`` with their shapes from ``params``, so that a
    module or name is read from the parameter's path (``"0.mu.blocks.1.mlp.down.bias"`` is under
    ``blocks.1.mlp.down``, which its ``0.`` prefix hid). ``None`` where some leaf of ``failing`` or ``matching``
    is no parameter's state (its path ends in none of ``params``), or where some parameter's state both fails and
    matches (Adam's mu of a.kernel failing, its nu matching)."""
    paths = [*failing, *matching]
    of = {p: param_path(p, params) for p in paths}
    if not params or any(of[p] not in params for p in paths):
        return None
    bad = {of[p]: params[of[p]] for p in failing}
    # one parameter's state both fails and matches: the parameters do not split
    if any(of[p] in bad for p in matching):
        return None
    return bad, {of[p]: params[of[p]] for p in matching}


def rounding_params(unresolved: Collection[str]) -> frozenset[str]:
    """The parameter paths of a record's ``rounding_level`` and ``unresolved`` names (``"param PATH"``: a
    gradient at rounding level), the ``quiet`` of :func:`state_property`."""
    return frozenset(u.split(" ", 1)[-1] for u in unresolved)


def _ndim_class(ndims: set[int], others: set[int]) -> str:
    """``"ndim >= 2"``, ``"ndim <= 1"`` or ``"another ndim"`` for the ``others`` leaves beside ``ndims``."""
    if min(others) > max(ndims):
        return f"ndim >= {min(others)}"
    if max(others) < min(ndims):
        return f"ndim <= {max(others)}"
    return "another ndim"


def shared_property(
    failing: dict[str, tuple[int, ...] | None],
    matching: dict[str, tuple[int, ...] | None],
    facts: Mapping[str, LeafFacts] | None = None,
    names: Mapping[str, str] | None = None,
) -> str:
    """The sentence naming what the failing leaves share and the matching ones lack.

    Tries, in order: with ``facts``, tying (``"every failing leaf is tied: embed.embedding is shared by
    embed.embedding and head.kernel; every untied leaf matches"``, where every failing leaf is tied and no
    matching one is), then several uses in the loss (every failing leaf read by two or more operations, every
    matching one by one: a table both looked up and multiplied); one ndim (``"every failing leaf is 1-D (bias, scale); every leaf of ndim >= 2 matches"``),
    one set of name suffixes no matching leaf ends in (``"every failing leaf is a bias; every kernel matches"``),
    a module path prefix no matching leaf lies under (``"every failing leaf is under blocks.1; every other
    leaf matches"``), one module in several layers of a list, its layer indices read as ``*``, that no
    matching leaf lies under (:func:`layer_module`: ``"every failing leaf is under blocks.*.moe.router (in every
    layer); every other leaf matches"``; a scan's stacked layers share one path, a prefix), and with ``facts``
    one module class (:func:`_module_class`: ``"every failing leaf is held by a BatchNorm module; ..."``).
    Between the last two, with ``facts``: one role (``"every failing leaf is a norm scale; every leaf that is a bias or a kernel
    matches"``), one dtype, one placement (``"every failing leaf is split over ('model',)"``), tied or not, one
    parameter group of the optimizer (``"every failing leaf is in the optimizer's parameter group 'mp'"``).

    Args:
        failing: ``{dotted path: shape or None}`` of the leaves out of tolerance (at least one).
        matching: the same for the leaves within tolerance, of the same kind.
        facts: ``{parameter path: LeafFacts}``, where known (an optimizer-state path is read as the parameter
            path it ends in).
        names: ``{dotted path: the name a leaf is listed by}`` where the sentence lists leaves (the stage table's
            ``"opt_state 0.mu.a.kernel"``); a path not in it is listed as itself.

    Returns:
        The sentence, without a final period; where no property separates the two sets, the failing leaf's
        name (``"only a.kernel differs; every other leaf matches"``) or the failing leaves' names (``"the
        failing leaves (a.kernel, b.bias) share no ndim, name or module that the matching ones lack"``).

    Raises:
        ValueError: ``failing`` is empty.
    """
    if not failing:
        raise ValueError(
            "shared_property: failing is empty; pass the paths (and shapes) of the failing leaves"
        )
    tied = (
        (_tied(list(failing), list(matching), facts) or _reused(failing, matching, facts)) if facts else None
    )
    if tied is not None:
        return tied
    suffix = {p: leaf_name(p) for p in [*failing, *matching]}
    suffixes = ", ".join(sorted({suffix[p] for p in failing}))
    shapes = [failing[p] for p in failing]
    if all(shape is not None for shape in shapes):
        ndims = {len(shape) for shape in shapes}
        other = {len(s) for s in matching.values() if s is not None}
        if len(ndims) == 1 and not other & ndims:
            (d,) = ndims
            head = f"every failing leaf is {d}-D ({suffixes})"
            if not matching:
                return head
            if all(s is not None for s in matching.values()):
                return f"{head}; every leaf of {_ndim_class(ndims, other)} matches"
    mine = {suffix[p] for p in failing}
    theirs = {suffix[p] for p in matching}
    if matching and not mine & theirs:
        which = " or ".join(sorted(mine))
        rest = ", ".join(sorted(theirs))
        return f"every failing leaf is {article(which)}; every {rest} matches"
    found = _facts_property(list(failing), list(matching), facts) if facts and matching else None
    if found is not None:
        return found
    prefix = common_prefix(list(failing))
    if prefix and matching and not any(p == prefix or p.startswith(prefix + ".") for p in matching):
        return f"every failing leaf is under {prefix}; every other leaf matches"
    layered = _layered_module(list(failing), list(matching))
    if layered:
        return f"every failing leaf is under {layered} (in every layer); every other leaf matches"
    found = _module_class(list(failing), list(matching), facts) if facts and matching else None
    numbered = _numbered_modules(list(failing), list(matching))
    if not found and numbered:
        return f"every failing leaf is under {numbered}; every other leaf matches"
    return found or _no_property(failing, matching, names or {})


def _module_class(failing: list[str], matching: list[str], facts: Mapping[str, LeafFacts]) -> str | None:
    """``"every failing leaf is held by a BatchNorm module; every leaf held by a Conv or Linear module
    matches"`` where one module class (``LeafFacts.module``) holds every failing leaf and no matching one; else
    ``None`` (trial 25: a decay on every BatchNorm's scale and bias, beside conv biases that matched)."""

    def of(p: str) -> str | None:
        f = facts.get(param_path(p, facts))
        return None if f is None else f.module

    mine = {of(p) for p in failing}
    if len(mine) != 1 or None in mine:
        return None
    (cls,) = mine
    theirs = sorted({c for c in (of(p) for p in matching) if c is not None})
    if cls in theirs:
        return None
    head = f"every failing leaf is held by {article(cls)} module"
    return head if not theirs else f"{head}; every leaf held by {article(' or '.join(theirs))} module matches"


def layer_module(path: str) -> str:
    """A leaf's parent module with its layer indices replaced by ``*``: ``"blocks.1.moe.router.kernel"`` ->
    ``"blocks.*.moe.router"``, the same module in every item of an ``nnx.List`` of layers. A leading run of
    indices (an optimizer state's ``"1.0.mu..."``) is kept: it numbers the optimizer's states, not layers."""
    parts = path.split(".")[:-1]
    lead = next((i for i, n in enumerate(parts) if not n.isdigit()), len(parts))
    return ".".join(parts[:lead] + ["*" if n.isdigit() else n for n in parts[lead:]])


def _layered_module(failing: list[str], matching: list[str]) -> str:
    """The :func:`layer_module` every failing leaf shares, where it holds an index (the failing leaves lie in
    several layers) and no matching leaf lies under it; ``""`` otherwise."""
    modules = {layer_module(p) for p in failing}
    if len(modules) != 1 or not matching:
        return ""
    (module,) = modules
    if "*" not in module.split("."):
        return ""
    under = [layer_module(p) for p in matching]
    return "" if any(m == module or m.startswith(module + ".") for m in under) else module


def _numbered_modules(failing: list[str], matching: list[str]) -> str:
    """``"head* (head1, head2)"`` where the failing leaves lie under several modules whose names differ only in
    a number (``head1``, ``head2``: attributes, not an ``nnx.List``), at one place under a common prefix, and no
    matching leaf lies under a module of that name; ``""`` otherwise (trial 37: a head's two layers left
    unreduced read "share no ndim, name or module")."""
    parts = [p.split(".")[:-1] for p in failing]
    at = len(common_prefix(failing).split(".")) if common_prefix(failing) else 0
    if not matching or any(len(p) <= at for p in parts):
        return ""
    names = sorted({p[at] for p in parts})
    stems = {re.sub(r"[_\d]+$", "", n) for n in names}
    if len(names) < 2 or len(stems) != 1 or not next(iter(stems)) or any(n.isdigit() for n in names):
        return ""
    (stem,) = stems
    prefix = ".".join(parts[0][:at])
    pattern = re.compile(re.escape(prefix + "." if prefix else "") + re.escape(stem) + r"[_\d]*\.")
    if any(pattern.match(p) for p in matching):
        return ""
    return f"{prefix + '.' if prefix else ''}{stem}* ({', '.join(names)})"


def _no_property(failing, matching, names: Mapping[str, str]) -> str:
    """:func:`shared_property`'s sentence where no property separates the leaves: the leaves named (``names``)."""
    if not matching:
        return f"all {len(failing)} leaves differ"
    if len(matching) <= 2 and len(failing) > 2 * len(matching):  # counted with the exceptions
        return f"all {len(failing) + len(matching)} leaves but {' and '.join(_named(matching, names))} differ"
    if len(failing) == 1:
        return f"only {_named(failing, names)[0]} differs; every other leaf matches"
    listed = ", ".join(_named(failing, names)[:6]) + (", ..." if len(failing) > 6 else "")
    return f"the failing leaves ({listed}) {NO_PROPERTY}"


def _named(paths, names: Mapping[str, str]) -> list[str]:
    """``paths`` sorted, each by its name in ``names`` (itself where none)."""
    return [names.get(p, p) for p in sorted(paths)]


def state_property(
    failing: dict[str, tuple[int, ...] | None],
    matching: dict[str, tuple[int, ...] | None],
    params: Mapping[str, tuple[int, ...] | None],
    facts: Mapping[str, LeafFacts] | None = None,
    names: Mapping[str, str] | None = None,
    quiet: Collection[str] = (),
    differ_later: Collection[str] = (),
) -> str:
    """:func:`shared_property` of leaves that may be optimizer state; where their own paths share nothing
    (:data:`NO_PROPERTY`: ``0.mu.blocks.1.mlp.down.bias`` lies under ``0``, as every other state leaf does), what
    the parameters they belong to share (:func:`as_parameters`): ``"every failing leaf is under blocks.1.mlp.down;
    every other leaf matches"``. ``params``: ``{parameter path: shape}``; ``facts`` and ``names`` as
    :func:`shared_property`.

    ``quiet``: the parameter paths whose gradient is at rounding level (``StepRecord.unresolved``, a true gradient
    of 0 such as an attention key bias's), which match under any difference of the gradients. Where the sentence
    names nothing (:data:`NO_PROPERTY`, ``"all 9 leaves but ... differ"``) and such matching leaves (a parameter
    or its optimizer state, ``"0.mu.<path>"``) are all that contradict a property, that property, with them
    named: ``"every failing leaf is under blocks.0.attn; the other leaves under it are at rounding level (a true
    gradient of 0 shows no difference): blocks.0.attn.key.bias; every other leaf matches"``. Where every failing
    leaf's matching ones are such leaves, that every leaf differs but them (:data:`ROUNDING_ELEMENTS`); where each
    of their parameters differs in the step's applied update (``differ_later``: parameter paths), that every leaf
    differs, those only matching this stage within their noise allowance."""
    sentence = _state_property(failing, matching, params, facts, names)
    noise = sorted(p for p in matching if param_path(p, params) in quiet)
    rest = {p: shape for p, shape in matching.items() if p not in noise}
    # every leaf differs but those at rounding level: a property read against them alone says nothing ("every
    # failing leaf is split over ('fsdp',); every replicated leaf matches" of one key bias), nor does "no property"
    if noise and not rest and (NO_PROPERTY in sentence or not _names_nothing(sentence)):
        return _all_but_rounding(sorted({param_path(p, params) for p in noise}), differ_later)
    if not quiet or not _names_nothing(sentence):
        return sentence
    said = _state_property(failing, rest, params, facts, names) if noise and rest else sentence
    if _names_nothing(said):
        return sentence
    aside = []  # only the leaves that contradict it are named (not a rounding-level leaf of another module)
    for p in noise:
        back = {**rest, p: matching[p]}
        if _state_property(failing, back, params, facts, names) == said:
            rest = back
        else:
            aside.append(p)
    return _with_rounding(said, sorted({param_path(p, params) for p in aside}))


def _state_property(failing, matching, params, facts, names) -> str:
    sentence = shared_property(failing, matching, facts, names)
    mapped = as_parameters(failing, matching, params) if NO_PROPERTY in sentence else None
    if mapped is None:
        return sentence
    said = shared_property(*mapped, facts)
    return sentence if NO_PROPERTY in said else said


def _names_nothing(sentence: str) -> bool:
    """Whether a grouping sentence names no property: it lists the leaves, or counts all but a few."""
    return NO_PROPERTY in sentence or (sentence.startswith("all ") and " but " in sentence)


ROUNDING_SHOWN = 4
"""The rounding-level parameters a group sentence lists by name (the rest counted)."""

ROUNDING_ELEMENTS = (
    "elements whose gradient is at rounding level (near 0 at that step: a true gradient of 0, such as an attention "
    "key bias's, or one small by chance)"
)
"""What a parameter "at rounding level" has, as the records show it: some elements whose reference gradient lies
within its tolerance of 0 at that step, whether 0 by the model's structure or small by chance (a kernel whose
smallest gradient element is 8.3e-8 while its largest is 0.032)."""


def _all_but_rounding(quiet_params: list[str], differ_later: Collection[str]) -> str:
    """Every leaf of a stage differs but the rounding-level parameters' ``quiet_params`` (their leaves match,
    allowed their noise), listed; where each of those parameters differs in the applied update
    (``differ_later``), every leaf is said to differ, those matching this stage only within their allowance."""
    listed = ", ".join(quiet_params[:ROUNDING_SHOWN])
    if len(quiet_params) > ROUNDING_SHOWN:
        listed += f" and {len(quiet_params) - ROUNDING_SHOWN} more"
    if all(p in differ_later for p in quiet_params):
        return (
            f"every leaf differs: those with {ROUNDING_ELEMENTS} match this stage only within their noise "
            f"allowance, and their applied parameters differ: {listed}"
        )
    return f"every leaf differs but those with {ROUNDING_ELEMENTS}, allowed their noise: {listed}"


def _with_rounding(said: str, noise: list[str]) -> str:
    """``said`` (``"head; every other leaf matches"``) with the rounding-level parameters ``noise`` named after
    its head: under a module prefix, the other leaves under it; else the matching leaves that share the
    property."""
    listed = ", ".join(noise[:ROUNDING_SHOWN])
    if len(noise) > ROUNDING_SHOWN:
        listed += f" and {len(noise) - ROUNDING_SHOWN} more"
    head, _, rest = said.partition("; ")
    which = (
        "the other leaves under it"
        if head.startswith("every failing leaf is under ")
        else ("the matching leaves that share it")
    )
    clause = f"{which} are at rounding level (a true gradient of 0 shows no difference): {listed}"
    return "; ".join(x for x in (head, clause, rest) if x)


def common_prefix(paths: list[str]) -> str:
    """The longest dotted module prefix of every path (not a whole path), ``""`` where none."""
    parts = [p.split(".")[:-1] for p in paths]
    common = []
    for names in zip(*parts, strict=False):
        if len(set(names)) != 1:
            break
        common.append(names[0])
    return ".".join(common)


def _tied(failing: list[str], matching: list[str], facts: Mapping[str, LeafFacts]) -> str | None:
    """``"every failing leaf is tied: a is shared by a and b; every untied leaf matches"`` where every failing
    leaf is tied and no matching leaf is, else ``None``."""

    def of(p: str) -> LeafFacts | None:
        return facts.get(param_path(p, facts))

    mine = [of(p) for p in failing]
    if not all(f is not None and f.tied for f in mine) or any((of(p) or LeafFacts()).tied for p in matching):
        return None
    params = sorted({param_path(p, facts) for p in failing})
    said = "; ".join(
        f"{p} is shared by {' and '.join(facts[p].shared_by) or 'several modules'}" for p in params
    )
    head = f"every failing leaf is tied: {said}"
    return f"{head}; every untied leaf matches" if matching else head


def _reused(failing, matching, facts: Mapping[str, LeafFacts]) -> str | None:
    """``"every failing leaf is read by several operations of the loss, one weight with several uses (shared or
    tied): embed.embedding by gather and transpose; every leaf read by one operation matches"`` where that holds
    of every failing leaf and of no matching one whose uses are known (at least one), else ``None``."""

    def uses(p: str):
        f = facts.get(param_path(p, facts))
        return None if f is None else f.uses

    mine = {p: uses(p) for p in failing}
    theirs = [uses(p) for p in matching if uses(p) is not None]
    if any(u is None or len(u) < 2 for u in mine.values()) or not theirs or any(len(u) > 1 for u in theirs):
        return None
    params = sorted({param_path(p, facts): mine[p] for p in failing}.items())
    said = "; ".join(f"{p} by {' and '.join(u) if len(u) == 2 else ', '.join(u)}" for p, u in params)
    return (
        "every failing leaf is read by several operations of the loss, one weight with several uses (shared or "
        f"tied): {said}; every leaf read by one operation matches"
    )


def _facts_property(failing: list[str], matching: list[str], facts: Mapping[str, LeafFacts]) -> str | None:
    """The first of role, dtype, placement axes, tying and the optimizer's parameter group that all the failing
    leaves share and no matching leaf has, as a sentence; ``None`` where none does."""

    def fact(name: str, p: str):
        f = facts.get(param_path(p, facts))
        if name == "role":
            return role(param_path(p, facts))
        return None if f is None else getattr(f, name)

    words = {
        "role": article,
        "dtype": lambda v: f"{v}",
        "axes": lambda v: f"split over {tuple(v)}" if v else "replicated on every device",
        "tied": lambda v: "tied (shared by several modules)" if v else "untied",
        "group": lambda v: f"in the optimizer's parameter group {v!r}",
    }
    for name, say in words.items():
        mine = {fact(name, p) for p in failing}
        if len(mine) != 1 or None in mine:
            continue
        (v,) = mine
        theirs = {fact(name, p) for p in matching}
        if v in theirs:
            continue
        rest = sorted({say(t) for t in theirs if t is not None})
        head = f"every failing leaf is {say(v)}" + (
            " (an optax.multi_transform label)" if name == "group" else ""
        )
        return head if not rest else f"{head}; every leaf that is {' or '.join(rest)} matches"
    return None
