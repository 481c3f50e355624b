"""fededge.topology: pure code, never imports Flower (see docs/architecture.md)."""
