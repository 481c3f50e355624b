"""fededge: federated edge learning on Flower and PyTorch.

The maths lives in pure subpackages (``compress``, ``topology``, ``netem``, ``data``,
``models``) that never import Flower; ``server`` and ``clients`` are the only Flower
entry points. See docs/architecture.md.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
