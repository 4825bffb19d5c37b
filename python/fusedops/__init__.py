"""fusedops: memory-efficient fused GPU kernels for training large language models."""

from fusedops.linear_ce import LinearCrossEntropyLoss, linear_cross_entropy

__version__ = "0.1.0"
__all__ = ["linear_cross_entropy", "LinearCrossEntropyLoss", "__version__"]
