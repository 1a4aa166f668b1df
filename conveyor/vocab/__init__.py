"""Vocabulary parallelism: the input embedding and the output layer split by vocabulary
rows over every pipeline rank (``Pipeline(vocab_parallel=...)``, docs/guide/vocab.md)."""
