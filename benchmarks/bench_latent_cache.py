"""Bytes per token of the latent cache against grouped-query attention: ``attnkit.benchmarks.latent_cache`` (--help)."""
import sys

from attnkit.benchmarks.latent_cache import main

sys.exit(main())
