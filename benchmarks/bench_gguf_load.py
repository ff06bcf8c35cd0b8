"""GGUF load time against the same model's folder: ``attnkit.benchmarks.gguf_load`` (options: --help)."""
import sys

from attnkit.benchmarks.gguf_load import main

sys.exit(main())
