"""The asynchronous strategies under their former module name (kept for existing imports).

They now live one per file: :mod:`fededge.strategies.fedasync`,
:mod:`fededge.strategies.fedbuff`, :mod:`fededge.strategies.ssp`,
:mod:`fededge.strategies.backup`, on the shared loop of
:mod:`fededge.strategies.asyncloop`.
"""

from fededge.strategies.asyncloop import ASYNC_ORDERS, AsyncFL, AsyncLoop, AsyncRoundInfo, Puller, ReplyTiming
from fededge.strategies.backup import BackupWorkers
from fededge.strategies.fedasync import FedAsync
from fededge.strategies.fedbuff import FedBuff
from fededge.strategies.ssp import SSP

__all__ = ["ASYNC_ORDERS", "AsyncFL", "AsyncLoop", "AsyncRoundInfo", "BackupWorkers", "FedAsync", "FedBuff",
           "Puller", "ReplyTiming", "SSP"]
