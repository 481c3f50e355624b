"""The ClientApp: plain local SGD. fededge makes each node a CHOCO-SGD node: it mixes its
neighbours' compressed messages into its model before training and sends its own
(sign-compressed, about 1 bit per weight) after; there is no global model."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fededge.api import GossipMod, UpdateConfig  # fededge

from choco_ring.task import Net, load_data, train

app = ClientApp(mods=[GossipMod(UpdateConfig(compressor="signsgd"))])  # fededge: CHOCO's compressor Q


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    net = Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = load_data(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))
    loss = train(net, x, y, int(context.run_config["local-steps"]), float(context.run_config["lr"]))
    metrics = MetricRecord({"train-loss": loss, "num-examples": len(y)})
    return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics}), reply_to=msg)
