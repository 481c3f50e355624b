import pytest

from fededge.cli import main, parse_run_config


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
    from fededge.deploy import testbed

    monkeypatch.setattr(testbed.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(testbed, "_capabilities", lambda: 0)
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
