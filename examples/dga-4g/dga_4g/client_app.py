"""The ClientApp: plain local SGD. fededge adds the client side of Delayed Gradient
Averaging: the node keeps training while its update of round t is still on the way."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fededge.api import DGAMod  # fededge

from dga_4g.task import Net, load_data, train

app = ClientApp(mods=[DGAMod()])  # fededge: the one line on the client


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    net = Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = load_data(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))
    loss = train(net, x, y, int(context.run_config["local-steps"]), float(context.run_config["lr"]))
    metrics = MetricRecord({"train-loss": loss, "num-examples": len(y)})
    return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics}), reply_to=msg)
