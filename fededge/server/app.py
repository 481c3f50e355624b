"""fededge's ServerApp: ``serverapp = "fededge.server.app:app"`` in pyproject.toml."""

from __future__ import annotations

from flwr.app import ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from fededge.config import RunConfig
from fededge.keys import SERVER_RESULT_KEY
from fededge.server.runner import run_experiment
from fededge.server.grid import InProcessGrid
from fededge.server.results import new_run_id

__all__ = ["app"]

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Parse the run config (failing before any training on a bad key), then train."""
    cfg = RunConfig.from_mapping(context.run_config)
    runtime = "inprocess" if isinstance(grid, InProcessGrid) else "flower"
    res = run_experiment(grid, cfg, run_id=new_run_id(cfg.run_name, context.run_id), runtime=runtime)
    # Leave the run directory where a caller holding the Context can find it.
    context.state[SERVER_RESULT_KEY] = ConfigRecord({"run-dir": str(res.run_dir.resolve())})
