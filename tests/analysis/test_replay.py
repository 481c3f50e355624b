"""Properties of fededge.analysis.replay: a run re-timed under its own network gives its
sim_s, under another network other times from the same per-client record."""

import json

import pytest

from fededge.analysis.replay import replay_sim_s
from fededge.server.inprocess import run_inprocess


def test_replay_reproduces_the_run_and_retimes_it(tmp_path):
    """Replaying a run under its own network gives its sim_s; under another, other times
    from the same per-client record."""
    for over in ({"strategy": "fedavg"}, {"strategy": "dga", "dga-delay": 2},
                 {"strategy": "dga", "dga-delay": 1, "sim-step-s": 0.01}):  # the clock's compute, not measured
        name = f"{over['strategy']}-{over.get('sim-step-s', 0)}"
        run_dir = run_inprocess({"num-rounds": 4, "local-steps": 3, "progress": "off", "netem": "wifi:0.5,4g:0.5",
                                 "results-dir": str(tmp_path / name), **over}, num_clients=3)
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert all(len(r["clients"]) == 3 and r["clients"][0]["bytes_up"] > 0 for r in lines[1:])
        again = replay_sim_s(run_dir)
        assert again == pytest.approx([r["sim_s"] for r in lines], abs=1e-5)
        slow = replay_sim_s(run_dir, netem="3g")
        assert all(b > a for a, b in zip(again[1:], slow[1:]))


def test_replay_reads_the_run_config_keys_of_a_run_dir_from_before_the_clock_entry(tmp_path):
    """Older run dirs have no ``clock`` / ``strategy_class`` in config.json and no
    per-client ``steps``: fededge's run-config keys still say how to replay them."""
    run_dir = run_inprocess({"num-rounds": 3, "local-steps": 3, "progress": "off", "netem": "wifi:0.5,4g:0.5",
                             "compute-speed": "lognormal:0.5", "seed": 4, "strategy": "dga", "dga-delay": 1,
                             "sim-step-s": 0.01, "results-dir": str(tmp_path)}, num_clients=3)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["clock"]["netem"] == "wifi:0.5,4g:0.5" and config["strategy_class"].endswith(".DGA")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    recorded = [r["sim_s"] for r in lines]
    assert replay_sim_s(run_dir) == pytest.approx(recorded, abs=1e-5)
    # The same run dir as fededge wrote it before: the clock from the run config's keys.
    del config["clock"], config["strategy_class"]
    (run_dir / "config.json").write_text(json.dumps(config))
    for r in lines:
        for c in r.get("clients", []):
            del c["steps"]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert replay_sim_s(run_dir) == pytest.approx(recorded, abs=1e-5)
    # Not a synchronous replay that happened to agree: DGA's overlap is what reproduces it.
    config["config"]["strategy"] = "fedavg"
    (run_dir / "config.json").write_text(json.dumps(config))
    assert replay_sim_s(run_dir)[-1] > recorded[-1] + 1e-3


def test_replay_refuses_a_gossip_run(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"config": {"strategy": "gossip"}}))
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="gossip runs cannot be replayed yet"):
        replay_sim_s(tmp_path)


@pytest.mark.parametrize("cls, match", [("fededge.strategies.fedbuff.FedBuff", "fedbuff runs cannot be replayed"),
                                        ("fededge.strategies.gossip.Gossip", "gossip runs cannot be replayed yet")])
def test_replay_refuses_a_users_async_or_gossip_run_by_its_strategy_class(tmp_path, cls, match):
    """A user's run config names no fededge strategy: the class Experiment recorded does."""
    (tmp_path / "config.json").write_text(json.dumps({"config": {"strategy": "mine"}, "strategy_class": cls,
                                                      "clock": {"netem": "4g"}}))
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=match):
        replay_sim_s(tmp_path)
