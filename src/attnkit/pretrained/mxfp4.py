"""MXFP4 blocks and scales, dequantized: :mod:`attnkit.kernels.mxfp4` (a kernel: the packed weights multiply
with it too), under the loaders' name."""
from ..kernels.mxfp4 import *  # noqa: F401,F403
