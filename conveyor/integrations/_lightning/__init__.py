"""The Lightning strategy's package-free core: nothing here imports ``lightning`` or
``pytorch_lightning``.

:mod:`conveyor.integrations.lightning` and :mod:`conveyor.integrations.pytorch_lightning`
each define ``PipelineStrategy`` on their own package's ``ParallelStrategy`` with
:class:`~conveyor.integrations._lightning.strategy.StrategyBody`, handing it that package's
pieces as a :class:`~conveyor.integrations._lightning.package.Package`.

- :mod:`.options`: the strategy's keywords, sorted into ``conveyor.init``'s and
  ``Pipeline``'s;
- :mod:`.processes`: the process group, the data's replicas, the precision;
- :mod:`.building`: the pipeline, built once from the LightningModule's network and loss;
- :mod:`.steps`: the step interceptor that turns ``self.loss_fn(self.model(x), y)`` into a
  pipeline step;
- :mod:`.checkpoints`: checkpoint directories (conveyor's checkpoint and Lightning's state);
- :mod:`.saving`: the strategy's checkpoint methods and the weights it hands back after
  fitting;
- :mod:`.package`: what the body uses of one Lightning package;
- :mod:`.strategy`: Lightning's strategy methods over these.
"""
