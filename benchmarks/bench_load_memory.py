"""Resident memory of loading a decoder folder against transformers: ``attnkit.benchmarks.load_memory`` (--help)."""
import sys

from attnkit.benchmarks.load_memory import main

sys.exit(main())
