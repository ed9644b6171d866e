"""The live driver: an asyncio Batcher around any executor, and ``@batch`` for plain callables.

Nothing here imports torch; the model executors live in ``batchpilot.models``.
"""

from .batcher import Batcher
from .decorator import BatchedFunction, batch, make_config
from .errors import ExecutionError, ExecutorCrashed, RequestRejected
from .executor import AsyncCallableExecutor, CallableExecutor, Executor, NoopExecutor
from .observer import BatcherObserver

__all__ = ["AsyncCallableExecutor", "BatchedFunction", "Batcher", "BatcherObserver", "CallableExecutor",
           "ExecutionError", "Executor", "ExecutorCrashed", "NoopExecutor", "RequestRejected", "batch",
           "make_config"]
