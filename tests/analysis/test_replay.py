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


@pytest.mark.parametrize("over", [
    {"nodes-pull": True, "netem": "4g"},                                  # the run's links pull: replay's did not
    {"dropout": 0.34, "round-timeout": 30.0, "sim-step-s": 0.01},         # the timeout a dropout costs
    {"norm-stats": "global", "model": "cnn-bn", "netem": "3g", "compressor": "signsgd"},  # the second exchange
    {"fraction-evaluate": 1.0, "netem": "3g"},                            # the clients' evaluation
    {"fraction-evaluate": 1.0, "netem": "wifi:0.34,3g:0.66", "sim-step-s": 0.01},  # on its own link, no real time
], ids=["nodes-pull", "dropout", "norm-stats-global", "client-evaluation", "client-evaluation-steps"])
def test_replay_reproduces_every_exchange_and_wait_the_run_timed(tmp_path, over):
    """Under its own setting a run replays to its own sim_s: replay left out nodes-pull's
    polls (3x too short), a dropout's timeout, norm-stats=global's second exchange; and
    the run's own clock left out the clients' evaluation (counted in bytes, not in time)."""
    run_dir = run_inprocess({"num-rounds": 3, "local-steps": 2, "progress": "off", "results-dir": str(tmp_path),
                             **over}, num_clients=3)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert replay_sim_s(run_dir) == pytest.approx([r["sim_s"] for r in lines], abs=1e-5)
    if "dropout" in over:  # a dropped-out client never answers: no bytes up (its stand-in reply was counted)
        assert all(r["dropped"] and r["bytes_up"] == sum(c["bytes_up"] for c in r["clients"]) for r in lines[1:])
    if "sim-step-s" in over and "fraction-evaluate" in over:
        # each client's evaluation on its own link, and no real seconds on the clock: a run
        # of the same seed is the same, to the microsecond
        assert all([c["partition"] for c in r["clients_evaluate"]] == [0, 1, 2] for r in lines[1:])
        again = run_inprocess({"num-rounds": 3, "local-steps": 2, "progress": "off",
                               "results-dir": str(tmp_path / "again"), **over}, num_clients=3)
        assert [json.loads(x)["sim_s"] for x in (again / "metrics.jsonl").read_text().splitlines()] == \
            [r["sim_s"] for r in lines]
    elif "fraction-evaluate" in over:  # timed: three clients' evaluation after the training, on 3g
        assert all(len(r["clients_evaluate"]) == 3 for r in lines[1:])
        alone = run_inprocess({"num-rounds": 3, "local-steps": 2, "progress": "off", "netem": "3g",
                               "results-dir": str(tmp_path / "no-eval")}, num_clients=3)
        without = [json.loads(x)["round_sim_s"] for x in (alone / "metrics.jsonl").read_text().splitlines()][1:]
        # each round a second download of the model (and a small upload) on every client's 3g link
        assert all(a > 1.3 * b for a, b in zip([r["round_sim_s"] for r in lines[1:]], without))


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
