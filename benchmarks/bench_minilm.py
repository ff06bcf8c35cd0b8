"""all-MiniLM-L6-v2 embeddings against sentence-transformers: ``attnkit.benchmarks.minilm`` (options: --help)."""
import sys

from attnkit.benchmarks.minilm import main

sys.exit(main())
