"""Metric sinks (issue 39): what TensorBoard, MLflow and W&B store, read back with their own
readers (a real TensorBoard server for TensorBoard), equals metrics.jsonl, for a resumed
run too, with no step twice; a missing tool stops the run before round 1 naming its
extra; a sink that fails never stops the run."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from fededge.config import ConfigError, RunConfig
from fededge.server.inprocess import run_inprocess
from fededge.server.results import RunRecorder
from fededge.tracking import MetricSink, MissingExtraError, Sinks, check_installed, numeric_items, parse_log_to

BASE = {"num-rounds": 5, "local-steps": 2, "model": "mlp", "progress": "off", "checkpoint-every": 2,
        "sim-step-s": 0.01, "netem": "4g"}
NODES = 3


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _tensorboard(log_dir: Path, expected: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    """Every scalar as a real TensorBoard server shows it (started here on a free port,
    with its default data server, and stopped), once it has loaded as many points as
    ``expected`` has."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.parse
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(log_dir), "--host",
                               "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/data/plugin/scalars/"
    got: dict[str, list[tuple[int, float]]] = {}
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                tags = json.loads(urllib.request.urlopen(url + "tags", timeout=5).read()).get(".", {})
                got = {}
                for tag in tags:
                    query = urllib.parse.urlencode({"run": ".", "tag": tag})
                    points = json.loads(urllib.request.urlopen(f"{url}scalars?{query}", timeout=5).read())
                    got[tag] = [(step, value) for _, step, value in points]
                if set(got) == set(expected) and all(len(got[k]) == len(v) for k, v in expected.items()):
                    break
            except OSError:
                pass
            time.sleep(0.5)
    finally:
        server.terminate()
        server.wait(20)
    return got


def _float32(series: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard keeps of each value: float32."""
    return {k: [(s, float(np.float32(v))) for s, v in pts] for k, pts in series.items()}


def _mlflow(run_dir: Path) -> tuple[object, dict[str, list[tuple[int, float]]]]:
    from mlflow.tracking import MlflowClient

    state = json.loads((run_dir / "mlflow.json").read_text())
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    run = client.get_run(state["run_id"])
    return run, {key: sorted((m.step, m.value) for m in client.get_metric_history(state["run_id"], key))
                 for key in run.data.metrics}


def _wandb(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The history W&B wrote offline (every offline run dir of the run, in order), read from
    its .wandb files: LevelDB-log framing (W&B's 7-byte header, 32 KiB blocks) around W&B's
    own protobuf records."""
    import struct

    from wandb.proto import wandb_internal_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        data, pos, pending = path.read_bytes(), 7, b""
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            if (pos % 32768) + 7 > 32768:  # a block's tail too short for a header: padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if kind == 0 and length == 0:
                pos += 32768 - pos % 32768
                continue
            pending += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # FULL or LAST
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                pending = b""
                if record.WhichOneof("record_type") == "history":
                    for item in record.history.item:
                        key = item.key or "/".join(item.nested_key)
                        if not key.startswith("_"):
                            out.setdefault(key, []).append((record.history.step.num, json.loads(item.value_json)))
    return out


def _expected(lines: list[dict]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for line in lines:
        for key, value in numeric_items(line).items():
            out.setdefault(key, []).append((line["round"], value))
    return out


def test_log_to_names_are_checked_and_a_missing_tool_names_its_extra(monkeypatch):
    assert parse_log_to(" TensorBoard,mlflow,tensorboard ") == ("tensorboard", "mlflow")
    with pytest.raises(ConfigError, match="log-to.*tensorbord.*tensorboard, mlflow, wandb"):
        RunConfig.from_mapping({"log-to": "tensorbord"})
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(MissingExtraError, match=r"pip install 'fededge\[mlflow\]'"):
        check_installed(["tensorboard", "mlflow"])
    # Under fededge's app the run stops before round 1 (a ConfigError: one line, no traceback).
    with pytest.raises(ConfigError, match=r"fededge\[mlflow\]"):
        from fededge.api import Experiment

        Experiment(evaluate_fn=lambda rnd, arrays: None, log_to="mlflow")


class _Recording(MetricSink):
    name = "recording"

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at, self.rounds, self.closed = fail_at, [], None

    def open(self, run_dir, run_id, config, *, resume_after=None, kept=()):
        self.opened = (run_id, dict(config), resume_after, [k["round"] for k in kept])

    def log_round(self, line):
        if line["round"] == self.fail_at:
            raise ConnectionError("tracking server gone")
        self.rounds.append(line["round"])

    def close(self, summary, *, status, artifacts=()):
        self.closed = (status, [Path(a).name for a in artifacts])


def test_a_failing_sink_is_dropped_once_and_the_run_goes_on(tmp_path, caplog):
    good, bad = _Recording(), _Recording(fail_at=1)
    rec = RunRecorder(tmp_path, "r", {"k": 1}, target_accuracy=0.9, sinks=Sinks([bad, good]))
    with caplog.at_level(logging.WARNING, logger="fededge"):
        for rnd in range(4):
            rec.record_round(rnd, accuracy=0.5, loss=1.0, bytes_up=10, bytes_down=10, round_sim_s=1.0,
                             num_clients=2)
        rec.close()
    assert good.rounds == [0, 1, 2, 3] and bad.rounds == [0]
    assert [r.getMessage() for r in caplog.records].count(
        "metric sink recording failed in log_round (ConnectionError: tracking server gone); it is dropped for "
        "the rest of the run, metrics.jsonl has every round") == 1
    assert [x["round"] for x in _lines(rec.run_dir)] == [0, 1, 2, 3]
    assert good.closed == ("completed", ["summary.json", "config.json", "metrics.jsonl"])
    with pytest.raises(TypeError, match="not a metric sink"):
        Sinks([object()])


def test_tensorboard_mlflow_and_wandb_hold_metrics_jsonl_and_a_resumed_run_logs_no_step_twice(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    run = {**BASE, "log-to": "tensorboard,mlflow,wandb", "results-dir": str(tmp_path)}
    run_dir = run_inprocess(run, num_clients=NODES)
    first = _lines(run_dir)
    assert [x["round"] for x in first] == list(range(BASE["num-rounds"] + 1))
    assert _tensorboard(run_dir / "tensorboard", _expected(first)) == _float32(_expected(first))
    mlrun, stored = _mlflow(run_dir)
    assert {k: v for k, v in stored.items() if not k.startswith("summary.")} == _expected(first)
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == run_dir.name
    assert mlrun.data.params["local-steps"] == "2" and mlrun.data.params["strategy"] == "fedavg"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert stored["summary.final_accuracy"] == [(BASE["num-rounds"], summary["final_accuracy"])]
    assert (run_dir / "plot.png").exists()
    assert _wandb(run_dir) == _expected(first)

    # Resume from the newest checkpoint (round 4) and go on to round 7: round 5, logged
    # before, is redone; every sink shows it once.
    run_inprocess({**run, "num-rounds": 7, "resume-from": str(run_dir)}, num_clients=NODES)
    after = _lines(run_dir)
    assert [x["round"] for x in after] == list(range(8))
    # restarts purged: exactly the file, to float32
    assert _tensorboard(run_dir / "tensorboard", _expected(after)) == _float32(_expected(after))
    _, stored = _mlflow(run_dir)
    stored = {k: v for k, v in stored.items() if not k.startswith("summary.")}
    assert all(len({s for s, _ in points}) == len(points) for points in stored.values())  # no step twice
    redone = {k: [(s, v) for s, v in pts if s != 5] if k == "wall_s" else pts for k, pts in _expected(after).items()}
    assert {k: [(s, v) for s, v in pts if s != 5] if k == "wall_s" else pts for k, pts in stored.items()} == redone
    assert stored["accuracy"][5] == (5, after[5]["accuracy"])  # the run is deterministic: the same round 5
    history = _wandb(run_dir)
    assert {k: [(s, v) for s, v in pts if s != 5] if k == "wall_s" else pts for k, pts in history.items()} == redone


def test_a_sink_added_on_resume_gets_the_rounds_before_the_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    run = {**BASE, "results-dir": str(tmp_path)}
    run_dir = run_inprocess(run, num_clients=NODES)
    assert not (run_dir / "tensorboard").exists()
    run_inprocess({**run, "num-rounds": 6, "log-to": "tensorboard", "resume-from": str(run_dir)}, num_clients=NODES)
    expected = _expected(_lines(run_dir))
    assert _tensorboard(run_dir / "tensorboard", expected) == _float32(expected)


def test_wandb_mode_disabled_drops_the_wandb_sink_and_dryrun_is_offline(monkeypatch, caplog):
    """WANDB_MODE=disabled (W&B's own switch, common in CI) raised a ValueError that
    stopped the run; dryrun is W&B's older name for offline."""
    from fededge.tracking import make_sinks
    from fededge.tracking.wandb_sink import WandbSink

    monkeypatch.setenv("WANDB_MODE", "disabled")
    with caplog.at_level(logging.WARNING, logger="fededge.tracking"):
        assert make_sinks(["wandb"]) == []
    assert "WANDB_MODE=disabled: this run logs nothing to W&B" in caplog.text
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    assert WandbSink().mode == "offline"
    monkeypatch.setenv("WANDB_MODE", "sideways")
    with pytest.raises(ValueError, match="mode must be one of offline, online, got 'sideways'"):
        WandbSink()
