"""Experiment: fededge's measurement around any strategy, in a user's own ServerApp.

The user's app (tests/clients/userapp.py) has its own model, data, ClientApp and
run-config keys, and its replies carry none of fededge's metrics (no compute-s, no
partition-id): what the clock needs falls back to the documented rules.
"""

from __future__ import annotations

import ast
import inspect
import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAdam, FedAvg, Strategy

import fededge.server.runner as runner_module
import fededge.server.experiment as experiment_module
from fededge import keys
from fededge._flwr_internals import wire_size
from fededge.api import DGA, Compressed, CompressionMod, DGAMod, Gossip, GossipMod, UpdateConfig
from fededge.clients.app import app as fededge_client
from fededge.clients.train import evaluate
from fededge.config import RunConfig
from fededge.netem.profiles import ProfileError
from fededge.server.runner import train_config
from fededge.server.grid import InProcessGrid, run_server
from fededge.server.inprocess import run_inprocess
from fededge.server.experiment import Experiment
from fededge.analysis.replay import replay_sim_s
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


def _measured_user_run(make_strategy, results: Path, *, rounds: int = 5, mods: Sequence = (),
                       **experiment) -> Path:
    """The user's ServerApp, measured: its own rounds key, its own evaluation, any strategy;
    fededge's ``mods`` (if any) on the user's train function."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        exp = Experiment(evaluate_fn=_user_evaluate, results_dir=results, progress="off",
                         config=dict(context.run_config), **experiment)
        res = exp.run(make_strategy(), grid, initial_arrays=userapp.initial_arrays(),
                      num_rounds=int(context.run_config["num-server-rounds"]), timeout=60.0)
        context.state["run"] = ConfigRecord({"dir": str(res.run_dir)})

    run_config = {**userapp.RUN_CONFIG, "num-server-rounds": rounds}
    grid = InProcessGrid(userapp.client_app(list(mods)), num_nodes=NODES, run_config=run_config)
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
    for module in (runner_module, experiment_module):
        path = Path(module.__file__)
        assert not _isinstance_targets(path) & strategies, path
        # ... nor imports them: the registry builds them, the report and resume interfaces describe them.
        imported = {n.module for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)}
        assert {m for m in imported if m and m.startswith("fededge.strategies")} <= \
            {"fededge.strategies.registry", "fededge.strategies.report", "fededge.strategies.resume"}, path


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
            "import fededge.server.experiment, fededge.strategies.fedasync, fededge.strategies.fedbuff\n"
            "import fededge.strategies.ssp, fededge.strategies.backup\n"
            "print(sorted(m for m in ('fededge.config', 'fededge.clients.app', 'fededge.server.runner')"
            " if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ----------------------------------------------------------------- a user's ClientApp on DGA's and gossip's clocks

TOPK = UpdateConfig(compressor="topk", topk_ratio=0.25, error_feedback=True)
#: The clock's rules for the replies of the user's ClientApp: heterogeneous links and
#: device speeds (so that where a node is placed shows in the time), a fixed compute.
CLOCK = {"netem": "wifi:0.5,4g:0.5", "compute_speed": "lognormal:1.0", "compute_s": 0.5, "seed": 2}


def _reporting_node_index():
    """A mod that reports, as the reply's ``partition-id``, what the clock falls back to
    for a reply without one: its node id's index among the run's node ids (the node ids
    of an in-process grid are seeded, so a second grid has the same ones)."""
    ids = sorted(InProcessGrid(userapp.client_app(), num_nodes=NODES, run_config=userapp.RUN_CONFIG).contexts)

    def mod(msg, context, call_next):  # noqa: ANN001, ANN202
        reply = call_next(msg, context)
        if not reply.has_error():
            reply.content["metrics"]["partition-id"] = ids.index(context.node_id)
        return reply

    return mod


_OWN_CLOCK = {  # strategies that time their rounds themselves, with their client mods
    "dga": (lambda: DGA(delay=1, fraction_evaluate=0.0), lambda: [DGAMod()]),
    "gossip": (lambda: Gossip(topology="ring", algorithm="choco", gamma=0.8),
               lambda: [GossipMod(UpdateConfig(compressor="signsgd"))]),
}


@pytest.mark.parametrize("name", sorted(_OWN_CLOCK))
def test_a_clientapp_that_reports_no_partition_id_gets_a_clock_per_node(tmp_path, name):
    """The user's replies name no partition id: DGA and gossip place each node on the
    clock by its node id, every round, exactly as if it had reported that index."""
    make, mods = _OWN_CLOCK[name]
    run = _measured_user_run(make, tmp_path / "silent", mods=mods(), **CLOCK)
    silent = _lines(run)
    named = _lines(_measured_user_run(make, tmp_path / "named", mods=[_reporting_node_index(), *mods()], **CLOCK))
    # The four nodes' devices differ, so where a node is placed shows in the time.
    speeds = [c["speed"] for c in json.loads((run / "netem.json").read_text())["clients"]]
    assert len(speeds) == NODES and max(speeds) > 1.5 * min(speeds)
    assert all(r["round_sim_s"] > 0 for r in silent[1:])
    assert all(sorted(c["partition"] for c in r["clients"]) == list(range(NODES)) for r in silent[1:])
    # Same links, same speeds, the same rounds on the clock (the reported metric adds a
    # few bytes to each upload: microseconds on these links).
    assert [r["round_sim_s"] for r in silent] == pytest.approx([r["round_sim_s"] for r in named], abs=1e-3)


# ----------------------------------------------------------------- codec mismatches, counted in metrics.jsonl


def _one_client_in(codec: str):
    """Client 1's CompressionMod uses ``codec``; the others the server's TOPK."""
    good, bad = CompressionMod(TOPK), CompressionMod(compressor=codec)

    def mod(msg, context, call_next):  # noqa: ANN001, ANN202
        return (bad if int(context.node_config["partition-id"]) == 1 else good)(msg, context, call_next)

    return mod


_CHECKED = {  # server sides told the clients' codec, with the client mods after the codec's
    "compressed": (lambda: Compressed(FedAvg(fraction_evaluate=0.0), update=TOPK), []),
    "dga": (lambda: DGA(delay=1, fraction_evaluate=0.0, update=TOPK), [DGAMod()]),
}


@pytest.mark.parametrize("name", sorted(_CHECKED))
def test_updates_in_another_codec_are_recorded_as_mismatched(tmp_path, name):
    make, mods = _CHECKED[name]
    run = _measured_user_run(make, tmp_path, rounds=3, mods=[_one_client_in("signsgd"), *mods])
    lines, summary = _lines(run), _summary(run)
    assert summary["status"] == "completed"
    assert [(r["rejected"], r["mismatched"], r["num_clients"]) for r in lines] == \
        [(0, 0, 0)] + [(1, 1, NODES - 1)] * 3
    assert (summary["total_rejected"], summary["total_mismatched"]) == (3, 3)


def test_an_update_that_does_not_decode_is_rejected_but_not_mismatched(tmp_path):
    def truncating(msg, context, call_next):  # noqa: ANN001, ANN202 - client 1's payload is cut short
        reply = call_next(msg, context)
        if int(context.node_config["partition-id"]) == 1:
            rec = reply.content[keys.COMPRESSED]
            name = next(iter(rec.keys()))
            rec[name] = Array(rec[name].numpy()[:-3].copy())
        return reply

    run = _measured_user_run(lambda: Compressed(FedAvg(fraction_evaluate=0.0), update=TOPK), tmp_path, rounds=2,
                             mods=[truncating, CompressionMod(TOPK)])
    assert [(r["rejected"], r["mismatched"]) for r in _lines(run)] == [(0, 0), (1, 0), (1, 0)]


def test_round_reports_carry_mismatches_through_a_wrapper():
    inner = RoundReport(rejected=1, mismatched=1)
    assert inner.merge(RoundReport(rejected=2, mismatched=1)).mismatched == 2
    assert RoundReport().mismatched == 0


# ----------------------------------------------------------------- replaying a user's run


@pytest.mark.parametrize("name", ["fedadam", "dga"])
def test_a_users_run_replays_to_its_own_sim_s(tmp_path, name):
    """The user's run config has none of fededge's keys (and a 'local-steps' of its own):
    the replay reads the clock Experiment recorded, and DGA's delay from its rounds."""
    make, mods = {"fedadam": (lambda: FedAdam(fraction_evaluate=0.0, eta=0.05), []),
                  "dga": (lambda: DGA(delay=2, warmup_rounds=1, fraction_evaluate=0.0), [DGAMod()])}[name]
    run = _measured_user_run(make, tmp_path, mods=mods, netem="wifi:0.5,3g:0.5", compute_speed="lognormal:0.5",
                             seed=3, compute_s=0.4, sim_step_s=0.1, message_overhead_s=0.05)
    lines = _lines(run)
    assert "netem" not in json.loads((run / "config.json").read_text())["config"]
    assert lines[-1]["sim_s"] > 0
    assert replay_sim_s(run) == pytest.approx([r["sim_s"] for r in lines], abs=1e-5)
    # Under an ideal network the same record is compute (and per-message overhead) only.
    assert replay_sim_s(run, netem="")[-1] < lines[-1]["sim_s"] - 0.5


@pytest.mark.parametrize("over", [{}, {"strategy": "dga", "dga-delay": 1}, {"strategy": "gossip", "topology": "ring"}],
                         ids=["fedavg", "dga", "gossip"])
def test_evaluate_every_skips_evaluations_and_changes_nothing_else(tmp_path, over):
    """``evaluate-every = 3`` over 7 rounds: the server evaluates rounds 0, 3, 6 and 7
    (the last) only; the rounds between are null, and what was evaluated, the bytes and
    the final model equal the run that evaluates every round, bit for bit. For Flower's
    loop and the strategies that run their own (DGA, gossip)."""
    mapping = {**BASE, "num-rounds": 7, **over}
    every = run_inprocess({**mapping, "results-dir": str(tmp_path / "every")}, num_clients=NODES)
    some = run_inprocess({**mapping, "evaluate-every": 3, "results-dir": str(tmp_path / "some")}, num_clients=NODES)
    a, b = _without_wall_clock(_lines(every)), _without_wall_clock(_lines(some))
    assert [r["round"] for r in b if r["accuracy"] is not None] == [0, 3, 6, 7]
    assert all(r["loss"] is None for r in b if r["accuracy"] is None)
    skipped = {"accuracy", "loss"} | {k for k in a[0] if k.startswith("node_")}
    for x, y in zip(a, b, strict=True):
        if y["accuracy"] is None:
            assert {k: v for k, v in x.items() if k not in skipped} == \
                {k: v for k, v in y.items() if k not in skipped}
        else:
            assert x == y
    sa, sb = _summary(every), _summary(some)
    assert sb["final_accuracy"] == sa["final_accuracy"] and sb["total_bytes_up"] == sa["total_bytes_up"]
    ma, mb = torch.load(every / "model.pt"), torch.load(some / "model.pt")
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


def test_plot_draws_a_run_with_rounds_not_evaluated(tmp_path):
    import numpy as np

    from fededge.analysis.plot import load_run, plot_runs

    run = run_inprocess({**BASE, "num-rounds": 4, "evaluate-every": 2, "results-dir": str(tmp_path)},
                        num_clients=NODES)
    data = load_run(run)
    assert list(np.isnan(data.accuracy)) == [False, True, False, True, False]
    out = plot_runs([run], tmp_path / "runs.png")
    assert out.is_file() and out.stat().st_size > 0


def test_the_former_module_path_still_imports_experiment_and_says_where_it_went():
    """fededge.server.measure was Experiment's module until it moved to a module of its
    name: an app that imports from the old path gets the same class and one warning."""
    import subprocess
    import sys

    code = ("import warnings\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    from fededge.server.measure import Experiment as Old\n"
            "from fededge.server.experiment import Experiment\n"
            "from fededge.api import Experiment as Api\n"
            "print(Old is Experiment is Api, [str(w.message) for w in caught if w.category is DeprecationWarning])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    same, _, message = out.stdout.partition(" ")
    assert same == "True"
    assert "fededge.server.experiment" in message
