"""The ``(model, optimizer, batches)`` form of :func:`~shardcheck.parity.check_parity`: an alias of
:mod:`shardcheck.seeds.parity`, where the seeds' adapters live."""

from shardcheck.seeds.parity import adapt_candidate as adapt_candidate
from shardcheck.seeds.parity import adapt_step as adapt_step
from shardcheck.seeds.parity import regression_batches as regression_batches
from shardcheck.seeds.parity import regression_loss as regression_loss
from shardcheck.seeds.parity import regression_task as regression_task
