"""attnkit's benchmarks, inside the package so that ``attnkit bench`` works from an installed wheel.

Each module times attnkit against PyTorch (and, for attention, against a naive NumPy version) in the same
run and prints the ratios, after the lines of :func:`attnkit.benchmarks.machine.describe` (CPU, caches,
BLAS and its kernel, threads). PyTorch is optional: without it a benchmark says so in one line.

- :mod:`~attnkit.benchmarks.attention`: the attention kernels (``attnkit bench``,
  ``python -m attnkit.benchmarks.attention``);
- :mod:`~attnkit.benchmarks.encoder`: one training step of a Transformer encoder
  (``python -m attnkit.benchmarks.encoder``);
- :mod:`~attnkit.benchmarks.minilm`: all-MiniLM-L6-v2 sentence embeddings against sentence-transformers
  (``python -m attnkit.benchmarks.minilm``);
- :mod:`~attnkit.benchmarks.patching`: attribution patching against one forward and backward
  (``python -m attnkit.benchmarks.patching``);
- :mod:`~attnkit.benchmarks.naive`: the textbook attention the attention benchmark compares with;
- :mod:`~attnkit.benchmarks.machine`: where a benchmark ran.

Run them with ``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE``: those variables, when set, make a
current OpenBLAS pick slower kernels.
"""
