"""The ServerApp: fededge's FedBuff (asynchronous, buffered aggregation) with stragglers.

Experiment puts half the clients on `wifi` and half on `3g` links and draws each device's
speed from a log-normal (sigma 1: some several times slower than others), then orders
the replies by when they would arrive on that simulated clock. FedBuff steps the model
every `buffer-size` updates, so fast clients are never held back by the stragglers and
contribute more updates. The run's plot (accuracy vs round, simulated time, uplink
bytes) is written next to its metrics."""

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fededge.api import FedBuff  # fededge
from fededge.server.experiment import Experiment  # fededge (also fededge.api.Experiment)
from fededge.analysis.plot import plot_runs  # fededge

from fedbuff_stragglers.task import Net, evaluate, test_data

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

    # fededge: heterogeneous clients on the simulated clock, FedBuff, and the plot.
    exp = Experiment(evaluate_fn=evaluate_fn, results_dir=str(cfg["results-dir"]), netem=str(cfg["netem"]),
                     compute_speed=str(cfg["compute-speed"]), compute_s=float(cfg["compute-s"]),
                     seed=int(cfg["seed"]), target_accuracy=0.8, config=dict(cfg))
    res = exp.run(FedBuff(buffer_size=int(cfg["buffer-size"]), fraction_evaluate=0.0), grid,
                  initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=int(cfg["num-server-rounds"]))
    plot = plot_runs([res.run_dir], res.run_dir / "fedbuff.png", title="FedBuff with stragglers")
    context.state["run"] = ConfigRecord({"dir": str(res.run_dir), "plot": str(plot)})
