"""The ServerApp: fededge's DGA strategy, run under fededge's Experiment, which meters
every message's bytes and times the run on a simulated clock with every client on a
`4g` link (metrics.jsonl, summary.json under the run-config key results-dir)."""

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fededge.api import DGA  # fededge
from fededge.server.experiment import Experiment  # fededge (also fededge.api.Experiment)

from dga_4g.task import Net, evaluate, test_data

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

    # fededge: the measurement, and the strategy (D rounds of delay hide the 4g uplink).
    exp = Experiment(evaluate_fn=evaluate_fn, results_dir=str(cfg["results-dir"]), netem=str(cfg["netem"]),
                     compute_s=float(cfg["compute-s"]), target_accuracy=0.8, config=dict(cfg))
    res = exp.run(DGA(delay=int(cfg["delay"]), fraction_evaluate=0.0), grid,
                  initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=int(cfg["num-server-rounds"]))
    context.state["run"] = ConfigRecord({"dir": str(res.run_dir), "sim-s": float(res.summary["sim_s"])})
