"""The ClientApp: plain local SGD, nothing of fededge's. FedBuff is a server-side
strategy; the clients' heterogeneity (links, device speeds) is emulated on the server's
simulated clock."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedbuff_stragglers.task import Net, load_data, train

app = ClientApp()


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    net = Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = load_data(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))
    loss = train(net, x, y, int(context.run_config["local-steps"]), float(context.run_config["lr"]))
    metrics = MetricRecord({"train-loss": loss, "num-examples": len(y)})
    return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics}), reply_to=msg)
