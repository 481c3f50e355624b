"""Experiment: fededge's measurement around any strategy, in a user's own ServerApp.

The user's app (tests/clients/userapp.py) has its own model, data, ClientApp and
run-config keys, and its replies carry none of fededge's metrics (no compute-s, no
partition-id): what the clock needs falls back to the documented rules.
"""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAdam, FedAvg, Strategy

import fededge.server.experiment as experiment_module
import fededge.server.measure as measure_module
from fededge._flwr_internals import wire_size
from fededge.clients.app import app as fededge_client
from fededge.clients.train import evaluate
from fededge.config import RunConfig
from fededge.netem.profiles import ProfileError
from fededge.server.experiment import train_config
from fededge.server.inprocess import InProcessGrid, run_inprocess, run_server
from fededge.server.measure import Experiment
from fededge.server.replay import replay_sim_s
from fededge.strategies.fedbuff import FedBuff
from fededge.strategies.registry import build_strategy
from fededge.strategies.report import RoundReport
from fededge.workload import dataset_for, model_for
from tests.clients import userapp

NODES = 4


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _user_evaluate(rnd: int, arrays: ArrayRecord) -> MetricRecord:
    loss, acc = userapp.evaluate_model(arrays)
    return MetricRecord({"loss": loss, "accuracy": acc})


def _measured_user_run(make_strategy, results: Path, *, rounds: int = 5, **experiment) -> Path:
    """The user's ServerApp, measured: its own rounds key, its own evaluation, any strategy."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        exp = Experiment(evaluate_fn=_user_evaluate, results_dir=results, progress="off",
                         config=dict(context.run_config), **experiment)
        res = exp.run(make_strategy(), grid, initial_arrays=userapp.initial_arrays(),
                      num_rounds=int(context.run_config["num-server-rounds"]), timeout=60.0)
        context.state["run"] = ConfigRecord({"dir": str(res.run_dir)})

    run_config = {**userapp.RUN_CONFIG, "num-server-rounds": rounds}
    grid = InProcessGrid(userapp.client_app(), num_nodes=NODES, run_config=run_config)
    return Path(str(run_server(app, grid).state["run"]["dir"]))


def _model_bytes() -> int:
    return sum(4 * v.numel() for v in userapp.Net().state_dict().values())


@pytest.mark.parametrize("netem", ["", "4g"])
def test_flowers_fedadam_in_a_users_serverapp_is_metered_timed_and_recorded(tmp_path, netem):
    run = _measured_user_run(lambda: FedAdam(fraction_evaluate=0.0, eta=0.05), tmp_path, netem=netem,
                             compute_s=0.5, seed=1, target_accuracy=0.8)
    lines, summary = _lines(run), _summary(run)
    assert [r["round"] for r in lines] == [0, 1, 2, 3, 4, 5] and summary["status"] == "completed"
    # The user's run config is recorded as given; fededge parsed none of it.
    assert json.loads((run / "config.json").read_text())["config"]["not-fededge"] == "at all"
    model = _model_bytes()
    for r in lines[1:]:
        # Measured bytes: each of the 4 links carried the whole model each way, plus
        # Flower's framing (object ids, metadata, the metric and config records).
        assert len(r["clients"]) == NODES and r["num_clients"] == NODES
        assert NODES * model < r["bytes_up"] < NODES * (model + 2500)
        assert r["bytes_up"] == sum(c["bytes_up"] for c in r["clients"])
        assert r["bytes_down"] == sum(c["bytes_down"] for c in r["clients"])
    # Measured, not estimated: Flower's FedAdam returns its model as float64, so from
    # round 2 on the broadcast weighs twice the float32 model the clients send back.
    assert NODES * model < lines[1]["bytes_down"] < NODES * (model + 2500)
    assert all(NODES * 2 * model < r["bytes_down"] < NODES * (2 * model + 2500) for r in lines[2:])
    for r in lines[1:]:
        # No compute-s in the replies: each is charged the fixed compute_s, and placed
        # by its node id (partitions 0..3).
        assert sorted(c["partition"] for c in r["clients"]) == [0, 1, 2, 3]
        assert all(c["compute_s"] == 0.5 for c in r["clients"])
        if netem == "":
            assert r["round_sim_s"] == 0.5  # an ideal network: compute only
        else:
            assert r["round_sim_s"] > 0.5 + 0.01  # 4g: 27.5 ms one way, 6.3 Mbit/s up
    # The recorded sim_s is exactly the clock's: re-timing the recorded work agrees.
    assert replay_sim_s(run, netem=netem, compute_speed="1.0", seed=1) == \
        pytest.approx([r["sim_s"] for r in lines], abs=1e-5)
    clients = json.loads((run / "netem.json").read_text())["clients"]
    assert [c["profile"] for c in clients] == [netem or None] * NODES
    assert lines[-1]["loss"] < lines[0]["loss"]  # FedAdam trained through it
    assert summary["total_bytes_up"] == sum(r["bytes_up"] for r in lines)
    assert summary["sim_s"] == lines[-1]["sim_s"]
    hit = next((r["round"] for r in lines if r["accuracy"] >= 0.8), None)
    assert summary["rounds_to_target"] == hit
    assert (run / "model.pt").exists()


def test_fedbuff_with_heterogeneous_simulated_clients_and_a_users_clientapp(tmp_path):
    def run(where: str) -> Path:
        return _measured_user_run(lambda: FedBuff(buffer_size=2, fraction_evaluate=0.0), tmp_path / where,
                                  rounds=16, netem="wifi:0.5,3g:0.5", compute_speed="lognormal:1.0",
                                  compute_s=0.5, seed=2)

    first = run("a")
    lines, summary = _lines(first)[1:], _summary(first)
    assert len(lines) == 16 and summary["status"] == "completed"
    assert all(r["async_order"] == "clock" and r["num_clients"] == 2 for r in lines)
    sims = [r["sim_s"] for r in lines]
    assert sims == sorted(sims) and len(set(sims)) > 8
    contrib = sorted(summary["contributions"].values())
    assert sum(contrib) == 32 and len(contrib) == NODES
    assert contrib[-1] >= 2 * contrib[0]  # fast clients (links, speeds) contribute more
    assert max(int(k) for k in summary["staleness_hist"]) >= 1
    assert lines[-1]["loss"] < _lines(first)[0]["loss"]
    # A fixed compute_s makes the run deterministic: arrival order, models and clock.
    again = _lines(run("b"))[1:]
    assert [(r["sim_s"], r["contributors"], r["accuracy"]) for r in again] == \
           [(r["sim_s"], r["contributors"], r["accuracy"]) for r in lines]


class _Counting(FedAvg):
    """A user's own strategy: one file, one method, and its figures are recorded."""

    def __init__(self, **kw) -> None:  # noqa: ANN003
        super().__init__(**kw)
        self.reported: list[int] = []

    def round_report(self, server_round: int) -> RoundReport:
        self.reported.append(server_round)
        return RoundReport(metrics={"my-figure": 10 * server_round}, summary={"reports": len(self.reported)})


def test_a_users_strategy_reports_its_own_figures(tmp_path):
    run = _measured_user_run(lambda: _Counting(fraction_evaluate=0.0), tmp_path, rounds=3)
    assert [r["my-figure"] for r in _lines(run)] == [0, 10, 20, 30]
    assert _summary(run)["reports"] == 4


BASE = {"num-rounds": 3, "local-steps": 2, "progress": "off", "partition": "iid", "model": "mlp",
        "sim-step-s": 0.05, "seed": 3}


def _without_wall_clock(lines: list[dict]) -> list[dict]:
    out = []
    for r in lines:
        r = {k: v for k, v in r.items() if k != "wall_s"}
        r["clients"] = [{k: v for k, v in c.items() if k != "compute_s"} for c in r["clients"]]
        out.append(r)
    return out


@pytest.mark.parametrize("over", [
    {"compressor": "topk", "topk-ratio": 0.1, "netem": "4g"},
    {"strategy": "dga", "dga-delay": 1, "netem": "wifi:0.5,4g:0.5", "compute-speed": "lognormal:0.5"},
    {"strategy": "fedbuff", "buffer-size": 2, "num-rounds": 5, "netem": "3g"},
], ids=["compressed", "dga", "fedbuff"])
def test_run_experiment_and_the_experiment_path_agree_bit_for_bit(tmp_path, over):
    """fededge's app is the library's first user, not a second path: the same pieces,
    put together by hand in a user's ServerApp, give the same run, bit for bit."""
    mapping = {**BASE, **over}
    via_app = run_inprocess({**mapping, "results-dir": str(tmp_path / "app")}, num_clients=NODES)
    cfg = RunConfig.from_mapping({**mapping, "results-dir": str(tmp_path / "lib")})
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        ds = dataset_for(cfg)
        model = model_for(cfg, ds)

        def evaluate_fn(rnd: int, arrays: ArrayRecord) -> MetricRecord:
            model.load_state_dict(arrays.to_torch_state_dict())
            loss, acc = evaluate(model, ds.x_test, ds.y_test)
            return MetricRecord({"accuracy": acc, "loss": loss})

        exp = Experiment(evaluate_fn=evaluate_fn, results_dir=cfg.results_dir, netem=cfg.netem,
                         compute_speed=cfg.compute_speed, sim_step_s=cfg.sim_step_s, seed=cfg.seed,
                         progress="off")
        res = exp.run(build_strategy(cfg), grid, initial_arrays=ArrayRecord(model.state_dict()),
                      num_rounds=cfg.num_rounds, timeout=cfg.round_timeout, train_config=train_config(cfg))
        context.state["run"] = ConfigRecord({"dir": str(res.run_dir)})

    grid = InProcessGrid(fededge_client, num_nodes=NODES, run_config=cfg.to_mapping(), seed=cfg.seed)
    via_lib = Path(str(run_server(app, grid).state["run"]["dir"]))
    assert _without_wall_clock(_lines(via_lib)) == _without_wall_clock(_lines(via_app))
    a, b = torch.load(via_app / "model.pt"), torch.load(via_lib / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def _isinstance_targets(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            for n in ast.walk(node.args[1]):
                if isinstance(n, ast.Name):
                    names.add(n.id)
    return names


def _strategy_classes() -> set[str]:
    import pkgutil

    import flwr.serverapp.strategy as flower
    import fededge.strategies as ours

    names = {n for n, obj in vars(flower).items() if inspect.isclass(obj) and issubclass(obj, Strategy)}
    for mod in pkgutil.iter_modules(ours.__path__):
        module = __import__(f"fededge.strategies.{mod.name}", fromlist=["_"])
        names |= {n for n, obj in vars(module).items() if inspect.isclass(obj) and issubclass(obj, Strategy)}
    return names


def test_the_measurement_never_branches_on_strategy_classes():
    strategies = _strategy_classes()
    assert {"FedAvg", "FedAdam", "DGA", "Gossip", "FedBuff", "BackupWorkers", "Compressed"} <= strategies
    for module in (experiment_module, measure_module):
        path = Path(module.__file__)
        assert not _isinstance_targets(path) & strategies, path
        # ... nor imports them: the registry builds them, the report interface describes them.
        imported = {n.module for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)}
        assert {m for m in imported if m and m.startswith("fededge.strategies")} <= \
            {"fededge.strategies.registry", "fededge.strategies.report"}, path


def test_experiment_knobs_default_as_the_run_config_does():
    """One declaration per knob: the Experiment's defaults are RunConfig's."""
    params = inspect.signature(Experiment).parameters
    cfg = RunConfig()
    for name in ("netem", "netem_file", "compute_speed", "sim_step_s", "seed", "target_accuracy", "progress",
                 "save_model", "run_name"):
        assert params[name].default == getattr(cfg, name), name
    assert str(params["results_dir"].default) == cfg.results_dir


@pytest.mark.parametrize("kw, match", [
    ({"progress": "loud"}, "progress must be one of auto, bar, lines, off"),
    ({"netem": "4g:0.3,wifi:0.3"}, "sum"),
    ({"compute_speed": "lognormal:-1"}, "SIGMA >= 0"),
    ({"sim_step_s": -1.0}, "sim_step_s must be a number of seconds >= 0"),
    ({"compute_s": float("nan")}, "compute_s must be None or a number of seconds >= 0"),
    ({"min_nodes": -1}, "min_nodes must be >= 0"),
    ({"evaluate_fn": None}, "evaluate_fn must be a callable"),
])
def test_bad_experiment_settings_are_named_before_any_run(kw, match):
    with pytest.raises(ValueError, match=match):
        Experiment(**{"evaluate_fn": _user_evaluate, **kw})


def test_an_unknown_profile_stops_the_run_before_any_training(tmp_path):
    calls = []

    class Never(FedAvg):
        def start(self, **kw):  # noqa: ANN003, ANN201
            calls.append(kw)

    with pytest.raises(ProfileError):
        _measured_user_run(Never, tmp_path, netem="no-such-profile")
    assert not calls
    (run,) = tmp_path.iterdir()
    assert _summary(run)["status"] == "failed" and "no-such-profile" in _summary(run)["error"]


def test_an_evaluate_fn_without_accuracy_and_loss_is_named(tmp_path):
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        Experiment(evaluate_fn=lambda rnd, arrays: MetricRecord({"f1": 0.5}), results_dir=tmp_path,
                   progress="off").run(FedAvg(), grid, initial_arrays=userapp.initial_arrays(), num_rounds=1)

    grid = InProcessGrid(userapp.client_app(), num_nodes=2, run_config=userapp.RUN_CONFIG)
    with pytest.raises(ValueError, match=r"'accuracy' and 'loss', got \['f1'\]"):
        run_server(app, grid)


def test_round_reports_merge_as_a_wrapper_adds_its_own():
    inner = RoundReport(groups=("3",), sim_s=1.5, num_clients=4, rejected=1, reasons=["a"], dropped=[2],
                        metrics={"staleness": 0.5, "x": 1}, summary={"hist": {"0": 1}})
    own = RoundReport(rejected=2, reasons=["b", "c"], payload_bytes=10, dense_bytes=80, metrics={"x": 2})
    both = inner.merge(own)
    assert (both.groups, both.sim_s, both.num_clients, both.dropped) == (("3",), 1.5, 4, [2])
    assert (both.rejected, both.reasons, both.ratio) == (3, ["a", "b", "c"], 8.0)
    assert both.metrics == {"staleness": 0.5, "x": 2} and both.summary == {"hist": {"0": 1}}
    assert RoundReport().merge(RoundReport()) == RoundReport() and RoundReport().ratio is None


def test_a_broadcast_is_counted_once_per_link(tmp_path):
    """bytes_down is the sum of each message's size on the wire: a model broadcast to
    four nodes counts four times, once per link."""
    run = _measured_user_run(lambda: FedAvg(fraction_evaluate=0.0), tmp_path, rounds=1)
    line = _lines(run)[1]
    one = wire_size(userapp.initial_arrays())
    assert line["bytes_down"] == sum(c["bytes_down"] for c in line["clients"]) and len(line["clients"]) == NODES
    assert all(one < c["bytes_down"] < one + 1500 for c in line["clients"])


def test_the_library_pieces_import_neither_the_run_config_nor_fededges_clientapp():
    """A user's ServerApp that measures with Experiment and runs FedBuff loads none of
    fededge's app: not its run-config parser, not its ClientApp."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import fededge.server.measure, fededge.strategies.fedasync, fededge.strategies.fedbuff\n"
            "import fededge.strategies.ssp, fededge.strategies.backup\n"
            "print(sorted(m for m in ('fededge.config', 'fededge.clients.app', 'fededge.server.experiment')"
            " if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
