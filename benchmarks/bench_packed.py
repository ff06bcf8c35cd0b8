"""What keeping a GGUF file's weights packed costs per token and saves in memory: ``attnkit.benchmarks.packed``
(--help)."""
import sys

from attnkit.benchmarks.packed import main

sys.exit(main())
