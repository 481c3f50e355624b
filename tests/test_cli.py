import subprocess
import sys
from pathlib import Path

import pytest

from fededge.cli import main
from fededge.deploy.procs import FlwrRun
from fededge.runconfig_text import parse_run_config

ROOT = Path(__file__).resolve().parents[1]
# Issue 15's impossible split, scaled down: 100 clients cannot each get min-partition-size=10
# of 1,600 training samples with Dirichlet alpha 0.5 (though 100 * 10 <= 1,600).
IMPOSSIBLE = 'dataset="synthetic" synthetic-samples=2000 clients-per-round=5 num-rounds=3 model="mlp"'


def test_parse_run_config_like_flwr():
    assert parse_run_config('num-rounds=3 local-lr=0.1 dataset="digits" save-model=false') == {
        "num-rounds": 3, "local-lr": 0.1, "dataset": "digits", "save-model": False,
    }
    assert parse_run_config("dataset=digits") == {"dataset": "digits"}  # bare word: a string
    assert parse_run_config("") == {}


def test_parse_run_config_rejects_garbage():
    with pytest.raises(ValueError, match="could not parse"):
        parse_run_config("num-rounds 3")


def test_run_then_plot(tmp_path, capsys):
    rc = main(["run", "--num-clients", "3", "--run-config",
               f'num-rounds=2 local-steps=3 progress="off" results-dir="{tmp_path}"'])
    assert rc == 0
    run_dir = tmp_path / capsys.readouterr().out.split("results: ")[1].strip().split("/")[-1]
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3
    out = tmp_path / "cmp.png"
    assert main(["plot", str(run_dir), str(run_dir), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_with_bad_key_exits_2_naming_it(capsys):
    assert main(["run", "--run-config", "num-round=2"]) == 2
    assert "unknown run-config key 'num-round'" in capsys.readouterr().err


def _one_config_error_line(text: str) -> str:
    (line,) = text.strip().splitlines()
    assert line.startswith("fededge: configuration error: partition='dirichlet' cannot give each of the 100 ")
    for needle in ("min-partition-size=10", "alpha=0.5", "1600 training samples", "raise alpha"):
        assert needle in line
    return line


def test_run_that_cannot_split_the_data_prints_one_line_and_exits_2(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "fededge.cli", "run", "--num-clients", "100", "--run-config",
         f'{IMPOSSIBLE} results-dir="{tmp_path / "results"}"'],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 2
    assert "Traceback" not in out.stdout + out.stderr
    assert out.stdout == ""
    _one_config_error_line(out.stderr)
    assert not (tmp_path / "results").exists()


def test_simulate_checks_the_split_before_starting_flower(monkeypatch, capsys):
    import fededge.deploy.launch as launch

    def never(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("flwr run was started")

    monkeypatch.setattr(launch, "flwr_run_local", never)
    assert main(["simulate", str(ROOT), "--num-supernodes", "100", "--run-config", IMPOSSIBLE]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "Traceback" not in out.err
    _one_config_error_line(out.err)
    # A bad key is caught there too, before Flower starts.
    assert main(["simulate", str(ROOT), "--run-config", "num-round=2"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("fededge: configuration error: unknown run-config key 'num-round'")


def test_simulate_checks_the_clients_a_round_asks_for_before_starting_flower(monkeypatch, capsys):
    """clients-per-round over --num-supernodes: the ServerApp waited round-timeout (an hour
    by default) for clients that would never come."""
    import fededge.deploy.launch as launch

    monkeypatch.setattr(launch, "flwr_run_local", lambda *a, **k: pytest.fail("flwr run was started"))
    for key in ("clients-per-round", "min-available-nodes"):
        assert main(["simulate", str(ROOT), "--num-supernodes", "2", "--run-config", f"{key}=5"]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line == (f"fededge: configuration error: run-config key '{key}' is 5 but the simulation has only "
                        "2 clients; lower it or raise --num-supernodes")


def test_resume_of_a_simulation_takes_its_supernodes_and_its_floats(tmp_path, monkeypatch, capsys):
    """It resumed on 10 SuperNodes whatever the run had (another data split), and wrote
    its run config with json.dumps (round-timeout=inf came back as the string 'Infinity')."""
    import json

    import fededge.deploy.launch as launch

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "round-000001.ckpt").write_bytes(b"x")
    (run / "config.json").write_text(json.dumps({"runtime": "flower", "flower_nodes": 4, "config": {
        "num-rounds": 3, "round-timeout": float("inf"), "model": "mlp"}}))
    seen = {}

    def fake(app, *, run_config, num_supernodes, **kw):  # noqa: ANN001, ANN003, ANN202
        seen.update(run_config=run_config, nodes=num_supernodes)
        return FlwrRun(0, "", "finished:completed", 1, 1.0, [])

    monkeypatch.setattr(launch, "flwr_run_local", fake)
    assert main(["resume", str(run), str(ROOT)]) == 0
    assert seen["nodes"] == 4 and seen["run_config"]["round-timeout"] == float("inf")
    assert main(["resume", str(run), str(ROOT), "--num-supernodes", "10"]) == 2
    assert "the run had 4 SuperNodes, not 10" in capsys.readouterr().err


def test_simulate_reports_a_config_error_raised_inside_the_simulation(monkeypatch, capsys):
    """The ServerApp checks too (for plain ``flwr run``); then the error comes from
    Flower's run log, whose status details keep the message but not its type."""
    import fededge.deploy.launch as launch

    msg = "a client (node 7) reports: partition='dirichlet' cannot give ..."
    output = ("INFO :      [ROUND 1/3]\nERROR :     Simulation raised an exception\n"
              "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
              f"fededge.errors.ConfigError: {msg}\n")
    failed = FlwrRun(0, output, "finished:failed", 1, 30.0, [],
                            {"status-details": f"Simulation failed with exception: {msg}"})
    monkeypatch.setattr(launch, "flwr_run_local", lambda *a, **k: failed)
    assert main(["simulate", str(ROOT), "--num-supernodes", "2"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"fededge: configuration error: {msg}"
    other = FlwrRun(0, "boom", "finished:failed", 1, 3.0, [],
                           {"status-details": "Simulation failed with exception: boom"})
    assert other.failure() == "run failed: Simulation failed with exception: boom"
    assert FlwrRun(0, "", "finished:completed", 1, 3.0, []).failure() is None


def test_plot_of_missing_dir_exits_2(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nope")]) == 2
    assert "nope" in capsys.readouterr().err


# ------------------------------------------------------------------ fededge testbed (no root needed)


def test_testbed_up_dry_run_prints_the_plan_and_makes_nothing(tmp_path, capsys):
    state = tmp_path / "tb"
    assert main(["testbed", "up", "--clients", "2", "--profiles", "wifi:0.5,4g:0.5", "--shaping", "kernel",
                 "--rate-only", "--state-dir", str(state), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("ip netns add fdg") == 2 and "type bridge" in out and "tbf rate" in out
    assert "partition-id=0 num-partitions=2" in out and "partition-id=1 num-partitions=2" in out
    assert "NOT emulated: up: delay" in out
    assert not state.exists()


@pytest.mark.parametrize("args,needle", [
    (["--clients", "0"], "clients must be an integer >= 1, got 0"),
    (["--clients", "2", "--profiles", "wifi:0.5,nope:0.5"], "nope"),
    (["--clients", "2", "--shaping", "proxy", "--rate-only"], "--rate-only"),
])
def test_testbed_up_bad_input_exits_2_naming_it(tmp_path, capsys, args, needle):
    assert main(["testbed", "up", *args, "--state-dir", str(tmp_path / "tb")]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "tb").exists()


def test_testbed_up_without_root_exits_2_and_says_why(tmp_path, capsys, monkeypatch):
    from fededge.deploy.testbed import host

    monkeypatch.setattr(host.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(host, "_capabilities", lambda: 0)
    assert main(["testbed", "up", "--clients", "2", "--state-dir", str(tmp_path / "tb")]) == 2
    assert "needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN)" in capsys.readouterr().err


def test_testbed_down_run_status_with_nothing_up(tmp_path, capsys):
    state = str(tmp_path / "tb")
    assert main(["testbed", "down", "--state-dir", state]) == 0
    assert main(["testbed", "down", "--state-dir", state]) == 0  # idempotent
    assert capsys.readouterr().out.count("nothing to do") == 2
    assert main(["testbed", "run", "--state-dir", state]) == 2
    assert "no testbed is up" in capsys.readouterr().err
    assert main(["testbed", "status", "--state-dir", state]) == 1


def test_fededge_replay_retimes_a_run_and_names_a_directory_that_is_not_one(tmp_path, capsys):
    """docs/architecture.md listed replay under the CLI, which had none."""
    from fededge.cli import main
    from fededge.server.inprocess import run_inprocess

    run_dir = run_inprocess({"num-rounds": 2, "local-steps": 2, "progress": "off", "netem": "4g",
                             "results-dir": str(tmp_path)}, num_clients=2)
    capsys.readouterr()
    assert main(["replay", str(run_dir), "--netem", "3g", "--target", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "re-timed under netem=3g" in out and "time to accuracy 0.05: 0.00 s as run, 0.00 s replayed" in out
    rows = [line.split() for line in out.splitlines()[2:5]]
    assert [r[0] for r in rows] == ["0", "1", "2"] and float(rows[2][3]) > float(rows[2][2])  # 3g is slower
    assert main(["replay", str(tmp_path)]) == 2
    assert f"is not a run directory (no config.json); the runs in it: {run_dir.name}" in capsys.readouterr().err
