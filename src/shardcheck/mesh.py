"""Device meshes with named axes: how shardcheck builds them and reads their roles.

A mesh is ``jax.sharding.Mesh``: devices laid out on named axes, such as ``("data", "fsdp")`` for hybrid
sharding or ``("data", "model")`` for tensor parallelism (Flax NNX's "Scale up on multiple devices" guide,
MaxText). The axes have two roles:

* the **batch axes** (:func:`batch_axes`): the axes named ``"data"`` or ``"fsdp"`` (:data:`BATCH_AXIS_NAMES`);
  the batch is split over them and replicated over the others. A mesh with neither name (a 1-D mesh named
  anything, ``("x", "y")``) splits the batch over every axis. The number of data shards S is the product of
  their sizes (:func:`data_shards`);
* the **model axes** (:func:`model_axes`): the others, such as ``"model"`` / ``"tensor"`` (tensor parallelism)
  or ``"expert"``: only the model's own ``nnx.with_partitioning`` annotations split state over them, e.g. a
  column-parallel kernel ``(None, "model")`` and a row-parallel one ``("model", None)``.

Every strategy of :mod:`shardcheck.steps` splits the batch over the batch axes and places the state by the roles
of the axes:

* data parallel replicates the state on every axis;
* FSDP splits the state over the **FSDP axis** (:func:`fsdp_axis`: the axis named ``"fsdp"``, else the mesh's
  only axis or its only batch axis) and replicates it over the others (hybrid sharding: reduce-scatter over
  ``fsdp``, all-reduce over ``data``), unless the model's own annotations say otherwise.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh

from shardcheck import _validate
from shardcheck._mesh_text import _AXIS_NAME as _AXIS_NAME
from shardcheck._mesh_text import BATCH_AXIS_NAMES as BATCH_AXIS_NAMES
from shardcheck._mesh_text import FSDP_AXIS as FSDP_AXIS
from shardcheck._mesh_text import _check_spelling as _check_spelling
from shardcheck._mesh_text import parse_mesh as parse_mesh


def make_mesh(
    shape: int | Mapping[str, int] | None = None, axis_name: str = "data", *, devices: Sequence | None = None
) -> Mesh:
    """A mesh over the first devices of ``devices`` (default: :func:`shardcheck.devices.select_devices`), with
    ``Auto`` axes.

    Without ``devices`` the mesh is on the default backend when it has enough devices, else on the CPU devices
    beside it (``jax_num_cpu_devices``): on a host with one GPU, ``make_mesh(8)`` is a mesh of 8 fake CPU devices,
    never a mix of the GPU and CPU devices.

    ``jax.make_mesh`` makes ``Explicit`` axes by default in current JAX. Under Explicit axes every jitted
    operation must have an unambiguous output sharding, so plain jit code fed ``NamedSharding`` inputs can fail:
    ``nnx.Embed``'s gather of a sharded table and ``x @ w.T`` with a batch-sharded ``x`` and an FSDP-sharded
    ``w`` raise ``ShardingTypeError`` ("illegally sharded result"), and so does a reshape of a sharded array,
    unless every such op is given ``out_sharding=``. ``AxisType.Auto`` leaves those decisions to the compiler
    (GSPMD / Shardy propagation), so both code paths work: ``jax.shard_map`` (which makes the axes Manual inside
    the map either way) and jit over ``NamedSharding``-placed arrays (the ``gspmd`` strategy, a user's own
    jitted step).

    Args:
        shape: ``N`` for a 1-D mesh of N devices on axis ``axis_name``; a mapping ``{"data": 2, "fsdp": 4}``
            for a mesh with those axes, in that order (row-major over the devices); None: every device of the
            preferred platform on one axis. In a multi-process run ``jax.devices()`` lists every process's
            devices, so the mesh is global.
        axis_name: the axis of a 1-D mesh (ignored for a mapping).
        devices: the devices to lay out (their first ``prod(shape)``), e.g. ``jax.devices("cpu")``; default:
            ``select_devices(prod(shape)).devices``.

    Returns:
        A ``jax.sharding.Mesh`` whose axes all have type ``AxisType.Auto``.

    Raises:
        TypeError: ``shape`` not an int, a mapping of str to int, or None; ``axis_name`` not a non-empty str.
        ValueError: an axis size < 1, a repeated or invalid axis name, or more devices than exist (more CPU
            devices can be faked with ``jax.config.update('jax_num_cpu_devices', N)`` before JAX initializes).

    Example::

        >>> make_mesh(1).shape
        OrderedDict([('data', 1)])
        >>> make_mesh({"data": 1, "fsdp": 1}).axis_names
        ('data', 'fsdp')
    """
    fn = "make_mesh"
    from shardcheck.devices import _platform_devices, preferred_platform, select_devices

    every = list(devices) if devices is not None else None
    if every is None and shape is None:
        every = _platform_devices(preferred_platform())
    axes = _check_shape(fn, shape, axis_name, len(every or ()))
    size = math.prod(axes.values())
    listed = " x ".join(f"{name}={n}" for name, n in axes.items())
    if every is None:
        every = list(select_devices(size, what=f"the mesh {listed}", fn=fn).devices)
    if size > len(every):
        raise ValueError(
            f"{fn}: the mesh {listed} needs {size} devices, but {len(every)} were given; pass axis sizes whose "
            f"product is at most {len(every)}, or more devices"
        )
    devices = every
    return jax.make_mesh(
        tuple(axes.values()),
        tuple(axes),
        axis_types=(AxisType.Auto,) * len(axes),
        devices=devices[:size],
    )


def abstract_mesh(shape: int | Mapping[str, int], axis_name: str = FSDP_AXIS, *, fn: str = "abstract_mesh"):
    """A ``jax.sharding.AbstractMesh`` of ``Auto`` axes: axis names and sizes, no devices.

    Placement needs only the axes (``NamedSharding(abstract_mesh, spec).shard_shape(shape)``), so a layout can be
    read for more devices than exist.

    Args:
        shape: ``S`` for one axis ``axis_name`` of S, or a mapping ``{"data": 2, "fsdp": 4}`` (in that order).
        axis_name: the axis of the one-axis form (default ``"fsdp"``).
        fn: the public function named in errors.

    Raises:
        TypeError, ValueError: as :func:`make_mesh` for a bad shape (any size: no devices are needed).
    """
    axes = _check_shape(fn, shape, axis_name, 1)
    return AbstractMesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def auto_typed(tree):
    """``tree`` with every array typed by an ``Explicit`` (or ``Manual``) mesh re-typed ``Auto``: the same shards,
    the same buffers (no copy, no communication), on a mesh of the same devices and axis names whose axes are all
    ``AxisType.Auto``; every other leaf as it is.

    shardcheck's own jitted code (digests, peaks, the task's loss on a candidate's state in a replay) is written
    for ``Auto`` arrays, as the reference's and the GSPMD strategies' are. A step in JAX's explicit sharding mode
    (``jax.make_mesh(..., axis_types=(AxisType.Explicit,) * n)``, ``jax.set_mesh``) leaves its state typed by its
    sharding (``float32[32,64@model]``), on which a gather with no ``out_sharding`` or an einsum contracting a
    sharded dimension raises ``ShardingTypeError``; re-typed, the compiler places the results (GSPMD), as it
    does for a GSPMD step's state.

    Args:
        tree: any pytree (``jax.Array`` leaves re-typed where needed; NumPy arrays and scalars kept).

    Returns:
        A pytree of ``tree``'s structure (``tree`` itself where no leaf needed it).
    """
    leaves, treedef = jax.tree.flatten(tree)
    typed = [_auto_array(a) for a in leaves]
    if all(a is b for a, b in zip(typed, leaves, strict=True)):
        return tree
    return jax.tree.unflatten(treedef, typed)


def _auto_array(a):
    """One leaf of :func:`auto_typed`."""
    sharding = getattr(a, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if not isinstance(a, jax.Array) or not isinstance(mesh, Mesh):
        return a
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return a
    auto = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    retyped = jax.sharding.NamedSharding(auto, sharding.spec, memory_kind=sharding.memory_kind)
    return jax.make_array_from_single_device_arrays(a.shape, retyped, [s.data for s in a.addressable_shards])


def _check_shape(fn: str, shape, axis_name, num_devices: int) -> dict[str, int]:
    if shape is None or isinstance(shape, int) and not isinstance(shape, bool):
        if not isinstance(axis_name, str) or not axis_name:
            raise TypeError(
                f"{fn}: axis_name must be a non-empty str, got {axis_name!r}; pass e.g. axis_name='data'"
            )
        shape = {axis_name: num_devices if shape is None else shape}
    if not isinstance(shape, Mapping) or not shape:
        raise TypeError(
            f"{fn}: shape must be a device count N, a mapping of axis names to sizes such as "
            f"{{'data': 2, 'fsdp': 4}}, or None (every device), got {shape!r}"
        )
    axes = {}
    for name, n in shape.items():
        if not isinstance(name, str) or not _AXIS_NAME.match(name):
            raise ValueError(
                f"{fn}: axis name {name!r} is not an identifier; name axes like 'data', 'fsdp', 'model'"
            )
        _validate.check_int(fn, f"the size of axis {name!r}", n, minimum=1, example=f"{{{name!r}: 2}}")
        axes[name] = int(n)
    return axes


def check_mesh(fn: str, mesh) -> Mesh:
    """``mesh`` when it is a ``jax.sharding.Mesh``.

    Raises:
        TypeError: anything else, naming ``fn``, what was given and how to build one.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"{fn}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__} ({reprlib.repr(mesh)}); build one "
            "with shardcheck.make_mesh(8) or shardcheck.make_mesh({'data': 2, 'fsdp': 4})"
        )
    return mesh


def check_mesh_axis(fn: str, mesh, axis_name) -> int:
    """``mesh`` must be a ``Mesh`` with an axis ``axis_name``; returns that axis's size S."""
    check_mesh(fn, mesh)
    if not isinstance(axis_name, str) or axis_name not in mesh.axis_names:
        raise ValueError(
            f"{fn}: mesh has axes {tuple(mesh.axis_names)}, not axis_name={axis_name!r}; build the mesh with "
            f"make_mesh(N, axis_name={axis_name!r}) or pass axis_name= one of {tuple(mesh.axis_names)}"
        )
    return int(mesh.shape[axis_name])


def batch_axis_names(names) -> tuple[str, ...]:
    """The batch axes among mesh axis ``names`` (a mesh's or ``--mesh``'s): those named ``"data"`` or
    ``"fsdp"``, in order; every name when none is."""
    names = tuple(names)
    named = tuple(a for a in names if a in BATCH_AXIS_NAMES)
    return named or names


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes the batch is split over: those named ``"data"`` or ``"fsdp"``, in mesh order; every axis of a
    mesh with neither name. Each device gets ``B / data_shards(mesh)`` rows; the batch is replicated over the
    other axes (:func:`model_axes`)."""
    return batch_axis_names(mesh.axis_names)


def model_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes that split the model, not the batch (``"model"``, ``"tensor"``, ``"expert"``...): the axes that
    are not :func:`batch_axes`, in mesh order; empty for a mesh whose batch spans every axis."""
    batch = set(batch_axes(mesh))
    return tuple(a for a in mesh.axis_names if a not in batch)


def data_shards(shape: Mesh | Mapping[str, int]) -> int:
    """S, the number of batch shards: the product of the batch axes' sizes (``mesh.size`` when the batch spans
    every axis). Takes a mesh or a ``{axis: size}`` mapping (``--mesh``): ``{"data": 2, "model": 4}``
    -> 2, ``{"data": 2, "fsdp": 4}`` -> 8."""
    sizes = dict(shape.shape) if isinstance(shape, Mesh) else dict(shape)
    return math.prod(int(sizes[a]) for a in batch_axis_names(sizes))


def fsdp_axis(mesh: Mesh) -> str:
    """The axis FSDP splits unannotated state over: ``"fsdp"`` when the mesh has it, else its only axis, else its
    only batch axis (``"data"`` on a ``("data", "model")`` mesh: ZeRO over the data-parallel axis, the model
    axes split only what the annotations say).

    Raises:
        ValueError: a mesh with several axes, none named ``"fsdp"`` and not exactly one named ``"data"`` (name the
            axis to shard over ``fsdp``).
    """
    names = tuple(mesh.axis_names)
    if FSDP_AXIS in names:
        return FSDP_AXIS
    if len(names) == 1:
        return names[0]
    batch = batch_axes(mesh)
    if len(batch) == 1:
        return batch[0]
    raise ValueError(
        f"fsdp: the mesh has axes {names} and none is named {FSDP_AXIS!r}, so it is not clear which axis the "
        f"parameters are split over; name it {FSDP_AXIS!r} (e.g. make_mesh({{'data': 2, 'fsdp': 4}}) or "
        "--mesh data=2,fsdp=4), or name the data-parallel axis 'data' (e.g. --mesh data=2,model=4), or annotate "
        "every parameter with nnx.with_partitioning"
    )


def describe(mesh: Mesh) -> str:
    """``"data=2 x fsdp=4 (8 devices)"``: a mesh in words, for reports."""
    axes = " x ".join(f"{name}={int(size)}" for name, size in mesh.shape.items())
    return f"{axes} ({mesh.size} device{'s' if mesh.size != 1 else ''})"
