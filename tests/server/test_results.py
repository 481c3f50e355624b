import json

import pytest

from fededge.server.results import METRIC_FIELDS, Progress, RunRecorder, human_bytes


def _rec(tmp_path, **kw):
    return RunRecorder(tmp_path, "run-a", {"num-rounds": 3}, target_accuracy=0.8, **kw)


def test_recorder_writes_rounds_and_summary(tmp_path):
    r = _rec(tmp_path, extra={"device": "cpu"})
    r.record_round(0, accuracy=0.1, loss=2.3, bytes_up=0, bytes_down=0, round_sim_s=0.0, num_clients=0)
    r.record_round(1, accuracy=0.7, loss=1.0, bytes_up=100, bytes_down=200, round_sim_s=1.5, num_clients=2)
    r.record_round(2, accuracy=0.85, loss=0.5, bytes_up=100, bytes_down=200, round_sim_s=2.0, num_clients=2, failures=1)
    r.record_round(3, accuracy=0.82, loss=0.6, bytes_up=100, bytes_down=200, round_sim_s=1.0, num_clients=2)
    summ = r.close()
    lines = [json.loads(x) for x in (tmp_path / "run-a" / "metrics.jsonl").read_text().splitlines()]
    assert all(set(METRIC_FIELDS) <= set(x) for x in lines)
    assert [x["sim_s"] for x in lines] == [0.0, 1.5, 3.5, 4.5]
    assert [x["cum_bytes_up"] for x in lines] == [0, 100, 200, 300]
    assert summ["rounds_to_target"] == 2 and summ["sim_s_to_target"] == 3.5
    assert summ["bytes_up_to_target"] == 200
    assert summ["final_accuracy"] == 0.82 and summ["best_accuracy"] == 0.85
    assert summ["total_bytes_up"] == 300 and summ["total_bytes_down"] == 600
    assert summ["total_failures"] == 1 and summ["status"] == "completed"
    assert json.loads((tmp_path / "run-a" / "summary.json").read_text()) == summ
    cfg = json.loads((tmp_path / "run-a" / "config.json").read_text())
    assert cfg["device"] == "cpu" and cfg["config"] == {"num-rounds": 3}
    assert {"fededge", "flwr", "torch"} <= set(cfg["versions"])


def test_target_never_reached_is_null(tmp_path):
    r = _rec(tmp_path)
    r.record_round(1, accuracy=0.5, loss=1, bytes_up=1, bytes_down=1, round_sim_s=1, num_clients=1)
    s = r.close()
    assert s["rounds_to_target"] is None and s["sim_s_to_target"] is None and s["wall_s_to_target"] is None


def test_a_second_run_with_the_same_id_does_not_overwrite(tmp_path):
    a = _rec(tmp_path)
    b = _rec(tmp_path)
    assert a.run_dir != b.run_dir and b.run_dir.name == "run-a-2"
    a.close()
    b.close()


def test_failed_run_keeps_its_rounds_and_says_why(tmp_path):
    r = _rec(tmp_path)
    r.record_round(1, accuracy=0.5, loss=1, bytes_up=1, bytes_down=1, round_sim_s=1, num_clients=1)
    s = r.close(status="failed", error="RuntimeError: boom")
    assert s["status"] == "failed" and s["error"] == "RuntimeError: boom" and s["rounds"] == 1


def test_progress_lines(tmp_path, capsys):
    import io

    buf = io.StringIO()
    p = Progress("auto", 3, stream=buf)  # not a TTY: one line per round
    r = _rec(tmp_path)
    p.update(r.record_round(1, accuracy=0.5, loss=1.0, bytes_up=1500, bytes_down=3000,
                            round_sim_s=1.0, num_clients=4))
    p.close()
    r.close()
    assert "round    1/3  acc 0.5000" in buf.getvalue() and "up 1.50 kB" in buf.getvalue()


@pytest.mark.parametrize(("n", "text"), [(999, "999 B"), (1500, "1.50 kB"), (2_500_000, "2.50 MB"), (3e9, "3.00 GB")])
def test_human_bytes(n, text):
    assert human_bytes(n) == text


def test_replay_reproduces_the_run_and_retimes_it(tmp_path):
    """Replaying a run under its own network gives its sim_s; under another, other times
    from the same per-client record."""
    import json

    from fededge.server.inprocess import run_inprocess
    from fededge.server.replay import replay_sim_s

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
    import json

    from fededge.server.inprocess import run_inprocess
    from fededge.server.replay import replay_sim_s

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
    import json

    from fededge.server.replay import replay_sim_s

    (tmp_path / "config.json").write_text(json.dumps({"config": {"strategy": "gossip"}}))
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="gossip runs cannot be replayed yet"):
        replay_sim_s(tmp_path)


@pytest.mark.parametrize("cls, match", [("fededge.strategies.fedbuff.FedBuff", "fedbuff runs cannot be replayed"),
                                        ("fededge.strategies.gossip.Gossip", "gossip runs cannot be replayed yet")])
def test_replay_refuses_a_users_async_or_gossip_run_by_its_strategy_class(tmp_path, cls, match):
    """A user's run config names no fededge strategy: the class Experiment recorded does."""
    import json

    from fededge.server.replay import replay_sim_s

    (tmp_path / "config.json").write_text(json.dumps({"config": {"strategy": "mine"}, "strategy_class": cls,
                                                      "clock": {"netem": "4g"}}))
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=match):
        replay_sim_s(tmp_path)
