"""Many processes, one mesh: JAX's distributed runtime under the same SPMD steps.

A multi-process run is P processes, each owning N devices, that together form one global mesh of P * N
devices. Every process runs the same program. JAX's distributed runtime (a coordinator service in process 0, a
client in every process) lets them agree on the global device list; XLA's CPU collectives (gloo over TCP, the
default ``jax_cpu_collectives_implementation``) carry the all-reduces and all-gathers between them. The steps
do not change: only the batch is built from process-local rows (:func:`global_batch`), and results that no
process holds whole are gathered (:func:`gather_to_host`) before process 0 (:func:`is_main_process`) prints.

Every ``shardcheck`` subcommand calls :func:`initialize_from_env` before it computes anything, so one command
line runs on one process or many; the environment decides:

==================================  ==========================================================================
``SHARDCHECK_COORDINATOR``          ``HOST:PORT`` of the coordinator (process 0's host); unset: one process.
``SHARDCHECK_NUM_PROCESSES``        P, the number of processes (required with the coordinator).
``SHARDCHECK_PROCESS_ID``           this process's rank in ``[0, P)``; rank 0 runs the coordinator service.
``SHARDCHECK_DEVICES_PER_PROCESS``  N fake CPU devices for this process (``jax_num_cpu_devices``); optional.
``SHARDCHECK_COORDINATOR_BIND``     ``HOST:PORT`` the coordinator listens on. Default: the coordinator
                                    address when its host is a loopback address, else JAX's default (all
                                    interfaces, which a multi-host cluster needs).
``SHARDCHECK_INIT_TIMEOUT_S``       seconds to wait for every process to join (default 300, JAX's).
``SHARDCHECK_CLUSTER_DETECTION``    ``off``: never join a cluster found by JAX's detection (below).
==================================  ==========================================================================

:func:`shardcheck.launcher.launch` (``shardcheck launch``) sets these for P processes on this machine, for a
subcommand or any command (``-- python my_check.py``: the script joins with one call to
:func:`initialize_from_env`). On a cluster there are two ways (``docs/distributed.md``): the job script sets
the variables above in every process, or it sets none of them and :func:`initialize_from_env` falls back to
``jax.distributed.initialize()``'s own cluster detection (Slurm, Open MPI, Kubernetes, Cloud TPU), used when it
finds a cluster of more than one process; with neither, the process runs alone.

Host values onto the global mesh: :func:`place_host_tree` places a tree that every process holds whole (the
state of a freshly built model, a batch) without communication; ``jax.device_put`` of a host value to a sharding
spanning processes is a collective and deadlocks when the processes reach it in a different order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import ipaddress
import os
import socket
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

ENV_COORDINATOR = "SHARDCHECK_COORDINATOR"
ENV_NUM_PROCESSES = "SHARDCHECK_NUM_PROCESSES"
ENV_PROCESS_ID = "SHARDCHECK_PROCESS_ID"
ENV_DEVICES_PER_PROCESS = "SHARDCHECK_DEVICES_PER_PROCESS"
ENV_COORDINATOR_BIND = "SHARDCHECK_COORDINATOR_BIND"
ENV_INIT_TIMEOUT = "SHARDCHECK_INIT_TIMEOUT_S"
ENV_CLUSTER_DETECTION = "SHARDCHECK_CLUSTER_DETECTION"

#: Exit status of process 0 when its coordinator service could not bind its port (``EX_TEMPFAIL``); the
#: launcher answers it by retrying on another free port.
EXIT_COORDINATOR_BIND_FAILED = 75

PyTree = Any


class CoordinatorBindError(RuntimeError):
    """Process 0 could not start the coordinator service on its address (most often: the port is in use)."""

    exit_status = EXIT_COORDINATOR_BIND_FAILED


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process run; read from the environment by :func:`config_from_env`.

    Attributes:
        coordinator_address: ``HOST:PORT`` every process connects to.
        num_processes: P >= 1.
        process_id: this process's rank in ``[0, P)``.
        devices_per_process: N fake CPU devices of this process, or None to keep JAX's default.
        coordinator_bind_address: ``HOST:PORT`` process 0's service listens on; None for JAX's default
            (``[::]:PORT``, all interfaces).
        initialization_timeout_s: seconds to wait for every process to join.
    """

    coordinator_address: str
    num_processes: int
    process_id: int
    devices_per_process: int | None = None
    coordinator_bind_address: str | None = None
    initialization_timeout_s: int = 300


def _env_int(fn: str, env: Mapping[str, str], name: str, low: int, rule: str) -> int | None:
    text = env.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{fn}: {name}={text!r} is not an integer; {rule}") from None
    if value < low:
        raise ValueError(f"{fn}: {name}={value} must be >= {low}; {rule}")
    return value


def _check_address(fn: str, name: str, address: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{fn}: {name}={address!r} is not HOST:PORT; set it like 127.0.0.1:8476 or node0:8476"
        )
    return host


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def config_from_env(environ: Mapping[str, str] | None = None) -> DistributedConfig | None:
    """The :class:`DistributedConfig` the ``SHARDCHECK_*`` variables describe, or None for a single process.

    Args:
        environ: the environment to read (default ``os.environ``).

    Returns:
        None when ``SHARDCHECK_COORDINATOR`` is unset or empty, else the config.

    Raises:
        ValueError: the coordinator is set but ``SHARDCHECK_NUM_PROCESSES`` or ``SHARDCHECK_PROCESS_ID`` is
            missing, not an integer or out of range; an address is not ``HOST:PORT``; a timeout or device
            count is not a positive integer; the process count or id is set without a coordinator.
    """
    fn = "config_from_env"
    env = os.environ if environ is None else environ
    coordinator = env.get(ENV_COORDINATOR, "").strip()
    num_processes = _env_int(fn, env, ENV_NUM_PROCESSES, 1, "set it to the number of processes P")
    process_id = _env_int(fn, env, ENV_PROCESS_ID, 0, "set it to this process's rank, 0 <= rank < P")
    devices = _env_int(fn, env, ENV_DEVICES_PER_PROCESS, 1, "set it to the devices each process owns")
    timeout_s = _env_int(fn, env, ENV_INIT_TIMEOUT, 1, "set it to a number of seconds")
    if not coordinator:
        if num_processes is not None or process_id is not None:
            raise ValueError(
                f"{fn}: {ENV_NUM_PROCESSES} / {ENV_PROCESS_ID} are set but {ENV_COORDINATOR} is not; set "
                f"{ENV_COORDINATOR}=HOST:PORT of process 0, or unset them for a single-process run"
            )
        return None
    host = _check_address(fn, ENV_COORDINATOR, coordinator)
    bind = env.get(ENV_COORDINATOR_BIND) or None
    if bind is not None:
        _check_address(fn, ENV_COORDINATOR_BIND, bind)
    elif _is_loopback(host):
        bind = coordinator  # a loopback coordinator needs no other interface
    if num_processes is None or process_id is None:
        missing = ENV_NUM_PROCESSES if num_processes is None else ENV_PROCESS_ID
        raise ValueError(f"{fn}: {ENV_COORDINATOR}={coordinator} is set but {missing} is not; set both")
    if process_id >= num_processes:
        raise ValueError(
            f"{fn}: {ENV_PROCESS_ID}={process_id} is not below {ENV_NUM_PROCESSES}={num_processes}; "
            f"ranks are 0 .. {num_processes - 1}"
        )
    return DistributedConfig(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        devices_per_process=devices,
        coordinator_bind_address=bind,
        initialization_timeout_s=300 if timeout_s is None else timeout_s,
    )


def initialize(config: DistributedConfig) -> None:
    """Join the multi-process run ``config`` describes: the CPU device count, then ``jax.distributed``.

    Must run before JAX initializes a backend (before the first ``jax.devices()`` or array). Sets
    ``jax_num_cpu_devices`` when ``config.devices_per_process`` is given, then calls
    ``jax.distributed.initialize`` with the config's addresses; CPU collectives are gloo, JAX's default.
    Afterwards native writes to file descriptor 1 (gloo announces its connections there) go to stderr while
    ``sys.stdout`` keeps the original stdout, so that a ``--json -`` document stays parseable.

    Args:
        config: from :func:`config_from_env`.

    Raises:
        CoordinatorBindError: in process 0, the coordinator service could not listen on
            ``config.coordinator_bind_address`` (usually: the port is in use; choose another).
        RuntimeError: JAX's own errors, e.g. the other processes did not join within
            ``config.initialization_timeout_s`` seconds, or a backend was already initialized.
    """
    import jax

    if config.devices_per_process is not None:
        jax.config.update("jax_num_cpu_devices", config.devices_per_process)
    if config.process_id == 0:
        _check_port_free(config.coordinator_bind_address or config.coordinator_address)
    try:
        jax.distributed.initialize(
            coordinator_address=config.coordinator_address,
            num_processes=config.num_processes,
            process_id=config.process_id,
            initialization_timeout=config.initialization_timeout_s,
            coordinator_bind_address=config.coordinator_bind_address,
        )
    except jax.errors.JaxRuntimeError as err:
        if config.process_id == 0 and "Failed to start RPC server" in str(err):
            where = config.coordinator_bind_address or config.coordinator_address
            raise CoordinatorBindError(
                f"initialize: the coordinator service could not listen on {where} (is the port in use?); "
                f"choose another port in {ENV_COORDINATOR}"
            ) from err
        raise
    _route_native_stdout_to_stderr()


def _check_port_free(address: str) -> None:
    """Raise :class:`CoordinatorBindError` if something already listens on ``address``.

    gRPC's own failure to bind is a log line, then sometimes a crash (SIGSEGV) rather than an exception; a
    probe socket (with ``SO_REUSEADDR``, as gRPC sets it) turns the common case into a clean error.
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            None if host in ("", "::", "0.0.0.0") else host,
            int(port),
            type=socket.SOCK_STREAM,
            flags=socket.AI_PASSIVE,
        )[0]
    except (OSError, ValueError):
        return  # let JAX report an address it cannot resolve
    with contextlib.closing(socket.socket(family, kind, proto)) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                return
            raise CoordinatorBindError(
                f"initialize: the coordinator cannot listen on {address}: the port is in use; choose another "
                f"port in {ENV_COORDINATOR}"
            ) from None


def detected_cluster() -> tuple[str, int | None] | None:
    """The cluster environment ``jax.distributed.initialize()`` would detect here, without joining it.

    Asks JAX's own detection (``jax._src.clusters.ClusterEnv``: Slurm, Open MPI, Kubernetes, Cloud TPU) the
    question ``jax.distributed.initialize()`` asks first: which registered environment ``is_env_present()``
    (opt-in-only methods such as ``mpi4py`` are skipped, as JAX skips them by default). Reads ``os.environ``
    (and, on a Cloud TPU VM, its metadata server, as JAX does). That API is private: if it is missing or
    changed, the answer is None (a single process), never an error.

    Returns:
        ``(name, process_count)``, e.g. ``("slurm", 4)``, with ``process_count`` None where the environment
        cannot say it; None when no cluster is detected, or ``SHARDCHECK_CLUSTER_DETECTION=off``.
    """
    if os.environ.get(ENV_CLUSTER_DETECTION, "").strip().lower() in ("off", "0", "false", "no"):
        return None
    try:
        from jax._src.clusters import ClusterEnv

        candidates = [env for env in ClusterEnv._cluster_types if not env.opt_in_only_method]
        found = next((env for env in candidates if env.is_env_present()), None)
    except Exception:  # a private API: any change to it means "no cluster", not a crash
        return None
    if found is None:
        return None
    try:
        count = int(found.get_process_count())
    except Exception:
        count = None
    return (found.name or found.__name__, count)


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return False


def initialize_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Join a multi-process run if the environment describes one: ``SHARDCHECK_*`` variables, else a cluster.

    Two ways, tried in order (module docstring, ``docs/distributed.md``):

    1. ``SHARDCHECK_COORDINATOR`` is set (``shardcheck launch`` sets it; a job script may): join with the
       ``SHARDCHECK_*`` variables (:func:`config_from_env`, :func:`initialize`).
    2. Otherwise, when JAX's own cluster detection finds a cluster of more than one process
       (:func:`detected_cluster`: Slurm's ``SLURM_*``, Open MPI's ``OMPI_MCA_orte_hnp_uri``, a Kubernetes
       job, a Cloud TPU pod), call ``jax.distributed.initialize()`` with no arguments, so JAX reads the
       coordinator, the process count and the rank from that environment.

    Otherwise the process stays single-process: no error, no waiting. A one-process cluster (``srun -n 1``)
    stays single-process too, so that it keeps every local device (JAX would restrict it to one).
    ``SHARDCHECK_CLUSTER_DETECTION=off`` turns the second way off. Does nothing when JAX's distributed runtime
    is already initialized. ``SHARDCHECK_DEVICES_PER_PROCESS`` sets ``jax_num_cpu_devices`` in every case.

    Call it first, before any JAX computation: a cluster found after JAX's backend has started cannot be
    joined, and then a ``RuntimeWarning`` says so and the process stays single-process.

    Args:
        environ: the environment holding the ``SHARDCHECK_*`` variables (default ``os.environ``). Cluster
            detection always reads ``os.environ``, as ``jax.distributed.initialize()`` does.

    Returns:
        True when this process is part of a multi-process run, False for a single process.

    Raises:
        ValueError: from :func:`config_from_env` and :func:`initialize`.
        CoordinatorBindError: from :func:`initialize`.
        RuntimeError: JAX's errors joining a detected cluster (e.g. the other processes never joined).
    """
    import jax

    if jax.distributed.is_initialized():
        return True
    env = os.environ if environ is None else environ
    config = config_from_env(env)
    if config is not None:
        initialize(config)
        return True
    rule = "set it to the devices each process owns"
    devices = _env_int("initialize_from_env", env, ENV_DEVICES_PER_PROCESS, 1, rule)
    if devices is not None:
        jax.config.update("jax_num_cpu_devices", devices)
    cluster = detected_cluster()
    if cluster is None or cluster[1] == 1:
        return False
    if _backend_started():
        import warnings

        warnings.warn(
            f"initialize_from_env: a {cluster[0]} cluster was detected but JAX's backend has already started, "
            "so this process cannot join it and runs alone; call initialize_from_env() before any JAX "
            f"computation, or set {ENV_CLUSTER_DETECTION}=off to silence this",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    jax.distributed.initialize()
    _route_native_stdout_to_stderr()
    return True


def _route_native_stdout_to_stderr() -> None:
    """Point file descriptor 1 at stderr and keep ``sys.stdout`` writing to the original stdout."""
    try:
        stdout_fd, stderr_fd = sys.stdout.fileno(), sys.stderr.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return  # a captured or replaced stream (pytest): nothing native writes to it
    sys.stdout.flush()
    python_fd = os.dup(stdout_fd)
    os.dup2(stderr_fd, stdout_fd)
    encoding, errors = sys.stdout.encoding, sys.stdout.errors
    sys.stdout = io.TextIOWrapper(
        io.FileIO(python_fd, "w"), encoding=encoding, errors=errors, line_buffering=True
    )


def is_multiprocess() -> bool:
    """True once this process has joined JAX's distributed runtime; never initializes a backend."""
    import jax

    return jax.distributed.is_initialized()


def is_main_process() -> bool:
    """True in process 0 (the one that prints and writes files), and in every single-process run."""
    import jax

    return jax.process_index() == 0


def _batch_sharding(fn: str, mesh, axis_name: str):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    if axis_name not in mesh.axis_names:
        raise ValueError(f"{fn}: axis_name={axis_name!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    missing = sorted(set(range(jax.process_count())) - {d.process_index for d in mesh.devices.flat})
    if missing:
        raise ValueError(
            f"{fn}: the mesh has no device of process(es) {missing}; in a multi-process run every process "
            f"must own part of the mesh: use all {jax.device_count()} devices (spmd.make_mesh())"
        )
    return NamedSharding(mesh, PartitionSpec(axis_name))


def process_batch_indices(global_batch_size: int, mesh, axis_name: str = "data") -> np.ndarray:
    """The rows of a global batch this process must load: those its devices hold when the batch is split.

    With :func:`shardcheck.make_mesh` the devices of one process are contiguous, so process p of P gets
    the rows ``[p * B / P, (p + 1) * B / P)``; other meshes may give several ranges, returned in global order,
    which is the order ``jax.make_array_from_process_local_data`` expects. In a single process: all B rows.

    Args:
        global_batch_size: B, a positive multiple of the size of ``axis_name``.
        mesh: the ``jax.sharding.Mesh`` of the step, spanning every process.
        axis_name: the mesh axis the batch is split over.

    Returns:
        ``(B_local,)`` int64 row indices, increasing.

    Raises:
        ValueError: ``axis_name`` is not a mesh axis; the mesh leaves out a process; B is not a positive
            multiple of the axis size.
    """
    fn = "process_batch_indices"
    sharding = _batch_sharding(fn, mesh, axis_name)
    size = int(mesh.shape[axis_name])
    if global_batch_size < 1 or global_batch_size % size:
        raise ValueError(
            f"{fn}: batch size {global_batch_size} is not a positive multiple of the {size} devices of mesh "
            f"axis {axis_name!r}; equal shards are required"
        )
    index_map = sharding.addressable_devices_indices_map((global_batch_size,))
    ranges = sorted({index[0].indices(global_batch_size)[:2] for index in index_map.values()})
    return np.concatenate([np.arange(start, stop, dtype=np.int64) for start, stop in ranges])


def global_batch(x_local, y_local, mesh, axis_name: str = "data", *, global_batch_size: int | None = None):
    """Global ``(x, y)`` arrays split along ``axis_name`` over every process, built from each process's rows.

    Every process calls this with the rows :func:`process_batch_indices` names for it, and gets one global
    array per input (``jax.make_array_from_process_local_data``), not fully addressable when there are several
    processes. In a single process the local rows are the whole batch.

    Args:
        x_local: ``(B_local, D)`` this process's inputs (NumPy or JAX; the dtype is kept).
        y_local: ``(B_local, K)`` this process's targets, as many rows.
        mesh: the ``jax.sharding.Mesh`` of the step, spanning every process.
        axis_name: the mesh axis the batch is split over.
        global_batch_size: B. Needed when the processes own different numbers of the mesh's devices (a mesh
            over 3 of 2 x 2 devices); otherwise None lets JAX infer it from ``B_local``.

    Returns:
        ``(x, y)``: ``(B, D)`` and ``(B, K)`` ``jax.Array`` with sharding ``NamedSharding(mesh, P(axis_name))``.

    Raises:
        ValueError: ``axis_name`` is not a mesh axis; the mesh leaves out a process; ``x_local`` and
            ``y_local`` differ in rows; the processes' rows imply different global batch sizes (checked
            across processes, so every process raises).
    """
    import jax

    fn = "global_batch"
    x_local, y_local = np.asarray(x_local), np.asarray(y_local)
    if x_local.shape[:1] != y_local.shape[:1]:
        raise ValueError(f"{fn}: x_local has {x_local.shape[0]} rows but y_local has {y_local.shape[0]}")
    sharding = _batch_sharding(fn, mesh, axis_name)
    shapes = (None, None)
    if global_batch_size is not None:
        shapes = ((global_batch_size, *x_local.shape[1:]), (global_batch_size, *y_local.shape[1:]))
    x = jax.make_array_from_process_local_data(sharding, x_local, shapes[0])  # local: no communication
    y = jax.make_array_from_process_local_data(sharding, y_local, shapes[1])
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        sizes = multihost_utils.process_allgather(np.array([x.shape[0]], np.int64), tiled=True)
        if len(set(sizes.tolist())) != 1:
            raise ValueError(
                f"{fn}: the processes' rows imply different global batch sizes {sizes.tolist()}; each process "
                "must pass the rows process_batch_indices(B, mesh) names for it"
            )
    return x, y


def gather_to_host(tree: PyTree) -> PyTree:
    """Every array leaf of ``tree`` as one whole NumPy array, in every process (all processes must call it).

    Leaves that are not fully addressable (split or replicated across processes) are gathered with
    ``jax.experimental.multihost_utils.process_allgather(..., tiled=True)``, a collective: every process must
    pass the same tree structure. Fully addressable arrays are copied to host; other leaves are returned as is.

    Args:
        tree: a pytree (an ``nnx.State``, a dict of arrays, a registered dataclass).

    Returns:
        The same structure, with ``np.ndarray`` leaves of the arrays' global shapes and dtypes.
    """
    import jax
    from jax.experimental import multihost_utils

    def to_host(leaf):
        if isinstance(leaf, jax.Array):
            if leaf.is_fully_addressable:
                return np.asarray(leaf)
            return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        return leaf

    return jax.tree.map(to_host, tree)


def _is_key_array(leaf) -> bool:
    import jax

    return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _place_leaf(leaf, sharding):
    import jax

    if isinstance(leaf, jax.Array):
        if leaf.sharding.is_equivalent_to(sharding, leaf.ndim) and leaf.committed:
            return leaf  # as jax.device_put: already laid out so
        if not leaf.is_fully_addressable:
            return jax.device_put(leaf, sharding)  # a global array: a reshard, every process takes part
    if _is_key_array(leaf):
        impl = jax.random.key_impl(leaf)
        data = np.asarray(jax.random.key_data(leaf))  # (*shape, *impl.key_shape) uint32

        def key_shard(index):
            return jax.random.wrap_key_data(np.array(data[index]), impl=impl)

        return jax.make_array_from_callback(leaf.shape, sharding, key_shard)
    host = np.asarray(leaf)
    host = host.astype(jax.dtypes.canonicalize_dtype(host.dtype), copy=False)
    # Each shard is its own copy: the placed array never aliases the caller's buffer, so a step may donate it.
    return jax.make_array_from_callback(host.shape, sharding, lambda index: np.array(host[index]))


def place_host_tree(tree: PyTree, shardings: PyTree, *, mesh=None) -> PyTree:
    """Place a host-side pytree, present identically in every process, on a mesh spanning every process.

    Each process builds the addressable shards of every leaf from its own copy
    (``jax.make_array_from_callback(shape, sharding, lambda index: host[index])``): no process communicates,
    so processes may interleave the calls with collectives (a ``process_allgather``, a sharded step) in any
    order without deadlock. Typed PRNG key arrays (``jax.random.key(0)``, the keys of ``nnx.Rngs`` streams)
    are placed through their raw data (``jax.random.key_data``) and rewrapped shard by shard
    (``jax.random.wrap_key_data`` with the key's own impl). In a single process the result equals
    ``jax.device_put(tree, shardings)``: same values, dtypes and shardings.

    Why not ``jax.device_put``: in multi-controller JAX, ``device_put`` of a host value to a sharding that is
    not fully addressable is a collective. JAX first checks that every process passed the same value
    (``multihost_utils.assert_equal``, an all-gather over processes; ``jax/_src/dispatch.py``, and
    jax-ml/jax#25325 for the replicated case's ``broadcast_one_to_all``), so a process in ``device_put`` waits
    for its peers: when one process places a tree while another is in a different collective, both hang. For
    an array committed to one device JAX attempts a cross-host transfer instead, and for a PRNG key array it
    raises ``device_put's second argument must be a Device or a Sharding which represents addressable
    devices``. "All processes must run the same cross-process computations in the same order"
    (https://docs.jax.dev/en/latest/multi_process.html); this function contains none.

    Args:
        tree: a pytree (an ``nnx.State``, a dict, a batch tuple) of NumPy arrays, Python or NumPy scalars,
            and ``jax.Array`` leaves held whole by this process (on one device, or on several of its own),
            including PRNG key arrays; the same values in every process. A leaf that is already a global
            array (not fully addressable) is passed through when it has the target sharding, else resharded
            with ``jax.device_put`` (a collective: every process must reach that call).
        shardings: a ``jax.sharding.Sharding`` per leaf, as a pytree of ``tree``'s structure or a prefix of it
            (a single sharding applies to every leaf), like ``jax.device_put``'s second argument; with
            ``mesh``, ``PartitionSpec`` leaves instead, each becoming ``NamedSharding(mesh, spec)``.
        mesh: a ``jax.sharding.Mesh`` for the ``PartitionSpec`` form; None when ``shardings`` holds shardings.

    Returns:
        ``tree``'s structure with ``jax.Array`` leaves of the leaves' global shapes and dtypes (Python floats
        become float32, as with ``jax.device_put``), each laid out by its sharding; an array already so laid
        out is returned as is. The placed arrays never share a buffer with the inputs.

    Raises:
        TypeError: a ``shardings`` leaf is not a ``Sharding`` (or, with ``mesh``, not a ``PartitionSpec``), or
            ``mesh`` is not a ``Mesh``.
        ValueError: ``shardings`` is not a prefix of ``tree``'s structure; a spec names an axis the mesh
            lacks or does not divide its dimension (JAX's message, prefixed with this function's name).

    Example::

        mesh = jax.make_mesh((jax.device_count(),), ("data",))
        state = place_host_tree(nnx.state(model), NamedSharding(mesh, PartitionSpec()))   # replicated
        batch = place_host_tree((x, y), PartitionSpec("data"), mesh=mesh)                 # split rows
    """
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

    fn = "place_host_tree"
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"{fn}: mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
        specs = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, PartitionSpec | Sharding))
        bad = next((s for s in specs if not isinstance(s, PartitionSpec)), None)
        if bad is not None:
            raise TypeError(
                f"{fn}: with mesh=, shardings must hold PartitionSpec leaves, got {type(bad).__name__} "
                f"{bad!r}; pass PartitionSpecs, or drop mesh= and pass Sharding objects"
            )
        try:
            shardings = jax.tree.map(
                lambda s: NamedSharding(mesh, s), shardings, is_leaf=lambda s: isinstance(s, PartitionSpec)
            )
        except ValueError as err:  # an axis the mesh lacks
            raise ValueError(f"{fn}: {err}") from err
    targets = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, Sharding))
    bad = next((s for s in targets if not isinstance(s, Sharding)), None)
    if bad is not None:
        raise TypeError(
            f"{fn}: shardings must hold jax.sharding.Sharding leaves (e.g. NamedSharding(mesh, spec)), got "
            f"{type(bad).__name__} {bad!r}; for PartitionSpec leaves pass mesh= too"
        )
    try:
        return jax.tree.map(
            lambda sharding, subtree: jax.tree.map(lambda leaf: _place_leaf(leaf, sharding), subtree),
            shardings,
            tree,
            is_leaf=lambda s: isinstance(s, Sharding),
        )
    except ValueError as err:
        raise ValueError(f"{fn}: {err}") from err
