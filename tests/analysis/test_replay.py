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
    # compute-ahead: replay re-timed the rounds without the previews the run sent (+28 %)
    {"strategy": "dga", "dga-delay": 2, "dga-compute-ahead": True, "nodes-pull": True, "message-overhead-s": 0.5,
     "sim-step-s": 0.3, "netem": "4g", "num-rounds": 5},
    # DGA waits its round timeout for a client that never answers, as FedAvg's clock charges it
    {"strategy": "dga", "dga-delay": 1, "dropout": 0.34, "round-timeout": 30.0, "sim-step-s": 0.01},
], ids=["nodes-pull", "dropout", "norm-stats-global", "client-evaluation", "client-evaluation-steps",
        "dga-compute-ahead", "dga-dropout"])
def test_replay_reproduces_every_exchange_and_wait_the_run_timed(tmp_path, over):
    """Under its own setting a run replays to its own sim_s: replay left out nodes-pull's
    polls (3x too short), a dropout's timeout, norm-stats=global's second exchange; and
    the run's own clock left out the clients' evaluation (counted in bytes, not in time)."""
    run_dir = run_inprocess({"num-rounds": 3, "local-steps": 2, "progress": "off", "results-dir": str(tmp_path),
                             **over}, num_clients=3)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert replay_sim_s(run_dir) == pytest.approx([r["sim_s"] for r in lines], abs=1e-5)
    if over.get("strategy") == "dga" and "dropout" in over:
        assert all(r["round_sim_s"] >= 30.0 and r["dga_waited_s"] == 30.0 for r in lines[1:])
    if "dga-compute-ahead" in over:
        assert any(r.get("dga_from_preview") for r in lines[1:])  # previews were sent, and replayed as sent
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


def test_a_run_whose_clients_all_dropped_before_the_clock_knew_them_waits_the_timeout(tmp_path):
    """The synchronous clock returned 0 s for a dropout round before any client had been
    placed (every client dropped out): the run recorded 0 s where its server waited."""
    run_dir = run_inprocess({"num-rounds": 3, "local-steps": 2, "progress": "off", "dropout": 0.9,
                             "round-timeout": 5.0, "results-dir": str(tmp_path)}, num_clients=3)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round_sim_s"] for r in lines[1:]] == [5.0, 5.0, 5.0]
    assert all(r["round_timeout"] == 5.0 for r in lines[1:])
    assert replay_sim_s(run_dir) == pytest.approx([r["sim_s"] for r in lines], abs=1e-9)


def test_replay_uses_each_rounds_own_timeout_and_refuses_a_self_timed_strategy_it_does_not_know(tmp_path):
    run_dir = run_inprocess({"num-rounds": 3, "local-steps": 2, "progress": "off", "dropout": 0.34,
                             "round-timeout": 30.0, "sim-step-s": 0.01, "results-dir": str(tmp_path / "a")},
                            num_clients=3)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # as a resumed run with another round-timeout records it: each round its own
    lines[3]["round_timeout"] = 10.0
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    again = replay_sim_s(run_dir)
    assert again[3] - again[2] == pytest.approx(10.0)
    dga = run_inprocess({"num-rounds": 2, "local-steps": 2, "progress": "off", "strategy": "dga", "dga-delay": 1,
                         "results-dir": str(tmp_path / "b")}, num_clients=3)
    config = json.loads((dga / "config.json").read_text())
    config["strategy_class"] = "mypkg.strategies.MyDGA"  # a subclass, a user's own: self-timed, unknown
    (dga / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="times its own rounds, which replay does not know"):
        replay_sim_s(dga)


def test_a_relative_netem_file_is_recorded_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.toml").write_text('[mine]\nsource = "t"\nup = { rate-kbit = 1000, delay-ms = 10 }\n'
                                     'down = { rate-kbit = 1000, delay-ms = 10 }\n[assign]\ndefault = "mine"\n')
    run_dir = run_inprocess({"num-rounds": 1, "local-steps": 2, "progress": "off", "netem": "file",
                             "netem-file": "p.toml", "results-dir": str(tmp_path / "r")}, num_clients=2)
    assert json.loads((run_dir / "config.json").read_text())["clock"]["netem-file"] == str(tmp_path / "p.toml")
    monkeypatch.chdir("/")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert replay_sim_s(run_dir) == pytest.approx([r["sim_s"] for r in lines], abs=1e-6)


def test_dga_lockstep_meters_the_clients_evaluation_with_its_round(tmp_path):
    """Flower's evaluate messages have no group: DGA takes its rounds' traffic by group, so
    the clients' evaluation was never metered (half the downlink missing per round)."""
    over = {"num-rounds": 3, "local-steps": 2, "progress": "off", "fraction-evaluate": 1.0, "netem": "3g"}
    dga = run_inprocess({**over, "strategy": "dga", "dga-delay": 1, "dga-pipeline": "off",
                         "results-dir": str(tmp_path / "dga")}, num_clients=3)
    lines = [json.loads(x) for x in (dga / "metrics.jsonl").read_text().splitlines()]
    for r in lines[1:]:
        assert len(r["clients_evaluate"]) == 3
        evaluation = sum(c["bytes_down"] for c in r["clients_evaluate"])
        assert evaluation > 3 * 300_000  # the model, to each client
        assert r["bytes_down"] == sum(c["bytes_down"] for c in r["clients"]) + evaluation
