"""Capture with ``torch.export`` on a sample batch, for models ``torch.fx`` cannot trace.

Non-strict export runs the model's own Python on fake tensors, so it follows Python
control flow and ``**kwargs`` signatures, and records ATen operations, each with the path
of the module that ran it (``nn_module_stack``): annotations, balance by module and
original parameter names keep working. Every dimension of every input is dynamic where
the code allows (batch, sequence length); a size the code fixes is checked on every later
batch (:func:`conveyor.partition.exported_io.check_inputs`).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from conveyor.errors import ConfigError
from conveyor.partition.captured import Captured, InputLayout, module_path
from conveyor.partition.failure import capture_failure, refusal
from conveyor.partition.kept import Kept, as_module_calls, recorded_as_calls
from conveyor.partition.modes import follow_module_modes


def capture_export(
    model: nn.Module, sample: Any, fx_error: Exception, kept: Kept | None = None
) -> Captured:
    """The model's graph as torch.export records it on ``sample``.

    Export runs in training mode (what dropout and batch norm do then is in the graph,
    and :func:`~conveyor.partition.modes.follow_module_modes` makes them follow the
    modules' mode at run time); the modules' modes are restored afterwards.

    Args:
        model: The model to capture.
        sample: One micro-batch of stage-0 input: a tensor, tuple or dict of tensors.
        fx_error: What stopped fx, for the error message.
        kept: Modules to keep whole besides the expert collections, with their outputs
            (:mod:`conveyor.partition.kept`).

    Returns:
        The exported capture, with its input layout and output structure.

    Raises:
        ConfigError: export failed too, or the model returns a key/value cache.
    """
    with _meta_stand_ins(model):
        return _capture(model, sample, fx_error, kept)


@contextlib.contextmanager
def _meta_stand_ins(model: nn.Module) -> Iterator[None]:
    """The model's meta tensors replaced, while it is captured, by stand-ins of the same
    shapes (the same stand-in for a tensor held under several names).

    export's caches keep weak references to every tensor it traced, past the capture, and
    a tensor with a weak reference cannot become real in place
    (:func:`torch.utils.swap_tensors`): the model's own meta parameters must keep their
    objects when they get their values, so that an optimizer built over them before the
    first step trains them. Stand-ins take the references instead."""
    made: dict[int, torch.Tensor] = {}
    slots: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for module in model.modules():
        stores: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for store in stores:
            for key, value in store.items():
                if value is None or not value.is_meta:
                    continue
                if id(value) not in made:
                    like = torch.empty_like(value)
                    made[id(value)] = (
                        nn.Parameter(like, value.requires_grad)
                        if isinstance(value, nn.Parameter)
                        else like
                    )
                slots.append((store, key, value))
                store[key] = made[id(value)]
    try:
        yield
    finally:
        for store, key, value in slots:
            store[key] = value


def _capture(model: nn.Module, sample: Any, fx_error: Exception, kept: Kept | None) -> Captured:
    """:func:`capture_export` on ``model`` as it is."""
    from torch.export import Dim, ShapesCollection

    args, kwargs = _call_arguments(_at_least_two(sample))
    on_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    traced_args, traced_kwargs = _where_parameters_are(on_meta, args, kwargs)
    dynamic: Any = ShapesCollection()  # type: ignore[no-untyped-call]
    for leaf in pytree.tree_leaves((traced_args, traced_kwargs)):
        if isinstance(leaf, torch.Tensor):
            dynamic[leaf] = {i: Dim.AUTO for i in range(leaf.dim())}
    modes = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        with _quiet(), _named(model, kwargs), recorded_as_calls(model, kept or {}) as whole:
            try:
                program = torch.export.export(
                    model, traced_args, traced_kwargs, dynamic_shapes=dynamic, strict=False
                )
            except AssertionError:
                # torch 2.13 cannot map dynamic shapes onto extra ``**kwargs``: fix every size.
                program = torch.export.export(model, traced_args, traced_kwargs, strict=False)
    except Exception as export_error:
        config = getattr(model, "config", None)
        if getattr(config, "use_cache", False) and "Cache" in str(export_error):
            raise ConfigError(
                f"{type(model).__name__} returns a key/value cache (its config.use_cache is "
                f"True), which training does not need and which cannot be sent between "
                f"stages; set model.config.use_cache = False for training"
            ) from export_error
        refused = refusal(export_error)
        if refused is not None:
            raise refused from None
        raise ConfigError(capture_failure(model, export_error, fx_error)) from export_error
    finally:
        for module, training in modes:
            module.training = training
    gm = program.module()
    graph = gm.graph
    as_module_calls(graph, whole)  # expert collections and tp modules run as modules
    guards = getattr(gm, "_guards_fn", None)
    for body in _bodies(gm):
        if on_meta:
            _devices_of_inputs(body.graph, args, kwargs)
        for node in list(body.graph.nodes):  # stage 0 checks the guards itself (check_inputs)
            guard = node.op == "call_module" and node.target == "_guards_fn"
            # export's checks of the dtypes it saw: under autocast the stages see others
            if guard or node.target is torch.ops.aten._assert_tensor_metadata.default:
                body.graph.erase_node(node)
        if body is not gm:
            body.recompile()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    fixed = tuple(_fixed_sizes(n.meta.get("val")) for n in placeholders)
    layout = InputLayout(
        program.call_spec.in_spec, fixed, tuple(str(n.target) for n in placeholders), guards
    )
    _known_paths(graph, model)
    follow_module_modes(gm, model)
    _name_reads_by_user(graph, model, gm)
    return Captured(
        graph,
        gm,
        {},
        exported=True,
        inputs=layout,
        output_spec=program.call_spec.out_spec,
    )


@contextlib.contextmanager
def _named(model: nn.Module, kwargs: dict[str, Any]) -> Iterator[None]:
    """While exporting: a ``forward`` that names every keyword of the sample, where the
    model's takes some through ``**kwargs`` (a transformers model given ``shift_labels`` or
    conveyor's context-parallel keywords). torch.export cannot make the sizes of a
    ``**kwargs`` tensor dynamic; of a named keyword it can. The instance attribute calls
    the model's own ``forward`` and is removed afterwards."""
    import inspect

    signature = inspect.signature(model.forward)
    params = signature.parameters
    spread = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if not spread or all(k in params for k in kwargs):
        yield
        return
    own = model.forward

    def forward(*args: Any, **given: Any) -> Any:
        return own(*args, **given)

    named = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None) for k in kwargs]
    forward.__signature__ = inspect.Signature(named)  # type: ignore[attr-defined]
    model.forward = forward
    try:
        yield
    finally:
        del model.forward


def _where_parameters_are(on_meta: bool, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """The sample export runs a model on: on the meta device when the model's parameters
    are (``conveyor.empty_weights``), else as given.

    torch 2.10-2.12 cannot export an embedding of meta weights looked up with real token
    ids ("Unhandled FakeTensor Device Propagation for aten.embedding"); from 2.13 mixing
    the two works. Export records only shapes and dtypes of the sample, and
    :func:`_devices_of_inputs` writes the real inputs' device back into the graph."""
    if not on_meta:
        return args, kwargs

    def meta(x: Any) -> Any:
        return x.to("meta") if isinstance(x, torch.Tensor) else x

    return pytree.tree_map(meta, args), pytree.tree_map(meta, kwargs)


def _bodies(gm: fx.GraphModule) -> Iterator[fx.GraphModule]:
    """``gm`` and, depth first, the bodies of its higher-order operations (the graph
    modules its ``get_attr`` nodes read): every graph a rewrite of the capture must reach.

    transformers 5.0-5.23 decorate the rotary embedding's ``forward`` with
    ``torch.no_grad()``; export records that region as a ``wrap_with_set_grad_enabled``
    call whose body is a submodule, with its own ``meta`` devices and metadata checks.
    From 5.24 the region is inline in the top graph."""
    yield gm
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            body = getattr(gm, str(node.target), None)
            if isinstance(body, fx.GraphModule):
                yield from _bodies(body)


def _devices_of_inputs(graph: fx.Graph, args: Any, kwargs: Any) -> None:
    """A model with meta parameters (``conveyor.empty_weights``) is recorded running on
    the meta device, and export writes that device into the graph (``x.to(h.device)``,
    its metadata checks). The stages run where the inputs are, as for a real model:
    each ``meta`` the graph names becomes the inputs' device."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    # (a vocabulary-parallel sample's inputs_embeds are meta too: the others say where)
    device = next((t.device for t in tensors if not t.is_meta), torch.device("cpu"))

    def real(value: Any) -> Any:
        return device if isinstance(value, torch.device) and value.type == "meta" else value

    for node in graph.nodes:
        node.args = fx.node.map_aggregate(node.args, real)
        node.kwargs = fx.node.map_aggregate(node.kwargs, real)


def _call_arguments(sample: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` the way the runtime calls stage 0 with ``sample``."""
    if isinstance(sample, tuple):
        return sample, {}
    if isinstance(sample, dict):
        return (), dict(sample)
    return (sample,), {}


def _at_least_two(sample: Any) -> Any:
    """The sample with its batch dimension at least 2: export fixes a size-1 dimension
    for good, and the batch must stay free."""

    def grow(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == 1:
            return torch.cat([x, x])
        return x

    return pytree.tree_map(grow, sample)


def _fixed_sizes(value: Any) -> tuple[int | None, ...] | None:
    """An input's sizes that export fixed (None where free); None for a non-tensor."""
    if not isinstance(value, torch.Tensor):
        return None
    return tuple(s if isinstance(s, int) else None for s in value.shape)


def _known_paths(graph: fx.Graph, model: nn.Module) -> None:
    """Nodes export files under a module the model does not have (its own bookkeeping,
    like the input size reads) count as the model's top level."""
    names = {name for name, _ in model.named_modules()}
    for node in graph.nodes:
        if module_path(node) not in names:
            node.meta["nn_module_stack"] = {}


def _fit(name: str, where: list[str], current: object) -> tuple[int, bool]:
    """How well parameter ``name`` suits a user running in module ``where``: the length of
    their common module path, and whether it is the name read now (ties keep it)."""
    owner = name.split(".")[:-1]
    shared = 0
    while shared < min(len(owner), len(where)) and owner[shared] == where[shared]:
        shared += 1
    return shared, name == current


def _name_reads_by_user(graph: fx.Graph, model: nn.Module, gm: nn.Module) -> None:
    """A tied weight is read under the name of the module that uses it.

    export reads a parameter with several names (GPT-2's ``transformer.wte.weight`` and
    ``lm_head.weight``) under one of them everywhere; the stage holding the embedding
    should call it ``transformer.wte.weight``, as the unsplit model's embedding does.
    """
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        *prefix, field = str(node.target).split(".")
        try:
            value = getattr(gm.get_submodule(".".join(prefix)), field)
        except AttributeError:
            continue
        names = aliases.get(id(value), []) if isinstance(value, nn.Parameter) else []
        if len(names) < 2:
            continue
        for user in list(node.users):
            where = module_path(user).split(".")
            best = max(names, key=functools.partial(_fit, where=where, current=node.target))
            if best != node.target:
                with graph.inserting_before(user):
                    alias = graph.create_node("get_attr", best)
                user.replace_input_with(node, alias)
        if not node.users:
            graph.erase_node(node)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """export logs (and prints to stderr) its own view of a failure; ours is the one error
    we raise."""
    loggers = [
        logging.getLogger(n)
        for n in ("torch.fx.experimental.symbolic_shapes", "torch._export", "torch.export")
    ]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
