"""Data for the trainer: real corpora available offline and a distributed, resumable sampler."""

from dtlab.data.corpus import load_digits_dataset, load_stdlib_corpus, stdlib_lm_dataset
from dtlab.data.dataset import TensorDataset, fetch
from dtlab.data.sampler import DistributedSampler

__all__ = [
    "DistributedSampler",
    "TensorDataset",
    "fetch",
    "load_digits_dataset",
    "load_stdlib_corpus",
    "stdlib_lm_dataset",
]
