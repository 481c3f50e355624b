"""fededge.data: offline data sets and federated partitioners; never imports Flower.

``load_dataset`` returns normalised train/test tensors for scikit-learn's digits, a
seeded synthetic problem, or MNIST / CIFAR-10 files already on disk. ``partition``
splits label arrays across clients (IID, Dirichlet, shards); ``label_skew`` measures how
non-IID the result is. See docs/data.md.
"""

from .datasets import DATASETS, Dataset, ForbiddenGlobalError, load_dataset
from .partition import PARTITIONS, PartitionError, label_distribution, label_skew, partition

__all__ = [
    "DATASETS",
    "PARTITIONS",
    "Dataset",
    "PartitionError",
    "ForbiddenGlobalError",
    "label_distribution",
    "label_skew",
    "load_dataset",
    "partition",
]
