"""fusedops: memory-efficient fused GPU kernels for training large language models."""

from fusedops import _ext
from fusedops.attention import Attention  # fusedops.attention stays the subpackage
from fusedops.linear_ce import LinearCrossEntropyLoss, linear_cross_entropy

_ext.warn_if_missing()

__version__ = "0.1.0"
__all__ = ["linear_cross_entropy", "LinearCrossEntropyLoss", "Attention", "__version__"]
