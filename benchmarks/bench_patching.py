"""Attribution patching against a forward and backward, attnkit and torch: ``attnkit.benchmarks.patching`` (--help)."""
import sys

from attnkit.benchmarks.patching import main

sys.exit(main())
