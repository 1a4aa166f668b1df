"""Adapters that run other libraries' training loops through conveyor pipelines.

``conveyor.integrations.transformers.PipelineTrainer`` is a ``transformers.Trainer`` that
trains through a pipeline (``pip install 'conveyor[hf]'``);
``conveyor.integrations.lightning.PipelineStrategy`` is a Lightning strategy that does
(``pip install 'conveyor[lightning]'``; ``conveyor.integrations.pytorch_lightning`` for the
standalone ``pytorch_lightning`` package). Import the submodule you need; this package
imports none of them.
"""
