"""One decoding step of a Gated DeltaNet layer against softmax attention, 1k to 16k cached tokens:
``attnkit.benchmarks.linear_decode`` (options: --help)."""
import sys

from attnkit.benchmarks.linear_decode import main

sys.exit(main())
