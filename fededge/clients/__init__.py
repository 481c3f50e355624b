"""The ClientApp (``fededge.clients.app:app``), its local training loop and device choice."""
