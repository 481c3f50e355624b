"""fededge.analysis: tools over finished runs, apart from the ServerApp that writes them.

- :mod:`~fededge.analysis.plot`: ``fededge plot``, runs compared by round, ``sim_s`` and
  uplink bytes (matplotlib, imported by that module only);
- :mod:`~fededge.analysis.replay`: re-time a finished run under another network, without
  training again.

Both read a run directory (``config.json``, ``metrics.jsonl``, ``summary.json``) and never
import Flower (see docs/architecture.md).
"""
