"""The ClientApp: plain local SGD, as in Flower's quickstart-pytorch. fededge adds one
mod that sends the update sign-compressed (1 bit per weight) with error feedback."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fededge.api import CompressionMod, UpdateConfig  # fededge

from quickstart_compressed.task import Net, load_data, train

UPDATE = UpdateConfig(compressor="signsgd", error_feedback=True)  # fededge: the codec, shared with the server

app = ClientApp(mods=[CompressionMod(UPDATE)])  # fededge: the one line on the client


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    net = Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = load_data(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))
    loss = train(net, x, y, int(context.run_config["local-steps"]), float(context.run_config["lr"]))
    metrics = MetricRecord({"train-loss": loss, "num-examples": len(y)})
    return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics}), reply_to=msg)
