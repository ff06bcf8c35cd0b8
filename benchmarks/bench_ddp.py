"""Training throughput of the torchrun trainer, 1 and 2 processes: ``attnkit.benchmarks.ddp`` (options: --help)."""
import sys

from attnkit.benchmarks.ddp import main

sys.exit(main())
