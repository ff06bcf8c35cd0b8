"""A sliding window against full causal attention: ``attnkit.benchmarks.window`` (options: --help)."""
import sys

from attnkit.benchmarks.window import main

sys.exit(main())
