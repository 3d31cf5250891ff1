"""Memory per device under each sharding strategy: estimated from shapes, and measured from the compiled step.

One placement rule serves both: every leaf of the training state (parameters, the model's other variables, one
gradient per parameter, the optimizer state optax really allocates, NNX's step counter) is placed as the
strategy's own step places it, on a mesh of named axes: the model's ``nnx.with_partitioning`` annotations where
it has them, else the FSDP rule, over the categories the layout splits (:mod:`shardcheck.memory.layouts`, which
describes the layouts ``replicated``, ``dp``, ``zero1``, ``zero2``, ``fsdp``). ``num_shards=S`` is the one-axis
mesh ``{"fsdp": S}``.

* :mod:`~shardcheck.memory.estimate`: :func:`estimate_memory`, from shapes alone (``nnx.eval_shape``; an
  abstract mesh needs no devices);
* :mod:`~shardcheck.memory.measure`: :func:`measure_memory`, the strategy's real step compiled and run once, XLA's
  per-device figures and the live arrays beside the estimate;
* :mod:`~shardcheck.memory.lowering`: :func:`lower_step`, the step a strategy runs lowered on real or abstract
  inputs, which :mod:`shardcheck.ahead_of_time` compiles at full scale and :mod:`shardcheck.device_memory` compares
  with a device's memory;
* :mod:`~shardcheck.memory.state` and :mod:`~shardcheck.memory.models`: the abstract training state, and the
  Linear / MLP ``shardcheck memory`` sizes without a task.
"""

from shardcheck.memory.estimate import LeafMemory as LeafMemory
from shardcheck.memory.estimate import MemoryEstimate as MemoryEstimate
from shardcheck.memory.estimate import estimate_memory as estimate_memory
from shardcheck.memory.layouts import MESH_STRATEGIES as MESH_STRATEGIES
from shardcheck.memory.layouts import SHARDED_CATEGORIES as SHARDED_CATEGORIES
from shardcheck.memory.layouts import check_strategy as check_strategy
from shardcheck.memory.layouts import layout_shardings as layout_shardings
from shardcheck.memory.lowering import lower_step as lower_step
from shardcheck.memory.measure import MemoryMeasurement as MemoryMeasurement
from shardcheck.memory.measure import measure_memory as measure_memory
from shardcheck.memory.measure import measure_step as measure_step
from shardcheck.memory.measure import measure_strategies as measure_strategies
from shardcheck.memory.measure import measure_task_strategies as measure_task_strategies
from shardcheck.memory.models import DeepMLP as DeepMLP
from shardcheck.memory.models import make_memory_model as make_memory_model
from shardcheck.memory.state import CATEGORIES as CATEGORIES
from shardcheck.memory.state import DTYPES as DTYPES
from shardcheck.memory.state import abstract_params as abstract_params
from shardcheck.memory.state import abstract_training_state as abstract_training_state
from shardcheck.memory.state import check_param_dtype as check_param_dtype
from shardcheck.memory.state import optimizer_transform as optimizer_transform
