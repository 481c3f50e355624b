"""`flwr run .` end to end on Flower's own simulation runtime (Ray), as a user runs it."""

import json
from pathlib import Path

import pytest

from fededge.deploy.launch import flwr_run_local
from fededge.deploy.procs import processes_of
from fededge.server.results import METRIC_FIELDS

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_flwr_run_completes_and_writes_every_metric(tmp_path):
    results = tmp_path / "results"
    over = {"num-rounds": 2, "local-steps": 5, "results-dir": str(results), "progress": "lines",
            "netem": "4g"}
    run = flwr_run_local(ROOT, flwr_home=tmp_path / "flwr-home", num_supernodes=3, timeout_s=420,
                         run_config=over)
    assert run.leftover_pids == [] and processes_of(str(tmp_path)) == []
    assert run.ok, f"status={run.status} rc={run.returncode}\n{run.output[-4000:]}"
    (run_dir,) = list(results.iterdir())
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in lines] == [0, 1, 2]
    for rec in lines:
        assert set(METRIC_FIELDS) <= set(rec), rec
    assert all(r["num_clients"] == 3 and r["bytes_up"] > 0 for r in lines[1:])
    config = json.loads((run_dir / "config.json").read_text())
    assert config["runtime"] == "flower" and config["versions"]["flwr"]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    assert "[fededge] round    2/2" in run.output
    # The simulated clock ran on 4g: a round is at least the network time of one client
    # (27.5 ms each way, 21.3 Mbit/s down, 6.3 Mbit/s up), whatever the compute.
    assert json.loads((run_dir / "netem.json").read_text())["clients"][0]["profile"] == "4g"
    for r in lines[1:]:
        network = 0.055 + (r["bytes_down"] / 3) * 8 / 21.3e6 + (r["bytes_up"] / 3) * 8 / 6.3e6
        assert r["round_sim_s"] >= network

    # The same config in the in-process runtime sends messages of the same size: only
    # metadata (random node ids, run id) differs, by a few bytes in ~1 MB. Ray keeps no
    # client state, so the server adds the nodes' state-store keys to every train config;
    # the in-process runtime sends them too when it keeps no client states either.
    from fededge.server.inprocess import run_inprocess

    local_dir = run_inprocess({**over, "results-dir": str(tmp_path / "local"), "progress": "off"},
                              num_clients=3, keep_client_states=False)
    local = [json.loads(x) for x in (local_dir / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(lines[1:], local[1:]):
        for key in ("bytes_up", "bytes_down"):
            assert abs(a[key] - b[key]) <= 1e-4 * b[key], (key, a[key], b[key])


def test_flwr_run_with_a_bad_value_fails_before_training(tmp_path):
    results = tmp_path / "results"
    run = flwr_run_local(
        ROOT, flwr_home=tmp_path / "flwr-home", num_supernodes=2, timeout_s=300,
        run_config={"local-lr": -1.0, "results-dir": str(results)},
    )
    assert run.leftover_pids == []
    # flwr run exits 0 regardless; the run's status tells the truth.
    assert run.status is not None and run.status != "finished:completed", run.output[-3000:]
    assert "'local-lr' must be > 0" in run.output
    assert not results.exists()


def test_flwr_run_stops_before_round_1_on_a_split_the_clients_cannot_make(tmp_path):
    """Issue 15 on Ray: Flower's simulation shows the ServerApp no node configs, so it asks
    one node its num-partitions (a query message), makes the clients' split itself and
    stops with one ConfigError; no client trains. 100 * 10 <= 1,600 training samples, yet
    no seeded Dirichlet draw (alpha 0.5) gives each of 100 clients 10."""
    results = tmp_path / "results"
    run = flwr_run_local(
        ROOT, flwr_home=tmp_path / "flwr-home", num_supernodes=100, timeout_s=300,
        run_config={"dataset": "synthetic", "synthetic-samples": 2000, "clients-per-round": 5,
                    "model": "mlp", "results-dir": str(results)},
    )
    assert run.leftover_pids == []
    assert run.status == "finished:failed", run.output[-3000:]
    failure = run.failure()
    assert failure.startswith("configuration error: partition='dirichlet' cannot give each of the 100 "), failure
    for needle in ("min-partition-size=10", "alpha=0.5", "1600 training samples", "raise alpha"):
        assert needle in failure
    assert "[ROUND 1" not in run.output  # stopped before Flower's round loop began
    (run_dir,) = list(results.iterdir())
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"


def test_flwr_run_with_compressed_uplink_and_downlink(tmp_path):
    """The client mod and the server wrapper under Flower's Ray runtime."""
    results = tmp_path / "results"
    run = flwr_run_local(
        ROOT, flwr_home=tmp_path / "flwr-home", num_supernodes=3, timeout_s=420,
        run_config={"num-rounds": 2, "local-steps": 5, "results-dir": str(results),
                    "compressor": "topk", "error-feedback": True, "downlink-compressor": "fp16"},
    )
    assert run.leftover_pids == []
    assert run.ok, f"status={run.status} rc={run.returncode}\n{run.output[-4000:]}"
    (run_dir,) = list(results.iterdir())
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    params = json.loads((run_dir / "config.json").read_text())["model_parameters"]
    for r in lines[1:]:
        assert r["num_clients"] == 3 and r["rejected"] == 0 and r["compression_ratio"] > 20
        assert r["bytes_up"] / 3 < 4 * params / 20  # top-1% with indices and framing
        assert 0.45 < (r["bytes_down"] / 3) / (4 * params) < 0.56  # float16 model + framing


def test_flwr_run_dga_in_lockstep_on_ray(tmp_path):
    """DGA under Flower's Ray simulation: one message per node in flight (auto), the
    overlap on the simulated clock, staleness as the rule says."""
    results = tmp_path / "results"
    run = flwr_run_local(
        ROOT, flwr_home=tmp_path / "flwr-home", num_supernodes=3, timeout_s=420,
        run_config={"num-rounds": 3, "local-steps": 3, "results-dir": str(results),
                    "strategy": "dga", "dga-delay": 1, "netem": "4g"},
    )
    assert run.leftover_pids == []
    assert run.ok, f"status={run.status} rc={run.returncode}\n{run.output[-4000:]}"
    (run_dir,) = list(results.iterdir())
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["pipelined"] for r in lines[1:]] == [False] * 3
    assert [r["staleness"] for r in lines[1:]] == [0, 1, 1]
    assert all(r["num_clients"] == 3 and r["failures"] == 0 for r in lines[1:])


def test_flwr_run_fedbuff_on_ray_orders_arrivals_on_the_clock(tmp_path):
    """FedBuff under Flower's Ray simulation: one message per node in flight, replies used
    in simulated-arrival order (heterogeneous links), stale updates weighted."""
    results = tmp_path / "results"
    run = flwr_run_local(
        ROOT, flwr_home=tmp_path / "flwr-home", num_supernodes=3, timeout_s=420,
        run_config={"num-rounds": 3, "local-steps": 3, "results-dir": str(results),
                    "strategy": "fedbuff", "buffer-size": 2, "netem": "4g",
                    "sim-step-s": 0.05, "dropout": 0.3, "round-timeout": 30.0},
    )
    assert run.leftover_pids == []
    assert run.ok, f"status={run.status} rc={run.returncode}\n{run.output[-4000:]}"
    (run_dir,) = list(results.iterdir())
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in lines] == [0, 1, 2, 3]
    assert all(r["async_order"] == "clock" and r["num_clients"] == 2 for r in lines[1:])
    sims = [r["sim_s"] for r in lines[1:]]
    assert sims == sorted(sims)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and sum(summary["contributions"].values()) == 6
    assert len(summary["contributions"]) == 2  # dropout 0.3 of 3: one node never answers


# FedAsync and SSP run the same loop as FedBuff (AsyncFL), tested on Ray above; both
# passed here too when parametrized (65 s and 57 s), left out of CI for its time budget.
@pytest.mark.parametrize("strategy", ["backup"])
def test_flwr_run_the_other_async_strategies_on_ray(tmp_path, strategy):
    """Backup workers (their own synchronous loop) complete under Flower's Ray simulation."""
    results = tmp_path / "results"
    run = flwr_run_local(
        ROOT, flwr_home=tmp_path / "flwr-home", num_supernodes=3, timeout_s=420,
        run_config={"num-rounds": 3, "local-steps": 2, "results-dir": str(results),
                    "strategy": strategy, "backup-workers": 1, "ssp-bound": 1,
                    "netem": "wifi:0.34,4g:0.66", "sim-step-s": 0.05},
    )
    assert run.leftover_pids == []
    assert run.ok, f"status={run.status} rc={run.returncode}\n{run.output[-4000:]}"
    (run_dir,) = list(results.iterdir())
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in lines] == [0, 1, 2, 3]
    assert all(r["async_order"] == "clock" for r in lines[1:])
    assert all(r["num_clients"] == (2 if strategy == "backup" else 1) for r in lines[1:])


def test_flwr_run_gossip_ring_on_ray(tmp_path):
    """Gossip under Flower's Ray simulation: 4 SuperNodes on a ring, CHOCO with top-k,
    one message per node per round (lock-step), per-node metrics and the relay's bytes."""
    results = tmp_path / "results"
    run = flwr_run_local(
        ROOT, flwr_home=tmp_path / "flwr-home", num_supernodes=4, timeout_s=420,
        run_config={"num-rounds": 2, "local-steps": 3, "results-dir": str(results),
                    "strategy": "gossip", "topology": "ring", "gossip-algorithm": "choco",
                    "compressor": "topk", "topk-ratio": 0.05, "netem": "4g"},
    )
    assert run.leftover_pids == []
    assert run.ok, f"status={run.status} rc={run.returncode}\n{run.output[-4000:]}"
    (run_dir,) = list(results.iterdir())
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["topology"] == "ring" and lines[0]["spectral_gap"] > 0
    for r in lines[1:]:
        assert r["num_clients"] == 4 and r["failures"] == 0 and r["gossip_failed"] == []
        assert r["node_accuracy_min"] <= r["node_accuracy_mean"] <= r["node_accuracy_max"]
        assert r["bytes_p2p"] > 0 and r["bytes_eval_up"] > 0 and r["round_sim_s"] > 0
    # Round 2 relays round 1's messages: each top-5% message down to two neighbours.
    assert lines[2]["bytes_down"] == pytest.approx(lines[2]["bytes_p2p"], rel=0.05)


def test_flwr_run_resumes_a_run_on_ray(tmp_path, monkeypatch):
    """resume-from under Flower's simulation (issue 18): a new Flower run continues the run
    directory from its checkpoint: its rounds appended, the earlier lines kept as they were.
    The clients' context.state is Ray's, not in the checkpoint: each node takes up the
    state it kept on disk (fededge.clients.statestore), so the resumed run equals an
    uninterrupted one within float tolerance (Ray's node ids, new in each run, change the
    order in which the updates are summed)."""
    monkeypatch.setenv("FEDEDGE_STATE_DIR", str(tmp_path / "state"))
    results = tmp_path / "results"
    conf = {"num-rounds": 2, "local-steps": 3, "model": "mlp", "results-dir": str(results), "checkpoint-every": 1,
            "compressor": "topk", "error-feedback": True}
    first = flwr_run_local(ROOT, flwr_home=tmp_path / "flwr-home", num_supernodes=3, timeout_s=420, run_config=conf)
    assert first.ok, f"status={first.status} rc={first.returncode}\n{first.output[-4000:]}"
    (run_dir,) = list(results.iterdir())
    before = (run_dir / "metrics.jsonl").read_text().splitlines()
    again = flwr_run_local(ROOT, flwr_home=tmp_path / "flwr-home-2", num_supernodes=3, timeout_s=420,
                           run_config={**conf, "num-rounds": 3, "resume-from": str(run_dir)})
    assert again.leftover_pids == []
    assert again.ok, f"status={again.status} rc={again.returncode}\n{again.output[-4000:]}"
    assert "resumed after round 2" in again.output
    after = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert after[:3] == before and [json.loads(x)["round"] for x in after] == [0, 1, 2, 3]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 3
    assert list(results.iterdir()) == [run_dir]  # no second run directory
    assert len(list((tmp_path / "state").glob("*/partition-*/*.state"))) >= 3  # each node kept its state
    whole_res = tmp_path / "whole"
    whole = flwr_run_local(ROOT, flwr_home=tmp_path / "flwr-home-3", num_supernodes=3, timeout_s=420,
                           run_config={**conf, "num-rounds": 3, "results-dir": str(whole_res)})
    assert whole.ok, f"status={whole.status} rc={whole.returncode}\n{whole.output[-4000:]}"
    (whole_dir,) = list(whole_res.iterdir())
    a = [json.loads(x) for x in after]
    b = [json.loads(x) for x in (whole_dir / "metrics.jsonl").read_text().splitlines()]
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5), (ra["round"], ra["loss"], rb["loss"])
        assert ra["accuracy"] == pytest.approx(rb["accuracy"], abs=1e-9)
        assert ra["bytes_up"] == pytest.approx(rb["bytes_up"], rel=1e-3)
