"""Encoder training-step benchmark against PyTorch: ``attnkit.benchmarks.encoder`` (options: --help)."""
import sys

from attnkit.benchmarks.encoder import main

sys.exit(main())
