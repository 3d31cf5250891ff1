"""Many processes: the environment contract, the batch helpers, and ``shardcheck launch`` end to end.

The ``multiprocess`` tests start real JAX processes joined over loopback (gloo CPU collectives); each is bounded
by a subprocess timeout and cleans up every process it started, found by a marker in their environment.
"""

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import require_devices
from jax.sharding import Mesh

from shardcheck import distributed, launcher
from shardcheck.cli import main

# ------------------------------------------------------------------------------------ the environment contract


def env(**kw):
    return {f"SHARDCHECK_{k.upper()}": str(v) for k, v in kw.items()}


def test_no_coordinator_means_single_process():
    assert distributed.config_from_env({}) is None
    assert distributed.config_from_env(env(devices_per_process=2)) is None
    assert distributed.initialize_from_env({}) is False


def test_config_from_env_reads_every_variable():
    config = distributed.config_from_env(
        env(
            coordinator="10.0.0.1:8476",
            num_processes=4,
            process_id=3,
            devices_per_process=8,
            init_timeout_s=60,
        )
    )
    assert config == distributed.DistributedConfig("10.0.0.1:8476", 4, 3, 8, None, 60)


@pytest.mark.parametrize(
    ("address", "bind"),
    [
        ("127.0.0.1:1234", "127.0.0.1:1234"),  # loopback: bind to it, never to all interfaces
        ("localhost:1234", "localhost:1234"),
        ("[::1]:1234", "[::1]:1234"),
        ("node0:1234", None),  # a cluster host: JAX's default, reachable from the other hosts
    ],
)
def test_bind_address_defaults_to_a_loopback_coordinator(address, bind):
    config = distributed.config_from_env(env(coordinator=address, num_processes=2, process_id=0))
    assert config.coordinator_bind_address == bind
    explicit = env(coordinator=address, num_processes=2, process_id=0, coordinator_bind="10.0.0.1:1234")
    assert distributed.config_from_env(explicit).coordinator_bind_address == "10.0.0.1:1234"


@pytest.mark.parametrize(
    ("variables", "match"),
    [
        (env(coordinator="127.0.0.1:1234", num_processes=2), "SHARDCHECK_PROCESS_ID is not; set both"),
        (env(coordinator="127.0.0.1:1234", process_id=0), "SHARDCHECK_NUM_PROCESSES is not"),
        (env(coordinator="127.0.0.1:1234", num_processes=2, process_id=2), "ranks are 0 .. 1"),
        (env(coordinator="127.0.0.1:1234", num_processes="two", process_id=0), "'two' is not an integer"),
        (env(coordinator="127.0.0.1:1234", num_processes=0, process_id=0), "NUM_PROCESSES=0 must be >= 1"),
        (env(coordinator="127.0.0.1", num_processes=2, process_id=0), "is not HOST:PORT"),
        (env(coordinator="h:1", num_processes=2, process_id=0, coordinator_bind="h"), "COORDINATOR_BIND='h'"),
        (env(num_processes=2, process_id=0), "SHARDCHECK_COORDINATOR is not"),
        (env(devices_per_process=0), "DEVICES_PER_PROCESS=0 must be >= 1"),
    ],
)
def test_config_from_env_errors_name_the_variable_and_the_fix(variables, match):
    with pytest.raises(ValueError, match=re.escape(match)) as info:
        distributed.config_from_env(variables)
    assert str(info.value).startswith("config_from_env: ")


def test_cli_reports_a_bad_environment_before_running(monkeypatch, capsys):
    monkeypatch.setenv("SHARDCHECK_COORDINATOR", "127.0.0.1:1234")
    monkeypatch.setenv("SHARDCHECK_NUM_PROCESSES", "2")
    assert main(["run", "--strategy", "baseline"]) == 2
    assert "SHARDCHECK_PROCESS_ID is not" in capsys.readouterr().err


# --------------------------------------------------------------------------- batch helpers in one process


@require_devices(4)
def test_batch_helpers_in_one_process_cover_the_whole_batch():
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    np.testing.assert_array_equal(distributed.process_batch_indices(8, mesh), np.arange(8))
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    y = np.arange(8, dtype=np.float32).reshape(8, 1)
    xg, yg = distributed.global_batch(x, y, mesh)
    assert xg.shape == (8, 2) and len(xg.addressable_shards) == 4 and xg.sharding.spec == jax.P("data")
    host = distributed.gather_to_host({"x": xg, "y": yg, "n": 3})
    np.testing.assert_array_equal(host["x"], x)
    np.testing.assert_array_equal(host["y"], y)
    assert host["n"] == 3
    assert distributed.is_main_process() and not distributed.is_multiprocess()


@require_devices(4)
def test_global_batch_with_an_explicit_global_size():
    mesh = Mesh(np.array(jax.devices()[:3]), ("data",))
    x, y = np.ones((6, 2), np.float32), np.zeros((6, 1), np.float32)
    xg, yg = distributed.global_batch(x, y, mesh, global_batch_size=6)
    assert xg.shape == (6, 2) and yg.shape == (6, 1) and len(xg.addressable_shards) == 3


@require_devices(4)
def test_batch_helpers_errors():
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    with pytest.raises(
        ValueError, match=r"process_batch_indices: batch size 10 is not a positive multiple of the 4"
    ):
        distributed.process_batch_indices(10, mesh)
    with pytest.raises(ValueError, match=r"process_batch_indices: axis_name='model' is not an axis"):
        distributed.process_batch_indices(8, mesh, "model")
    with pytest.raises(ValueError, match=r"global_batch: x_local has 4 rows but y_local has 3"):
        distributed.global_batch(np.zeros((4, 2)), np.zeros((3, 1)), mesh)


# ----------------------------------------------------------------------- cluster detection, a fake environment

SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NODELIST": "node[0-3]",
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "0",
    "SLURM_STEP_NUM_NODES": "4",
}


@pytest.fixture
def fake_cluster(monkeypatch):
    """No cluster variables but the test's own; ``jax.distributed.initialize`` recorded, never run."""
    import os

    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "SHARDCHECK_")) or name == "KUBERNETES_SERVICE_HOST":
            monkeypatch.delenv(name)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *args, **kw: calls.append((args, kw)))
    monkeypatch.setattr(distributed, "_backend_started", lambda: False)  # this test process's has started
    monkeypatch.setattr(distributed, "_route_native_stdout_to_stderr", lambda: None)
    return calls


def test_a_slurm_job_is_joined_through_jax_own_detection(fake_cluster, monkeypatch):
    from jax._src.clusters import ClusterEnv

    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    assert distributed.detected_cluster() == ("slurm", 4)
    assert distributed.initialize_from_env() is True
    assert fake_cluster == [((), {})]  # no arguments: JAX reads the coordinator, P and the rank itself
    # ... and what JAX would read here: rank 2 of 4, coordinator on the job's first node
    address, count, rank, _ = ClusterEnv.auto_detect_unset_distributed_params(
        None, None, None, None, None, None
    )
    assert (address.split(":")[0], count, rank) == ("node0", 4, 2)


def test_open_mpi_is_detected(fake_cluster, monkeypatch):
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "1531576320.0;tcp://10.96.0.1:34911")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert distributed.detected_cluster() == ("ompi", 2)
    assert distributed.initialize_from_env() is True and fake_cluster == [((), {})]


@pytest.mark.parametrize(
    "variables",
    [
        {},  # no cluster: single process, no waiting
        dict(SLURM, SLURM_NTASKS="1"),  # srun -n 1: keep every local device, start no coordinator
        dict(SLURM, SHARDCHECK_CLUSTER_DETECTION="off"),
        {"SLURM_JOB_ID": "4242"},  # an incomplete Slurm environment (salloc's shell): JAX detects none
    ],
)
def test_no_cluster_of_several_processes_stays_single_process(fake_cluster, monkeypatch, variables):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert distributed.initialize_from_env() is False
    assert fake_cluster == []


def test_the_shardcheck_variables_win_over_a_detected_cluster(fake_cluster, monkeypatch):
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    seen = []
    monkeypatch.setattr(distributed, "initialize", seen.append)
    variables = env(coordinator="127.0.0.1:1234", num_processes=2, process_id=1)
    assert distributed.initialize_from_env(variables) is True
    assert seen == [distributed.config_from_env(variables)] and fake_cluster == []


def test_a_missing_private_detection_api_means_single_process(fake_cluster, monkeypatch):
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setitem(sys.modules, "jax._src.clusters", None)  # import fails as if JAX had moved it
    assert distributed.detected_cluster() is None
    assert distributed.initialize_from_env() is False and fake_cluster == []


def test_a_cluster_found_after_the_backend_started_warns_and_runs_alone(fake_cluster, monkeypatch):
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(distributed, "_backend_started", lambda: True)
    with pytest.warns(RuntimeWarning, match=r"initialize_from_env: a slurm cluster was detected but JAX's"):
        assert distributed.initialize_from_env() is False
    assert fake_cluster == []


# ----------------------------------------------------------------------------- host trees onto a global mesh


def host_tree():
    from flax import nnx

    model = nnx.Dropout(0.0, rngs=nnx.Rngs(0))  # an RNG stream: a typed key and a uint32 counter
    return {
        "rows": np.arange(16, dtype=np.float32).reshape(8, 2),
        "on_device": jax.device_put(np.arange(4, dtype=np.int32), jax.devices()[1]),
        "bf16": jax.numpy.ones((4, 2), jax.numpy.bfloat16),
        "key": jax.random.key(3),
        "keys": jax.random.split(jax.random.key(1), 4),
        "stream": nnx.state(model),
        "lr": 0.5,
    }


def assert_same_placement(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        assert jax.random.key_impl(a) == jax.random.key_impl(b)
        a, b = jax.random.key_data(a), jax.random.key_data(b)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for sa, sb in zip(a.addressable_shards, b.addressable_shards, strict=True):
        assert sa.device == sb.device and sa.index == sb.index


@require_devices(4)
def test_place_host_tree_equals_device_put_in_one_process():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    tree = host_tree()
    split, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    shardings = {k: split if k in ("rows", "on_device", "keys") else whole for k in tree}
    placed = distributed.place_host_tree(tree, shardings)
    expected = jax.device_put(tree, shardings)
    assert jax.tree.structure(placed) == jax.tree.structure(expected)
    jax.tree.map(assert_same_placement, placed, expected)
    assert placed["keys"].addressable_shards[1].data.shape == (1,)  # one key per device
    # The PartitionSpec form and a single sharding for a whole subtree (a prefix, as device_put takes).
    specs = {k: P("data") if k in ("rows", "on_device", "keys") else P() for k in tree}
    jax.tree.map(assert_same_placement, distributed.place_host_tree(tree, specs, mesh=mesh), expected)
    batch = distributed.place_host_tree((tree["rows"], tree["rows"][:, :1]), split)
    assert [b.sharding.spec for b in batch] == [P("data"), P("data")]
    assert distributed.place_host_tree(placed["rows"], split) is placed["rows"]  # already so: as is


@require_devices(4)
def test_placed_arrays_own_their_buffers():
    """A step may donate what place_host_tree returns; the caller's arrays must survive it."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    source = jax.device_put(np.arange(8, dtype=np.float32), jax.devices()[0])
    host = np.arange(8, dtype=np.float32)
    for sharding in (NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))):
        placed = distributed.place_host_tree([source, host], sharding)
        jax.jit(lambda t: [a * 0 for a in t], donate_argnums=0)(placed)
        np.testing.assert_array_equal(np.asarray(source), np.arange(8))
        np.testing.assert_array_equal(host, np.arange(8))


@require_devices(4)
@pytest.mark.parametrize(
    ("shardings", "mesh", "error", "match"),
    [
        ({"a": "data"}, None, TypeError, "place_host_tree: shardings must hold jax.sharding.Sharding leaves"),
        ({"a": jax.P("data")}, None, TypeError, "for PartitionSpec leaves pass mesh= too"),
        ({"a": jax.P("data")}, "mesh", TypeError, "place_host_tree: mesh must be a jax.sharding.Mesh"),
        ({"b": jax.P("data")}, True, ValueError, "place_host_tree: "),
        ({"a": jax.P("model")}, True, ValueError, "place_host_tree: "),
    ],
)
def test_place_host_tree_errors(shardings, mesh, error, match):
    real = Mesh(np.array(jax.devices()[:4]), ("data",))
    with pytest.raises(error, match=re.escape(match)):
        distributed.place_host_tree({"a": np.zeros((4, 2))}, shardings, mesh=real if mesh is True else mesh)


# ------------------------------------------------------------------------------------- launcher, no processes


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["run", "--json", "-"], True),
        (["run", "--json=-"], True),
        (["run", "--json", "out.json"], False),
        (["run", "--json"], False),
        (["run"], False),
    ],
)
def test_json_mode_detection(argv, expected):
    assert launcher.writes_json_to_stdout(argv) is expected


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(argv=[]), "launch: argv is empty"),
        (dict(processes=0), "launch: processes=0 must be a positive int"),
        (dict(devices_per_process=True), "launch: devices_per_process=True must be a positive int"),
        (dict(timeout_s=0), "launch: timeout_s=0 must be a positive number of seconds"),
        (dict(port=70000), "launch: port=70000 must be an int in [1, 65535]"),
        (dict(max_attempts=0), "launch: max_attempts=0 must be a positive int"),
    ],
)
def test_launch_rejects_bad_arguments_before_starting_anything(kwargs, match):
    args = dict(argv=["run"], processes=2, devices_per_process=2) | kwargs
    with pytest.raises(ValueError, match=re.escape(match)):
        launcher.launch(args.pop("argv"), args.pop("processes"), args.pop("devices_per_process"), **args)


def test_a_port_in_use_is_a_clean_error_in_process_0(monkeypatch):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        config = distributed.DistributedConfig(address, 2, 0, None, address, 5)
        monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail("must not be reached"))
        with pytest.raises(
            distributed.CoordinatorBindError, match=r"cannot listen on .*: the port is in use"
        ):
            distributed.initialize(config)


@pytest.mark.parametrize(
    ("status", "lines", "expected"),
    [
        (75, [], True),
        (-11, ["E1130 add_port.cc:83] Failed to add port to server: No address added"], True),  # gRPC crashed
        (1, ["Traceback ...", "ValueError: something else"], False),
    ],
)
def test_launcher_recognises_a_coordinator_that_could_not_bind(status, lines, expected):
    import collections

    worker = launcher._Worker(0, None, collections.deque(lines), [])
    assert launcher._could_not_bind(status, worker) is expected


def test_free_port_is_bindable_on_loopback():
    import socket

    port = launcher.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


# ------------------------------------------------------------------------------- real processes over loopback


def entry_point() -> list[str]:
    exe = Path(sys.executable).with_name("shardcheck")
    found = str(exe) if exe.exists() else shutil.which("shardcheck")
    return (
        [found]
        if found
        else [sys.executable, "-c", "import sys; from shardcheck.cli import main; sys.exit(main())"]
    )


def marked_processes(marker: str) -> list[int]:
    """Pids of live processes whose environment holds ``marker`` (every process a test started carries it)."""
    found = []
    if not Path("/proc/self/environ").exists():
        return found
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                status = (entry / "status").read_text()
                if "\nState:\tZ" not in status:
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def listening_addresses(port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The local addresses of TCP sockets in LISTEN state on ``port``, from ``/proc/net/tcp`` and ``tcp6``."""
    addresses = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            host, port_hex = fields[1].split(":")
            if fields[3] != "0A" or int(port_hex, 16) != port:  # 0A: TCP_LISTEN
                continue
            raw = bytes.fromhex(host)
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # per-word little endian
            addresses.append(ipaddress.ip_address(raw))
    return addresses


class Launched:
    """One ``shardcheck launch`` (or any command) in the background, its stderr lines read as they come."""

    def __init__(self, args, marker: str, extra_env=None):
        self.marker = marker
        self.leftovers: list[int] | None = None
        environment = dict(os.environ, SHARDCHECK_TEST_MARKER=marker, **(extra_env or {}))
        self.proc = subprocess.Popen(
            [*entry_point(), *args],
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.err_lines: list[str] = []
        self.out_lines: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(stream, lines), daemon=True)
            for stream, lines in ((self.proc.stderr, self.err_lines), (self.proc.stdout, self.out_lines))
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, lines):
        for line in stream:
            lines.append(line)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.err_lines):
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None and not self._readers[0].is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"no stderr line matched {pattern!r}; stderr:\n{self.err}")

    def finish(self, timeout_s: float) -> int:
        """Wait for the command; record the marked processes it left behind (``leftovers``), then kill them."""
        try:
            self.proc.wait(timeout=timeout_s)
            self.leftovers = marked_processes(self.marker)
        finally:
            self.cleanup()
        for reader in self._readers:
            reader.join(timeout=5)
        return self.proc.returncode

    @property
    def out(self) -> str:
        return "".join(self.out_lines)

    @property
    def err(self) -> str:
        return "".join(self.err_lines)

    def cleanup(self):
        live = [self.proc.pid] if self.proc.poll() is None else []  # a reaped pid may already be reused
        for pid in [*live, *marked_processes(self.marker)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


needs_proc = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc (Linux)")


@needs_proc
def test_the_leftover_scan_sees_a_marked_process():
    """Guards the no-leftover assertions below against a scan that finds nothing."""
    marker = f"shardcheck-test-{uuid.uuid4()}"
    sleeper = subprocess.Popen(["sleep", "30"], env=dict(os.environ, SHARDCHECK_TEST_MARKER=marker))
    try:
        # Seen once in a loaded full-suite run: the first scan came back empty. Scan until it sees the sleeper
        # (at most 10 s); a scan that never does still fails, and says whether the sleeper was alive.
        deadline = time.monotonic() + 10
        while (found := marked_processes(marker)) != [sleeper.pid] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert found == [sleeper.pid], (
            f"scan found {found}; sleeper {sleeper.pid} exit status {sleeper.poll()}"
        )
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
    assert marked_processes(marker) == []


RUN_ARGS = ["run", "--strategy", "all", "--dataset", "linnerud", "--json", "-"]

# A user's script under `shardcheck launch -- python ...`: it joins the run, then process 1 stalls.
HANG_SCRIPT = """
import sys, time
from shardcheck import distributed
distributed.initialize_from_env()
import jax
print(f"joined: process {jax.process_index()} of {jax.process_count()}", file=sys.stderr, flush=True)
if jax.process_index() == 1:
    print("process 1 hangs now", file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)
"""


@pytest.fixture
def hang_script(tmp_path):
    path = tmp_path / "hang.py"
    path.write_text(HANG_SCRIPT)
    return str(path)


@pytest.fixture(scope="module")
def splittable_npz(tmp_path_factory) -> Path:
    """32 examples, D=8, K=4: on 4 devices FSDP splits the kernel (8, 4) and the bias (4,) across processes.

    (linnerud's 3 x 3 kernel has no dimension 4 divides, so its FSDP step on 4 devices splits nothing.)
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8))
    y = x @ rng.normal(size=(8, 4)) + 0.1 * rng.normal(size=(32, 4))
    path = tmp_path_factory.mktemp("data") / "splittable.npz"
    np.savez(path, x=x, y=y)
    return path


@pytest.fixture(scope="module")
def two_by_two(splittable_npz):
    """``launch --processes 2 --devices-per-process 2 -- run --strategy all`` with a first port already taken,
    watching the coordinator's socket while it runs; and the single-process run on 4 devices."""
    import socket

    marker = f"shardcheck-test-{uuid.uuid4()}"
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    taken_port = taken.getsockname()[1]
    run_args = ["run", "--strategy", "all", "--dataset", str(splittable_npz), "--json", "-"]
    single = subprocess.run(
        [*entry_point(), *run_args, "--devices", "4"], capture_output=True, text=True, timeout=120
    )
    assert single.returncode == 0, single.stderr
    args = ["launch", "--processes", "2", "--devices-per-process", "2", "--timeout", "90"]
    run = Launched([*args, "--port", str(taken_port), "--", *run_args], marker)
    try:
        run.wait_for(r"retrying on another free port", 60)
        port = int(run.wait_for(rf"coordinator 127\.0\.0\.1:(?!{taken_port}\b)(\d+), pids", 10).group(1))
        seen = set()
        while run.proc.poll() is None:
            seen.update(listening_addresses(port))
            time.sleep(0.01)
        status = run.finish(30)
    finally:
        taken.close()
        run.cleanup()
    yield dict(
        single=json.loads(single.stdout),
        status=status,
        out=run.out,
        err=run.err,
        port=port,
        taken_port=taken_port,
        seen=seen,
        leftovers=run.leftovers,
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_two_processes_match_the_single_process_baseline(two_by_two, strategy):
    """2 processes x 2 devices: the loss and the updated parameters are the single-process baseline's."""
    assert two_by_two["status"] == 0, two_by_two["err"]
    launched = json.loads(two_by_two["out"])  # stdout is exactly one JSON document
    single = two_by_two["single"]
    assert launched["num_shards"] == single["num_shards"] == 4
    assert {k: v for k, v in launched.items() if k != "results"} == {
        k: v for k, v in single.items() if k != "results"
    }
    baseline = single["results"]["baseline"]
    result = launched["results"][strategy]
    assert result["loss"] == pytest.approx(baseline["loss"], abs=1e-6)
    assert result["loss"] == pytest.approx(single["results"][strategy]["loss"], abs=1e-6)
    for leaf in ("kernel", "bias"):
        np.testing.assert_allclose(result["params"][leaf], baseline["params"][leaf], rtol=0, atol=1e-6)
    assert result["max_abs_param_diff_vs_baseline"] < 1e-6
    single_diff = single["results"][strategy]["max_abs_param_diff_vs_baseline"]
    assert result["max_abs_param_diff_vs_baseline"] == pytest.approx(single_diff, abs=1e-6)
    if strategy == "fsdp":  # the parameters really were split across the two processes
        placement = result["placement"]
        assert placement["params_bytes"] == (8 * 4 + 4) * 4 // 4 < placement["params_total_bytes"]
        assert placement == single["results"]["fsdp"]["placement"]  # num_devices counts all 4, not 2


@pytest.mark.multiprocess
def test_two_processes_agree_on_every_row_and_print_once(two_by_two):
    launched, single = json.loads(two_by_two["out"]), two_by_two["single"]
    assert set(launched["results"]) == set(single["results"]) == {"baseline", "simulation", "dp", "fsdp"}
    for name, result in launched["results"].items():
        assert result["loss"] == pytest.approx(single["results"][name]["loss"], abs=1e-6), name
    assert two_by_two["out"].count('"results"') == 1
    assert '"results"' not in two_by_two["err"]  # process 1 printed nothing: no second table, no second JSON
    titles = [line for line in two_by_two["err"].splitlines() if "shardcheck run: splittable.npz" in line]
    assert len(titles) == 1 and titles[0].startswith("[p0] ")  # the table, on stderr beside --json -, once


@pytest.mark.multiprocess
@needs_proc
def test_coordinator_listens_on_loopback_only_and_a_taken_port_is_retried(two_by_two):
    assert f"coordinator 127.0.0.1:{two_by_two['taken_port']}, pids" in two_by_two["err"]
    assert "retrying on another free port (attempt 2 of 3)" in two_by_two["err"]
    seen = two_by_two["seen"]
    assert seen, f"nothing listened on the coordinator port {two_by_two['port']}"
    for address in seen:
        v4 = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else address
        assert v4 == ipaddress.IPv4Address("127.0.0.1"), f"coordinator listens on {address}"
    assert two_by_two["leftovers"] == []  # no worker outlived the launcher


@pytest.mark.multiprocess
@needs_proc
def test_a_killed_worker_stops_the_run_and_leaves_no_process(hang_script):
    marker = f"shardcheck-test-{uuid.uuid4()}"
    args = [
        "launch",
        "--processes",
        "2",
        "--devices-per-process",
        "2",
        "--timeout",
        "60",
        "--",
        "python",
        hang_script,
    ]
    run = Launched(args, marker)
    try:
        pids = [int(p) for p in run.wait_for(r"pids (\d+) (\d+)", 30).groups()]
        run.wait_for(r"\[p1\] process 1 hangs now", 40)
        os.kill(pids[1], signal.SIGKILL)
        status = run.finish(50)
    finally:
        run.cleanup()
    # noticed the kill, not the timeout: the status is the killed worker's, not EXIT_TIMEOUT
    assert status == 128 + signal.SIGKILL and status != launcher.EXIT_TIMEOUT, run.err
    assert "timed out" not in run.err
    assert f"launch: process 1 (pid {pids[1]}) was killed by signal SIGKILL" in run.err
    assert "stopped the other 1 running process(es)" in run.err
    assert "Last output of process 1:" in run.err and "  [p1] process 1 hangs now" in run.err
    assert run.out == ""
    assert run.leftovers == []
    assert all(not Path(f"/proc/{pid}").exists() for pid in pids)


@pytest.mark.multiprocess
@needs_proc
def test_a_hung_run_times_out_and_leaves_no_process(hang_script):
    marker = f"shardcheck-test-{uuid.uuid4()}"
    args = [
        "launch",
        "--processes",
        "2",
        "--devices-per-process",
        "2",
        "--timeout",
        "8",
        "--",
        "python",
        hang_script,
    ]
    run = Launched(args, marker)
    try:
        status = run.finish(60)
    finally:
        run.cleanup()
    assert status == launcher.EXIT_TIMEOUT, run.err
    assert "launch: timed out after 8 s" in run.err
    assert "[p0] joined: process 0 of 2" in run.err  # the script really joined the run before it stalled
    assert run.leftovers == []
