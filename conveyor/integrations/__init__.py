"""Adapters that run other libraries' training loops through conveyor pipelines.

``conveyor.integrations.transformers.PipelineTrainer`` is a ``transformers.Trainer`` that
trains through a pipeline (``pip install 'conveyor[hf]'``). Import the submodule you need;
this package imports none of them.
"""
