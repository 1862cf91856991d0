"""The names of the former worker/shard_runner.py, now in worker/shard/ (kept for callers that import
them from here)."""

from worker.retry import ShardRetry
from worker.shard.context import ShardHandedBack, ShardOutcome, WorkerContext
from worker.shard.executor import ready_to_finalize, run_shard

__all__ = ["ShardHandedBack", "ShardOutcome", "ShardRetry", "WorkerContext", "ready_to_finalize", "run_shard"]
