"""Tuned against default choices, alternating: ``attnkit.benchmarks.tuning`` (options: --help)."""
import sys

from attnkit.benchmarks.tuning import main

sys.exit(main())
