"""A ClientApp (for tests/server/test_scale.py) told by its message what to do: the node of
partition ``die`` kills its worker process, that of ``none`` returns None, every other one
sleeps ``sleep`` seconds and answers with its partition and its call count."""

from __future__ import annotations

import os
import time

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message | None:
    calls = int(context.state["calls"]["n"]) + 1 if "calls" in context.state else 1
    context.state["calls"] = ConfigRecord({"n": calls})
    pid = int(context.node_config["partition-id"])
    cfg = msg.content["config"]
    if cfg.get("die", -1) == pid and os.environ.get("FEDEDGE_INPROCESS_WORKER"):
        os._exit(7)
    if cfg.get("none", -1) == pid:
        return None
    time.sleep(float(cfg.get("sleep", 0.0)))
    return Message(RecordDict({"metrics": MetricRecord({"pid": pid, "calls": calls})}), reply_to=msg)
