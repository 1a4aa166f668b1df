"""Which modules are a model's vocabulary layers, and whether conveyor can split them.

:func:`find_vocab_layers` reads ``Pipeline(vocab_parallel=...)``: ``True`` finds a
transformers model's input and output embeddings, or another model's first
``nn.Embedding`` and its last bias-free ``nn.Linear`` onto the vocabulary; a module name
or a pair of names says which. Anything conveyor cannot split exactly is refused in one
sentence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from conveyor.errors import ConfigError

VocabSpec = bool | str | Sequence[str]
"""``Pipeline(vocab_parallel=...)``: False, True, a module name, or (input, output) names."""

# transformers configs whose logits are changed after the output layer (soft-capped or
# scaled): the loss computed from the shards would not be the model's.
_LOGIT_CHANGES = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_mult")


@dataclass(frozen=True)
class VocabLayers:
    """The vocabulary layers of a model, by module name.

    Attributes:
        input: The input embedding (an ``nn.Embedding``).
        output: The output layer (a bias-free ``nn.Linear`` onto the vocabulary).
        tied: Whether the two share their weight.
        transformers: A transformers model: its stage 0 takes ``inputs_embeds`` and its
            own loss is read as token cross-entropy (``loss_fn=None``).
        rows: The vocabulary size (the weights' rows).
        hidden: The hidden size (the weights' columns).
    """

    input: str
    output: str
    tied: bool
    transformers: bool
    rows: int
    hidden: int


def is_transformers(model: Any) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` with both embeddings."""
    return all(
        hasattr(model, a) for a in ("config", "get_input_embeddings", "get_output_embeddings")
    ) and type(model).__module__.startswith("transformers.")


def find_vocab_layers(model: nn.Module, spec: VocabSpec) -> VocabLayers:
    """The vocabulary layers ``spec`` names in ``model`` (see the module doc).

    Raises:
        ConfigError: a name that is not a module of the model, a layer that is not a
            plain embedding / bias-free linear, sizes that do not match, or a transformers
            model whose logits are changed after its output layer.
    """
    names = {id(m): n for n, m in model.named_modules()}
    hf = is_transformers(model)
    if isinstance(spec, str):
        given: list[str | None] = [spec]
    elif not isinstance(spec, bool):
        given = list(spec)
        if len(given) != 2 or not all(isinstance(n, str) for n in given):
            raise ConfigError(
                f"vocab_parallel={spec!r}: give True, one module name, or a pair (input "
                f"embedding, output layer) of module names"
            )
    else:
        given = []
    modules = dict(model.named_modules())
    for name in given:
        if name not in modules:
            raise ConfigError(
                f"vocab_parallel names {name!r}, which is not a module of the model; use "
                f"names as model.named_modules() gives them"
            )
    inp = out = None
    if len(given) == 2:
        inp, out = given
    elif len(given) == 1:
        assert given[0] is not None
        if isinstance(modules[given[0]], nn.Embedding):
            inp = given[0]
        else:
            out = given[0]
    if hf:
        emb = model.get_input_embeddings()  # type: ignore[operator]
        head = model.get_output_embeddings()  # type: ignore[operator]
        inp = inp or names.get(id(emb))
        out = out or (names.get(id(head)) if head is not None else None)
    if inp is None:
        # The embedding of the output layer's rows (a position embedding may come first).
        sizes = {m.num_embeddings for m in modules.values() if isinstance(m, nn.Embedding)}
        out = out or _last_output(modules, sizes)
        rows = _linear_rows(modules[out]) if out is not None else None
        inp = next(
            (n for n, m in modules.items()
             if isinstance(m, nn.Embedding) and rows in (None, m.num_embeddings)),
            None,
        )  # fmt: skip
    if inp is None:
        raise ConfigError(
            "vocab_parallel=True found no nn.Embedding in the model; name the vocabulary "
            "layers: vocab_parallel=('embedding.name', 'output.name')"
        )
    emb = modules[inp]
    _check_embedding(inp, emb)
    rows = emb.num_embeddings
    if out is None:
        out = _last_output(modules, {rows})
    if out is None:
        raise ConfigError(
            f"vocab_parallel=True found no bias-free nn.Linear with {rows} outputs (the "
            f"vocabulary of model.{inp}); name the output layer: vocab_parallel=("
            f"'{inp}', 'output.name')"
        )
    head = modules[out]
    _check_output(out, head, rows, emb.embedding_dim)
    if hf:
        config = model.config
        for key in _LOGIT_CHANGES:
            value = getattr(config, key, None)
            if value not in (None, 1, 1.0):
                raise ConfigError(
                    f"vocab_parallel: this model's config has {key}={value!r}, which changes "
                    f"the logits after {out}; the loss from vocabulary shards would not be "
                    f"the model's: train it without vocab_parallel"
                )
    tied = emb.weight is head.weight
    return VocabLayers(inp, out, tied, hf, rows, emb.embedding_dim)


def _linear_rows(module: nn.Module) -> int | None:
    return module.out_features if isinstance(module, nn.Linear) else None


def _last_output(modules: dict[str, nn.Module], rows: set[int]) -> str | None:
    """The last bias-free ``nn.Linear`` whose outputs are one of ``rows``."""
    for name, m in reversed(list(modules.items())):
        if isinstance(m, nn.Linear) and m.bias is None and m.out_features in rows:
            return name
    return None


def _check_embedding(name: str, module: nn.Module) -> None:
    if not isinstance(module, nn.Embedding) or type(module).forward is not nn.Embedding.forward:
        raise ConfigError(
            f"vocab_parallel: model.{name} ({type(module).__name__}) is not a plain "
            f"nn.Embedding; name the input embedding, whose forward must be nn.Embedding's, "
            f"or train without vocab_parallel"
        )
    bad = [
        k for k, v in (("max_norm", module.max_norm), ("sparse", module.sparse),
                       ("scale_grad_by_freq", module.scale_grad_by_freq)) if v
    ]  # fmt: skip
    if bad:
        raise ConfigError(
            f"vocab_parallel: model.{name} uses {bad[0]}, which a split embedding cannot "
            f"reproduce; build the embedding without it or train without vocab_parallel"
        )


def _check_output(name: str, module: nn.Module, rows: int, hidden: int) -> None:
    if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
        raise ConfigError(
            f"vocab_parallel: model.{name} ({type(module).__name__}) is not a plain "
            f"nn.Linear; name the output layer, a bias-free nn.Linear onto the vocabulary"
        )
    if module.bias is not None:
        raise ConfigError(
            f"vocab_parallel: model.{name} has a bias; the output layer must be bias-free "
            f"(bias=False), as in language models"
        )
    if (module.out_features, module.in_features) != (rows, hidden):
        raise ConfigError(
            f"vocab_parallel: model.{name} maps {module.in_features} -> {module.out_features}"
            f" but the embedding has {rows} rows of {hidden}; name matching layers"
        )
