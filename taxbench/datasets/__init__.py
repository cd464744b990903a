"""Token-shard datasets: on-disk format, builder, and the torch and DALI readers of one deterministic sample order."""

from taxbench.datasets.build import build_shards
from taxbench.datasets.order import SampleOrder, StreamCursor
from taxbench.datasets.shards import ShardError, TokenShards

__all__ = ["SampleOrder", "ShardError", "StreamCursor", "TokenShards", "build_shards"]
