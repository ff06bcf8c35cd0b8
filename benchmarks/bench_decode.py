"""Decoding and prefill against transformers: ``attnkit.benchmarks.decode`` (options: --help)."""
import sys

from attnkit.benchmarks.decode import main

sys.exit(main())
