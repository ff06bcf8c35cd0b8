"""Attention kernels against naive NumPy and PyTorch: ``attnkit.benchmarks.attention`` (options: --help)."""
import sys

from attnkit.benchmarks.attention import main

sys.exit(main())
