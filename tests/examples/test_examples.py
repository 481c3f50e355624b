"""The examples (examples/*): each user-style Flower app runs in-process a few rounds
with fededge's pieces added, and shows what it claims; each pyproject.toml parses and
names components that import."""

from __future__ import annotations

import importlib
import json
import sys
import tomllib
from pathlib import Path

import pytest
from flwr.cli.config_utils import load_and_validate
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

from fededge._flwr_internals import wire_size
from fededge.server.grid import InProcessGrid, run_server

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NAMES = ["quickstart-compressed", "dga-4g", "choco-ring", "fedbuff-stragglers"]


def _project(name: str) -> dict:
    return tomllib.loads((EXAMPLES / name / "pyproject.toml").read_text())


def _component(name: str, ref: str) -> object:
    path = str(EXAMPLES / name)
    if path not in sys.path:
        sys.path.insert(0, path)  # as `flwr run .` puts the app's directory on the path
    module, attr = ref.split(":")
    return getattr(importlib.import_module(module), attr)


def _apps(name: str) -> tuple[ServerApp, ClientApp, dict]:
    flwr = _project(name)["tool"]["flwr"]["app"]
    return (_component(name, flwr["components"]["serverapp"]), _component(name, flwr["components"]["clientapp"]),
            dict(flwr["config"]))


class CountingGrid(InProcessGrid):
    """The in-process grid, counting the bytes of the train replies on the wire."""

    bytes_up = 0
    replies = 0

    def pull_messages(self, message_ids):  # noqa: ANN001, ANN201
        replies = list(super().pull_messages(message_ids))
        for m in replies:
            if not m.has_error():
                self.bytes_up += wire_size(m)
                self.replies += 1
        return replies


@pytest.mark.parametrize("name", NAMES)
def test_each_example_is_a_flower_app_whose_components_import(name):
    project = _project(name)
    # Flower's own check, the one `flwr run .` makes (fields, FAB format, component refs).
    _, warnings = load_and_validate(EXAMPLES / name / "pyproject.toml", check_module=False)
    assert not warnings, warnings
    app = project["tool"]["flwr"]["app"]
    assert set(app["components"]) == {"serverapp", "clientapp"}
    server, client, config = _apps(name)
    assert isinstance(server, ServerApp) and isinstance(client, ClientApp)
    assert "num-server-rounds" in config and "fededge" in project["project"]["dependencies"]
    readme = (EXAMPLES / name / "README.md").read_text()
    assert "flwr run ." in readme and "pip install -e ../.." in readme


def test_quickstart_compressed_learns_with_one_bit_updates():
    server, client, config = _apps("quickstart-compressed")
    grid = CountingGrid(client, num_nodes=4, run_config={**config, "num-server-rounds": 4})
    acc = run_server(server, grid).state["accuracy"]
    assert acc["round-4"] > acc["round-0"] + 0.2
    dense = 4 * (64 * 32 + 32 + 32 * 10 + 10)  # the float32 model one uncompressed reply carries
    assert grid.replies == 16 and grid.bytes_up < 0.25 * grid.replies * dense


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _measured(name: str, tmp_path: Path, **over) -> tuple[Path, list[dict], dict]:  # noqa: ANN003
    server, client, config = _apps(name)
    grid = InProcessGrid(client, num_nodes=4, run_config={**config, "results-dir": str(tmp_path), **over})
    run_dir = Path(str(run_server(server, grid).state["run"]["dir"]))
    return run_dir, _lines(run_dir), json.loads((run_dir / "summary.json").read_text())


def test_dga_over_4g_is_measured_on_the_simulated_clock(tmp_path):
    run_dir, lines, summary = _measured("dga-4g", tmp_path, **{"num-server-rounds": 4})
    assert [r["round"] for r in lines] == [0, 1, 2, 3, 4] and summary["status"] == "completed"
    sims = [r["sim_s"] for r in lines]
    assert sims == sorted(sims) and sims[-1] > 0 and summary["sim_s"] == sims[-1]
    assert all(r["round_sim_s"] > 0 for r in lines[1:])
    assert all(r["bytes_up"] > 0 for r in lines[1:])
    clients = json.loads((run_dir / "netem.json").read_text())["clients"]
    assert [c["profile"] for c in clients] == ["4g"] * 4
    assert lines[-1]["loss"] < lines[0]["loss"] and lines[-1]["accuracy"] > lines[0]["accuracy"] + 0.2


def test_choco_on_a_ring_trains_every_node_over_gossip_traffic(tmp_path):
    run_dir, lines, summary = _measured("choco-ring", tmp_path, **{"num-server-rounds": 5})
    assert [r["round"] for r in lines] == list(range(6)) and summary["status"] == "completed"
    model = 4 * (64 * 32 + 32 + 32 * 10 + 10)
    for r in lines[1:]:
        # Each node's message goes to its two ring neighbours, compressed: traffic between
        # peers every round, each message well under the dense model.
        assert 0 < r["bytes_p2p"] < 4 * 2 * model / 4 and r["num_clients"] == 4
    assert lines[-1]["loss"] < lines[0]["loss"] and lines[-1]["accuracy"] > lines[0]["accuracy"] + 0.2
    assert lines[-1]["sim_s"] > 0


def test_fedbuff_with_stragglers_lets_fast_clients_contribute_more_and_plots(tmp_path):
    server, client, config = _apps("fedbuff-stragglers")
    grid = InProcessGrid(client, num_nodes=4,
                         run_config={**config, "results-dir": str(tmp_path), "num-server-rounds": 12})
    state = run_server(server, grid).state["run"]
    run_dir, plot = Path(str(state["dir"])), Path(str(state["plot"]))
    assert plot.is_file() and plot.stat().st_size > 1000 and plot.parent == run_dir
    lines, summary = _lines(run_dir), json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and all(r["num_clients"] == 2 for r in lines[1:])
    sims = [r["sim_s"] for r in lines]
    assert sims == sorted(sims) and sims[-1] > 0
    contrib = summary["contributions"]  # node id -> updates aggregated
    assert sum(contrib.values()) == 24 and len(contrib) == 4
    assert max(contrib.values()) >= 2 * min(contrib.values())  # the fast outpace the stragglers
    # ... in the order of their speed on the clock (here wifi/3g and the drawn speed agree).
    # A reply that names no partition id is placed on the clock's client (link, speed)
    # by its node id's index among the run's node ids, in increasing order.
    speed = {c["partition-id"]: c["speed"] for c in json.loads((run_dir / "netem.json").read_text())["clients"]}
    by_link = {sorted(grid.contexts).index(int(n)): k for n, k in contrib.items()}
    assert sorted(by_link, key=by_link.get) == sorted(speed, key=speed.get)
    assert max(int(k) for k in summary["staleness_hist"]) >= 1
    assert lines[-1]["loss"] < lines[0]["loss"] and lines[-1]["accuracy"] > lines[0]["accuracy"] + 0.2


def test_a_round_whose_every_reply_failed_stops_the_run_naming_the_clients_error(tmp_path):
    """Issue 37: the mods of a user's app in an order that cannot work (DGAMod outside
    CompressionMod). Every client raises ModOrderError; the run stops after round 1 with
    RoundFailedError quoting it, and the user's evaluate_fn never sees an empty record."""
    from flwr.app import ArrayRecord

    from fededge.api import CompressionMod, DGAMod, RoundFailedError, UpdateConfig

    server, _, config = _apps("dga-4g")
    client_module = importlib.import_module("dga_4g.client_app")
    wrong = ClientApp(mods=[DGAMod(), CompressionMod(UpdateConfig(compressor="topk"))])
    wrong.train()(client_module.train_fn)
    server_module = importlib.import_module("dga_4g.server_app")
    seen: list[ArrayRecord] = []
    real = server_module.evaluate

    def evaluate(net, x, y):  # noqa: ANN001, ANN202 - the user's evaluate, watched
        seen.append(ArrayRecord(net.state_dict()))
        return real(net, x, y)

    server_module.evaluate = evaluate
    try:
        grid = InProcessGrid(wrong, num_nodes=4, run_config={**config, "results-dir": str(tmp_path)})
        with pytest.raises(RoundFailedError, match=r"round 1: no client update could be used \(4 of 4 replies "
                                                   r"failed.*ModOrderError.*register DGAMod inside CompressionMod"):
            run_server(server, grid)
    finally:
        server_module.evaluate = real
    assert len(seen) == 1 and len(seen[0]) > 0  # round 0 only, on the initial model
    (run_dir,) = list(tmp_path.iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "ModOrderError" in summary["error"]
