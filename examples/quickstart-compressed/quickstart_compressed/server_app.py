"""The ServerApp: Flower's FedAdam, wrapped by fededge's Compressed, which rebuilds each
client's model from its compressed update before FedAdam aggregates."""

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAdam

from fededge.api import Compressed  # fededge

from quickstart_compressed.client_app import UPDATE
from quickstart_compressed.task import Net, evaluate, test_data

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    x_test, y_test = test_data()
    history: dict[str, float] = {}

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net = Net()
        net.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate(net, x_test, y_test)
        history[f"round-{server_round}"] = acc
        return MetricRecord({"loss": loss, "accuracy": acc})

    strategy = FedAdam(fraction_evaluate=0.0, eta=float(context.run_config["server-lr"]))
    strategy = Compressed(strategy, update=UPDATE)  # fededge: the one line on the server
    strategy.start(
        grid=grid, initial_arrays=ArrayRecord(Net().state_dict()),
        num_rounds=int(context.run_config["num-server-rounds"]), evaluate_fn=evaluate_fn)
    context.state["accuracy"] = ConfigRecord(history)  # per round, for whoever ran the app
