"""The ServerApp (``fededge.server.app:app``), run orchestration, metering and results."""
