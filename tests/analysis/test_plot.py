"""Properties of fededge.analysis.plot: reading run directories and drawing comparisons."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fededge
from fededge.analysis.plot import _disambiguate, load_run, plot_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# The subprocess must import this checkout of fededge, installed or not.
REPO_ROOT = Path(fededge.__file__).resolve().parents[1]


def _row(rnd: int, acc: float, up: int, down: int, sim: float, **extra: object) -> dict:
    return {
        "round": rnd,
        "accuracy": acc,
        "loss": 2.3 * (1 - acc),
        "bytes_up": up,
        "bytes_down": down,
        "wall_s": 0.5 * rnd,
        "sim_s": sim,
        "num_clients": 0 if rnd == 0 else 10,
        **extra,
    }


def _write_run(
    root: Path,
    name: str,
    rows: list[dict],
    *,
    config: dict | None = None,
    run_id: str | None = None,
) -> Path:
    run_dir = root / name
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(
        json.dumps({"run_id": run_id or name, "config": config or {}}), encoding="utf-8"
    )
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8"
    )
    (run_dir / "summary.json").write_text("{}", encoding="utf-8")
    return run_dir


FEDAVG_ROWS = [
    _row(0, 0.10, 0, 0, 0.0),
    _row(1, 0.55, 1_000_000, 1_200_000, 2.5, lr=0.05),
    _row(2, 0.80, 1_000_000, 1_200_000, 5.0),
    _row(3, 0.90, 1_000_000, 1_200_000, 7.5),
]
QSGD_ROWS = [
    _row(1, 0.50, 250_000, 1_200_000, 1.0),
    _row(2, 0.75, 260_000, 1_200_000, 2.0),
    _row(3, 0.85, 240_000, 1_200_000, 3.0),
]


@pytest.fixture
def two_runs(tmp_path: Path) -> list[Path]:
    return [
        _write_run(tmp_path, "run-a", FEDAVG_ROWS,
                   config={"strategy": "fedavg", "dataset": "digits"}),
        _write_run(tmp_path, "run-b", QSGD_ROWS,
                   config={"strategy": "qsgd", "dataset": "digits"}),
    ]


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_load_run_reads_columns_and_accumulates_bytes(two_runs: list[Path]) -> None:
    run = load_run(two_runs[0])
    assert run.run_id == "run-a"
    assert run.label == "fedavg/digits"
    assert run.config == {"strategy": "fedavg", "dataset": "digits"}
    np.testing.assert_array_equal(run.rounds, [0, 1, 2, 3])
    np.testing.assert_allclose(run.accuracy, [0.10, 0.55, 0.80, 0.90])
    np.testing.assert_array_equal(run.bytes_up, [0, 1_000_000, 1_000_000, 1_000_000])
    np.testing.assert_array_equal(run.cum_bytes_up, [0, 1_000_000, 2_000_000, 3_000_000])
    np.testing.assert_array_equal(run.cum_bytes_down, [0, 1_200_000, 2_400_000, 3_600_000])
    np.testing.assert_allclose(run.sim_s, [0.0, 2.5, 5.0, 7.5])
    np.testing.assert_array_equal(run.num_clients, [0, 10, 10, 10])
    assert run.rounds.dtype == np.int64 and run.cum_bytes_up.dtype == np.int64

    other = load_run(two_runs[1])
    np.testing.assert_array_equal(other.cum_bytes_up, [250_000, 510_000, 750_000])
    # The running total always ends at the sum of the per-round counts.
    assert other.cum_bytes_up[-1] == sum(r["bytes_up"] for r in QSGD_ROWS)


def test_load_run_handles_huge_byte_counts_exactly(tmp_path: Path) -> None:
    big = 3 * 2**40  # beyond float32 precision; int64 keeps it exact
    rows = [_row(1, 0.5, big, 0, 1.0), _row(2, 0.6, big + 1, 0, 2.0)]
    run_dir = _write_run(tmp_path, "big", rows)
    assert load_run(run_dir).cum_bytes_up[-1] == 2 * big + 1


def test_plot_runs_writes_a_real_png(two_runs: list[Path], tmp_path: Path) -> None:
    out = plot_runs(two_runs, tmp_path / "figs" / "compare.png", title="digits")
    assert out == tmp_path / "figs" / "compare.png"
    width, height = _png_size(out)
    assert width > 2 * height  # three panels side by side
    assert out.stat().st_size > 20_000


def test_plot_runs_accepts_explicit_labels_and_single_run(
    two_runs: list[Path], tmp_path: Path
) -> None:
    out = plot_runs(two_runs[:1], tmp_path / "one.png", labels=["_baseline"])
    _png_size(out)
    with pytest.raises(ValueError, match="one entry per run directory"):
        plot_runs(two_runs, tmp_path / "x.png", labels=["only one"])
    with pytest.raises(ValueError, match="at least one run directory"):
        plot_runs([], tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"e\.g\. \[run_dir\]"):
        plot_runs(two_runs[0], tmp_path / "x.png")  # type: ignore[arg-type]


def test_plot_runs_never_imports_pyplot(two_runs: list[Path], tmp_path: Path) -> None:
    # pyplot would pick (and could switch) the user's backend and keep global figures.
    code = (
        "import sys; from fededge.analysis.plot import plot_runs; "
        f"plot_runs({[str(d) for d in two_runs]!r}, {str(tmp_path / 'c.png')!r}); "
        "sys.exit('matplotlib.pyplot' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=False)
    assert result.returncode == 0
    _png_size(tmp_path / "c.png")


def test_default_labels_tell_apart_runs_of_the_same_strategy(tmp_path: Path) -> None:
    base = {"strategy": "fedavg", "dataset": "digits", "seed": 0}
    dirs = [
        _write_run(tmp_path, "a", QSGD_ROWS, config={**base, "local-steps": 5}),
        _write_run(tmp_path, "b", QSGD_ROWS, config={**base, "local-steps": 20}),
        _write_run(tmp_path, "c", QSGD_ROWS, config={"strategy": "gossip", "dataset": "digits"}),
        _write_run(tmp_path, "d", QSGD_ROWS, config={}, run_id="r-d"),
    ]
    labels = _disambiguate([load_run(d) for d in dirs])
    assert labels == [
        "fedavg/digits (local-steps=5)",
        "fedavg/digits (local-steps=20)",
        "gossip/digits",
        "r-d",
    ]
    # Identical configs fall back to the directory name; the same directory twice to #n.
    same = [_write_run(tmp_path, n, QSGD_ROWS, config=base) for n in ("s1", "s2")]
    runs = [load_run(p) for p in (*same, same[0])]
    assert _disambiguate(runs) == [
        "fedavg/digits (s1) #1",
        "fedavg/digits (s2)",
        "fedavg/digits (s1) #2",
    ]
    assert len(set(_disambiguate(runs))) == len(runs)


def test_missing_config_json_labels_by_directory(tmp_path: Path) -> None:
    run_dir = _write_run(tmp_path, "orphan", QSGD_ROWS)
    (run_dir / "config.json").unlink()
    run = load_run(run_dir)
    assert run.label == "orphan" and run.run_id is None and run.config == {}


def test_missing_run_dir_and_metrics_raise_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_run(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load_run(tmp_path / "file")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        load_run(tmp_path / "empty_dir")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        plot_runs([tmp_path / "nope"], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_empty_metrics_raise_value_error(tmp_path: Path) -> None:
    run_dir = _write_run(tmp_path, "empty", [])
    (run_dir / "metrics.jsonl").write_text("\n  \n", encoding="utf-8")
    with pytest.raises(ValueError, match="is empty"):
        load_run(run_dir)


def _run_with_lines(tmp_path: Path, lines: list[str]) -> Path:
    run_dir = _write_run(tmp_path, "bad", [])
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return run_dir


@pytest.mark.parametrize(
    ("bad_line", "needle"),
    [
        ('{"round": 3, "accuracy": 0.9,', "malformed JSON"),
        ("[1, 2, 3]", "expected a JSON object, got list"),
        (json.dumps({k: v for k, v in _row(3, 0.9, 1, 1, 3.0).items() if k != "sim_s"}),
         "missing key(s) 'sim_s'"),
        (json.dumps(_row(3, 90.0, 1, 1, 3.0)), "'accuracy' must be a fraction in [0, 1]"),
        (json.dumps(_row(3, 0.9, -5, 1, 3.0)), "'bytes_up' must be a non-negative integer"),
        (json.dumps(_row(3, 0.9, 1.5, 1, 3.0)), "'bytes_up' must be a non-negative integer"),
        (json.dumps(_row(3, 0.9, 1, 1, "3s")), "'sim_s' must be a number of seconds"),
        (json.dumps({**_row(3, 0.9, 1, 1, 3.0), "loss": None}), "'loss' must be a number"),
        (json.dumps({**_row(3, 0.9, 1, 1, 3.0), "accuracy": None}), "'accuracy' must be a fraction"),
        (json.dumps(_row(2, 0.9, 1, 1, 3.0)), "round 2 does not follow round 2 (line 3)"),
    ],
)
def test_bad_line_error_names_file_and_line_number(
    tmp_path: Path, bad_line: str, needle: str
) -> None:
    good = [json.dumps(r) for r in FEDAVG_ROWS[:3]]
    run_dir = _run_with_lines(tmp_path, [*good, bad_line, json.dumps(FEDAVG_ROWS[3])])
    with pytest.raises(ValueError) as excinfo:
        load_run(run_dir)
    message = str(excinfo.value)
    assert "metrics.jsonl, line 4" in message
    assert needle in message


def test_a_last_line_cut_short_by_a_kill_is_left_out_with_a_warning(tmp_path: Path, caplog) -> None:
    """fededge resume drops such a line, fededge plot refused the whole run."""
    good = [json.dumps(r) for r in FEDAVG_ROWS[:3]]
    run_dir = _run_with_lines(tmp_path, good)
    with (run_dir / "metrics.jsonl").open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(FEDAVG_ROWS[3])[:20])  # no newline: the write was cut
    run = load_run(run_dir)
    assert len(run.rounds) == 3 and "an unfinished last line" in caplog.text


def test_blank_lines_extra_keys_and_nan_accuracy_are_accepted(tmp_path: Path) -> None:
    lines = [
        json.dumps(_row(1, 0.5, 10, 0, 1.0, note="x")),
        "",
        json.dumps({**_row(2, 0.5, 10, 0, 2.0), "accuracy": float("nan")}),
    ]
    run = load_run(_run_with_lines(tmp_path, lines))
    np.testing.assert_array_equal(run.rounds, [1, 2])
    assert np.isnan(run.accuracy[1])
    # A byte count written as a float with an integral value is still exact.
    run_dir = _run_with_lines(tmp_path / "f", [json.dumps(_row(1, 0.5, 1024.0, 0, 1.0))])
    assert load_run(run_dir).cum_bytes_up.tolist() == [1024]


def test_malformed_config_json_names_the_file(two_runs: list[Path]) -> None:
    (two_runs[0] / "config.json").write_text('{"run_id": ', encoding="utf-8")
    with pytest.raises(ValueError, match=r"config\.json: malformed JSON"):
        load_run(two_runs[0])
    (two_runs[1] / "config.json").write_text('{"config": [1]}', encoding="utf-8")
    with pytest.raises(ValueError, match="'config' must be a JSON object"):
        load_run(two_runs[1])


def test_all_zero_bytes_still_plots(tmp_path: Path) -> None:
    run_dir = _write_run(tmp_path, "z", [_row(0, 0.1, 0, 0, 0.0), _row(1, 0.2, 0, 0, 1.0)])
    _png_size(plot_runs([run_dir], tmp_path / "z.png"))
