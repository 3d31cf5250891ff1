"""Test configuration: 8 fake CPU devices, set before JAX initializes its backend, and one compilation cache
for the session."""

import atexit
import ctypes
import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

from shardcheck.cli._cache import whole_cache_entries
from shardcheck.cli._xla import use_cpu_thread_pool, with_cpu_compile_flags

# Compile time is most of the suite's time, and XLA:CPU's defaults are tuned for running programs, not compiling
# them. The suite compiles as the command line does on a CPU-only machine (shardcheck.cli._xla, which says why):
# LLVM at optimization level 0, the classic elemental emitters for fusions, one LLVM module per program.
# Backend compile seconds of the bfloat16 tiny-lm check of every strategy (84 programs, 2 cores): 42-50 s at
# level 0 alone, 45.5 s with the classic emitters at level 2, 19.5 s with both, 14.4 s with all three. None of
# these changes an operation's semantics, only which instructions compute it, so a test that passes only under
# one of them pins that configuration's rounding: none may (tests/kinked.py plants its rounding instead). An
# XLA_FLAGS that sets any of these wins.
os.environ["XLA_FLAGS"] = with_cpu_compile_flags(os.environ.get("XLA_FLAGS", ""))
# XLA:CPU's client threads, as the command line sizes them (shardcheck.cli._xla.use_cpu_thread_pool): with
# max(cores, 8) threads for the 8 devices below, a collective program launched again before its previous launch
# finished could hang at its rendezvous until XLA aborted the worker (docs/known_issues.md).
use_cpu_thread_pool(8)

import jax  # noqa: E402  (XLA reads XLA_FLAGS when its first backend starts)

# The command line turns on JAX's persistent compilation cache in the user's cache folder; the tests never touch
# that folder (nor depend on what an earlier run left there).
os.environ.setdefault("SHARDCHECK_COMPILATION_CACHE", "off")

# One fresh folder per test session (the pytest-xdist workers inherit this variable from the controller, which
# creates the folder and removes it at exit), shared by the workers and the processes their tests start: a program
# one test compiled loads in any later test, on either worker. Many tests compile the same programs (a task's
# reference step, the harness's sensitivity pass for a new but equal optax transformation), which JAX's in-memory
# caches cannot see are equal. JAX's key of a program includes the folder (its GPU autotune folder, beneath it), so
# a folder per worker shared nothing. Each entry is written whole (shardcheck.cli._cache.whole_cache_entries, as
# the command line writes them): JAX writes an entry in place, unlocked (jax._src.lru_cache.LRUCache.put without a
# size limit), and a worker read another's entry half written and segfaulted deserializing it
# (docs/known_issues.md). SHARDCHECK_TEST_XLA_CACHE=off compiles everything afresh.
SESSION_CACHE = "SHARDCHECK_TEST_XLA_CACHE"
if SESSION_CACHE not in os.environ:
    os.environ[SESSION_CACHE] = tempfile.mkdtemp(prefix="shardcheck-tests-xla-")
    atexit.register(shutil.rmtree, os.environ[SESSION_CACHE], ignore_errors=True)
if os.environ[SESSION_CACHE] != "off":
    whole_cache_entries()
    jax.config.update("jax_compilation_cache_dir", os.environ[SESSION_CACHE])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

jax.config.update("jax_num_cpu_devices", 8)

# The session collects garbage as the command line's process does (shardcheck.cli.CLI_GC_THRESHOLD), and takes what
# its imports allocated (JAX, Flax, optax: objects that live until the process ends) out of every later collection
# (gc.freeze). CPU seconds of tests/test_step_loop_evidence.py and tests/test_trial47_records_agree.py, -n 0, two
# runs each: 19.4, 19.1 with CPython's defaults; 18.5, 18.1 with the thresholds; 17.3, 17.6 with both.
import flax.nnx  # noqa: E402,F401
import optax  # noqa: E402,F401

import shardcheck  # noqa: E402,F401
from shardcheck.cli import CLI_GC_THRESHOLD  # noqa: E402

gc.set_threshold(*CLI_GC_THRESHOLD)
gc.freeze()

# A worker keeps every program its tests compiled: JAX's jit caches hold each new task's loss function (a static
# argument of the steps) and its executables, about 135 MB a tiny-lm task checked with dp and accumulation, so a
# worker grew past 12 GB and two of them filled the 24 GB machine (the suite stalled, swapping). After a test that
# leaves the worker above WORKER_MEMORY_BYTES, the caches are cleared (jax.clear_caches: later tests load their
# programs from the worker's compilation cache above) and the freed heap given back (glibc's malloc_trim; without
# it the resident size stays where it was, and every later test cleared the caches again). The same 12 checks in
# one process: 843 -> 2338 MB kept; 858 -> 936 MB cleared after each; 1140 -> 419 MB cleared and trimmed.
WORKER_MEMORY_BYTES = 6 * 2**30


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:  # (Linux) resident pages
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(autouse=True)
def _bounded_worker_memory():
    yield
    if sys.platform.startswith("linux") and _resident_bytes() > WORKER_MEMORY_BYTES:
        jax.clear_caches()
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


SHARED_SCOPES = ("module", "class", "package", "session")


def _shared_fixture_group(item: pytest.Item) -> str | None:
    """The ``xdist_group`` of a test that uses a fixture its own module defines with a scope wider than the test
    (a check run once and read by several tests), with the fixture's parameter where it has one; ``None`` for
    any other test. One worker then computes each such fixture once: spread by ``--dist load``, a module's tests
    ran on both workers and each built the fixture (tests/test_scan_rng_diagnosis.py's 23 s setup, twice)."""
    module = item.nodeid.split("::")[0]
    names = sorted(
        name
        for name, defs in item._fixtureinfo.name2fixturedefs.items()
        if any(d.scope in SHARED_SCOPES and (d.baseid or "") == module for d in defs)
    )
    if not names:
        return None
    indices = getattr(getattr(item, "callspec", None), "indices", {})
    # no brackets: pytest-xdist reads a node id's group only after its last "]"
    return module + "".join(f":{n}={indices[n]}" for n in names if n in indices)


def pytest_itemcollected(item):  # as each test is collected: pytest-xdist's worker reads the groups after
    group = None if item.get_closest_marker("xdist_group") else _shared_fixture_group(item)
    if group is not None:
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_modifyitems(config, items):
    """The grouped tests first (stable): pytest-xdist hands out work in collection order, one group or test at a
    time, so the groups (a zoo model's tests, test_record's: up to minutes each) start while single tests fill in
    after them, and the run does not end with one worker on test_zoo's last model while the other idles."""
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)


# Jit compilation makes the first example of each shape slow: no per-example deadline.
settings.register_profile("shardcheck", deadline=None, max_examples=15, derandomize=True)
settings.load_profile("shardcheck")


def zoo_module(path: Path):
    """An ``examples/zoo`` file as its module, its folder importable while it loads (as ``--task FILE.py:task``
    loads it: the language models import their shared steps from the sibling ``_lm_steps.py``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"zoo_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def require_devices(n: int):
    """A pytest skip marker for tests needing ``n`` devices."""
    import pytest

    return pytest.mark.skipif(
        len(jax.devices()) < n, reason=f"needs {n} devices, {len(jax.devices())} available"
    )


def scaled_from(loss_fn, step: int, factor: float):
    """A user step that is the reference's (``nnx.value_and_grad`` of ``loss_fn(model, batch)``, then the
    optimizer's update) until the optimizer's ``step``, and from it applies ``factor`` times the gradient: a sum
    taken for a mean (``factor = S``), a mean taken twice (``1 / S``), a small scale error. Returns the loss and
    the gradient it applied."""
    from flax import nnx

    def candidate(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: loss_fn(m, batch))(model)
        if int(optimizer.step[...]) >= step:
            grads = jax.tree.map(lambda g: factor * g, grads)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    return candidate


def small_lm_config():
    """One block of the built-in tiny-lm's layers at width 16 (the default: two at 32): every leaf kind of the
    default model and each of its FSDP placements (split along dimension 0, along dimension 1, replicated: the
    77-id vocabulary splits neither 4 nor 8 ways), in about two thirds of its compile time. The default model
    itself is checked through the command line (tests/test_cli_task.py)."""
    from shardcheck.tasks import TinyLMConfig

    return TinyLMConfig(d_model=16, num_heads=2, num_layers=1, seq_len=16, mlp_dim=32)


@pytest.fixture(scope="module")
def annotated_lm():
    """The module examples/annotated_lm.py (an annotated transformer task and a user's GSPMD step)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    try:
        import annotated_lm
    finally:
        sys.path.pop(0)
    return annotated_lm


def said(report, code: str) -> str:
    """The message of ``report``'s diagnosis ``code`` (``StopIteration`` where it gives none)."""
    return next(d.message for d in report.diagnoses if d.code == code)


def train_candidate(name: str, train):
    """A :class:`shardcheck.Candidate` named ``name`` whose step runs ``train(model, optimizer, batch) -> (loss,
    grads)`` (the tests' jitted user steps) and returns both."""
    from shardcheck import Candidate

    def step(model, optimizer, batch):
        loss, grads = train(model, optimizer, batch)
        return {"loss": loss, "grads": grads}

    return Candidate(name=name, step=step)


def replicated_step(train):
    """A user step ``step(model, optimizer, batch, mesh)`` that places the model's and the optimizer's state
    replicated on ``mesh`` (``P()``), then returns ``train(model, optimizer, batch, mesh)``: the tests' data-parallel
    ``jax.shard_map`` steps, whose state enters the mapped function whole."""
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def step(model, optimizer, batch, mesh):
        state = nnx.state((model, optimizer))
        nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh, P())))
        return train(model, optimizer, batch, mesh)

    return step
