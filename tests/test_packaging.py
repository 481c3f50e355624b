"""What `flwr run` ships: the app bundle (FAB) holds the package source, nothing else."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_fab_holds_only_the_package_source(tmp_path):
    # A stray results directory with JSON inside the project must not travel in the FAB.
    flwr = Path(sys.executable).with_name("flwr")
    env = dict(os.environ, FLWR_HOME=str(tmp_path / "home"), FLWR_TELEMETRY_ENABLED="0")
    subprocess.run([str(flwr), "build", "--app", str(ROOT)], cwd=tmp_path, env=env,
                   check=True, capture_output=True, timeout=120)
    (fab,) = list(tmp_path.glob("*.fab"))
    names = zipfile.ZipFile(fab).namelist()
    assert "pyproject.toml" in names and "fededge/server/app.py" in names and "fededge/clients/app.py" in names
    assert "fededge/netem/profiles.toml" in names  # the built-in link profiles travel too
    others = [n for n in names if not (n.startswith("fededge/") and n.endswith((".py", ".toml")))]
    assert sorted(others) == [".info/CONTENT", "README.md", "pyproject.toml"], others
    # Flower stores a FAB's files uncompressed; the package source is about 1.0 MB (Nov 2026).
    assert fab.stat().st_size < 2_000_000  # Flower caps a FAB at 10 MB
