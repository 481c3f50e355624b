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


def test_rounds_not_evaluated_are_null_and_the_summary_counts_evaluated_rounds_only(tmp_path):
    r = _rec(tmp_path)
    r.record_round(0, accuracy=0.1, loss=2.3, bytes_up=0, bytes_down=0, round_sim_s=0.0, num_clients=0)
    r.record_round(1, accuracy=None, loss=None, bytes_up=100, bytes_down=200, round_sim_s=1.0, num_clients=2)
    r.record_round(2, accuracy=0.9, loss=0.4, bytes_up=100, bytes_down=200, round_sim_s=1.0, num_clients=2)
    r.record_round(3, accuracy=None, loss=None, bytes_up=100, bytes_down=200, round_sim_s=1.0, num_clients=2)
    r.record_round(4, accuracy=0.85, loss=0.5, bytes_up=100, bytes_down=200, round_sim_s=1.0, num_clients=2)
    summ = r.close()
    lines = [json.loads(x) for x in (tmp_path / "run-a" / "metrics.jsonl").read_text().splitlines()]
    assert [x["accuracy"] for x in lines] == [0.1, None, 0.9, None, 0.85]
    assert [x["loss"] for x in lines][1::2] == [None, None]
    assert summ["rounds"] == 4 and summ["final_accuracy"] == 0.85 and summ["final_loss"] == 0.5
    assert summ["best_accuracy"] == 0.9
    assert summ["rounds_to_target"] == 2 and summ["bytes_up_to_target"] == 200


def test_progress_line_of_a_round_not_evaluated(tmp_path):
    import io

    buf = io.StringIO()
    p = Progress("lines", 3, stream=buf)
    r = _rec(tmp_path)
    p.update(r.record_round(1, accuracy=None, loss=None, bytes_up=1, bytes_down=1, round_sim_s=1.0, num_clients=1))
    p.close()
    r.close()
    assert "round    1/3  acc -  loss -" in buf.getvalue()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_evaluate_every_must_be_a_positive_integer(bad):
    from fededge.server.results import ResultsConfig

    with pytest.raises(ValueError, match="evaluate_every"):
        ResultsConfig(evaluate_every=bad)
