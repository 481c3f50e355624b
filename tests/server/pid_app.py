"""A ClientApp (for tests/server/test_scale.py) whose replies name the process that ran
them (metric ``pid``)."""

from __future__ import annotations

import os

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from tests.clients import userapp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    reply = userapp.train_fn(msg, context)
    content = RecordDict({**reply.content})
    content["metrics"] = MetricRecord({**reply.content["metrics"], "pid": os.getpid()})
    return Message(content, reply_to=msg)
