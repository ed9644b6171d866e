"""The live driver: an asyncio Batcher around any executor, and ``@batch`` for plain callables.

Nothing here imports torch; the model executors live in ``batchpilot.models``.
"""

from batchpilot.runtime.batcher import Batcher, BatcherObserver
from batchpilot.runtime.decorator import BatchedFunction, batch, make_config
from batchpilot.runtime.errors import ExecutionError, ExecutorCrashed, RequestRejected
from batchpilot.runtime.executor import AsyncCallableExecutor, CallableExecutor, Executor, NoopExecutor

__all__ = ["AsyncCallableExecutor", "BatchedFunction", "Batcher", "BatcherObserver", "CallableExecutor",
           "ExecutionError", "Executor", "ExecutorCrashed", "NoopExecutor", "RequestRejected", "batch",
           "make_config"]
