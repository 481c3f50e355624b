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
