"""Top-k sparse (DeepSeek-V3.2) against dense latent attention: ``attnkit.benchmarks.sparse_attention`` (--help)."""
import sys

from attnkit.benchmarks.sparse_attention import main

sys.exit(main())
