"""Generation on an idle machine and beside a busy core: ``attnkit.benchmarks.busy_core`` (options: --help)."""
import sys

from attnkit.benchmarks.busy_core import main

sys.exit(main())
