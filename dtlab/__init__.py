"""dtlab: distributed training strategies for PyTorch on in-memory, MPI, Gloo and NCCL backends."""

__version__ = "0.1.0"
