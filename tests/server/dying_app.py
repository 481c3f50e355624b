"""A ClientApp (for tests/server/test_scale.py) whose node 1 kills its process on its
second message when it runs in a worker process: a worker that dies mid-message."""

from __future__ import annotations

import os

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from tests.clients import userapp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    calls = int(context.state["calls"]["n"]) + 1 if "calls" in context.state else 1
    context.state["calls"] = ConfigRecord({"n": calls})
    if int(context.node_config["partition-id"]) == 1 and calls == 2 and os.environ.get("FEDEDGE_INPROCESS_WORKER"):
        os._exit(7)
    reply = userapp.train_fn(msg, context)
    content = RecordDict({**reply.content})
    content["metrics"] = MetricRecord({**reply.content["metrics"], "calls": calls})
    return Message(content, reply_to=msg)
