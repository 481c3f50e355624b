"""The ServerApp: fededge's Gossip strategy, CHOCO-SGD on a ring. The server only relays
each node's message to its two neighbours; Experiment records the peer-to-peer bytes,
every node's model's accuracy and their consensus distance each round."""

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fededge.api import Gossip  # fededge
from fededge.server.experiment import Experiment  # fededge (also fededge.api.Experiment)

from choco_ring.task import Net, evaluate, test_data

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    x_test, y_test = test_data()

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net = Net()
        net.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate(net, x_test, y_test)
        return MetricRecord({"loss": loss, "accuracy": acc})

    # fededge: CHOCO-SGD on a ring, measured.
    strategy = Gossip(topology="ring", algorithm="choco", gamma=float(cfg["gamma"]))
    exp = Experiment(evaluate_fn=evaluate_fn, results_dir=str(cfg["results-dir"]), netem=str(cfg["netem"]),
                     compute_s=float(cfg["compute-s"]), target_accuracy=0.8, config=dict(cfg))
    res = exp.run(strategy, grid, initial_arrays=ArrayRecord(Net().state_dict()),
                  num_rounds=int(cfg["num-server-rounds"]))
    context.state["run"] = ConfigRecord({"dir": str(res.run_dir)})
