"""The demos behind ``attnkit demo``: one module per task, with the synthetic data each trains on.

- :mod:`attnkit.demos.tasks`: the digit-sequence tagging tasks (sort, reverse, ...), as batches.
- :mod:`attnkit.demos.encoder`: train a :class:`~attnkit.models.TokenTagger` encoder on one of them.
- :mod:`attnkit.demos.addition`: a decoder-only :class:`~attnkit.models.CausalLM` learns to add numbers.
- :mod:`attnkit.demos.date_data`: human-written dates and their ISO forms.
- :mod:`attnkit.demos.dates`: a :class:`~attnkit.models.Seq2SeqTransformer` learns to rewrite them.
"""
