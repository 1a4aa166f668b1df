"""Capture a model's forward as a graph to cut: ``torch.fx`` first, ``torch.export`` when
fx cannot.

``torch.fx`` needs no sample and keeps ``torch.nn`` modules whole, but stops at Python
control flow on traced values and at ``**kwargs`` signatures, which is most real model
code (every Hugging Face model). ``torch.export`` (non-strict: the model's own Python runs
on fake tensors) follows such code on a sample batch and records ATen operations, each
with the path of the module that ran it (``nn_module_stack``), so annotations, balance by
module and original parameter names keep working. Every dimension of every input is
dynamic where the code allows (batch, sequence length); a size the code fixes is
checked on every later batch. Captures are cached per model and input structure, so
splitting the same model again (another pp, schedule or chunk count) costs nothing.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from conveyor.errors import ConfigError


@dataclass(frozen=True)
class InputLayout:
    """How stage 0 of an exported model turns ``(args, kwargs)`` into graph inputs.

    ``spec``: the pytree structure of the sample's ``(args, kwargs)``; ``fixed``: per flat
    input, the sizes export fixed (None where a dimension stays free), or None for a
    non-tensor input.
    """

    spec: pytree.TreeSpec
    fixed: tuple[tuple[int | None, ...] | None, ...]
    names: tuple[str, ...]
    guards: Any = None  # export's check of the conditions its graph relies on


@dataclass(frozen=True)
class Captured:
    """A model's forward as an fx graph, and where its attribute reads resolve.

    ``holder`` resolves ``get_attr`` targets that are not the model's own (export's lifted
    constants); ``constants`` are tensors fx found as literals. For an exported model,
    ``inputs`` flattens the call's arguments and ``output_spec`` rebuilds its output.
    """

    graph: fx.Graph
    holder: nn.Module
    constants: dict[str, Any]
    exported: bool
    inputs: InputLayout | None = None
    output_spec: pytree.TreeSpec | None = None

    def attr(self, model: nn.Module, target: str) -> Any:
        """The value a ``get_attr`` node reads: the model's own object where it has one."""
        if target in self.constants:
            return self.constants[target]
        *prefix, field = target.split(".")
        for root in (model, self.holder):
            try:
                return getattr(root.get_submodule(".".join(prefix)), field)
            except AttributeError:
                continue
        raise AttributeError(f"the captured graph reads {target!r}, which the model lacks")


_CACHE: weakref.WeakKeyDictionary[nn.Module, dict[Any, Captured]] = weakref.WeakKeyDictionary()


def capture(model: nn.Module, sample: Any = None) -> Captured:
    """The model's graph: fx when it traces, else export on ``sample`` (one micro-batch of
    stage-0 input: a tensor, tuple or dict of tensors).

    Raises :class:`ConfigError` naming the module and source line that stopped both, and
    a ``NeedsSample`` error when fx fails and no sample was given.
    """
    key = _structure(model)
    cached = _CACHE.setdefault(model, {})
    hit = cached.get((key, None))
    if hit is not None:
        return hit
    try:
        captured = _fx(model)
    except Exception as fx_error:
        if sample is None:
            raise NeedsSample(_failure(model, fx_error)) from fx_error
        sample_key = (key, _sample_key(sample))
        hit = cached.get(sample_key)
        if hit is not None:
            return hit
        captured = _export(model, sample, fx_error)
        cached[sample_key] = captured
        return captured
    cached[(key, None)] = captured
    return captured


class NeedsSample(ConfigError):
    """fx cannot trace the model; export needs a sample batch to capture it."""


def needs_sample(model: nn.Module) -> bool:
    """Whether capturing ``model`` needs a sample batch (fx cannot trace it)."""
    try:
        capture(model)
    except NeedsSample:
        return True
    return False


# ---------------------------------------------------------------------------- fx
def _fx(model: nn.Module) -> Captured:
    before = set(vars(model))
    tracer = fx.Tracer()
    # Buffers become graph reads too (so ``self.mask[:t]`` with a traced t works).
    tracer.proxy_buffer_attributes = True
    try:
        graph = tracer.trace(model)
    finally:
        # The tracer parks literal tensors on the model as _tensor_constant<i>; take them.
        constants = {name: vars(model)[name] for name in set(vars(model)) - before}
        for name in constants:
            delattr(model, name)
    return Captured(graph, model, constants, exported=False)


# ---------------------------------------------------------------------------- export
def _export(model: nn.Module, sample: Any, fx_error: Exception) -> Captured:
    from torch.export import Dim, ShapesCollection

    args, kwargs = _call_arguments(_at_least_two(sample))
    dynamic: Any = ShapesCollection()  # type: ignore[no-untyped-call]
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            dynamic[leaf] = {i: Dim.AUTO for i in range(leaf.dim())}
    # Captured in training mode: what dropout and batch norm do then is in the graph, and
    # _follow_module_modes makes them follow the modules' mode at run time.
    modes = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        with _quiet():
            try:
                program = torch.export.export(
                    model, args, kwargs, dynamic_shapes=dynamic, strict=False
                )
            except AssertionError:
                # torch 2.13 cannot map dynamic shapes onto extra ``**kwargs``: fix every size.
                program = torch.export.export(model, args, kwargs, strict=False)
    except Exception as export_error:
        config = getattr(model, "config", None)
        if getattr(config, "use_cache", False) and "Cache" in str(export_error):
            raise ConfigError(
                f"{type(model).__name__} returns a key/value cache (its config.use_cache is "
                f"True), which training does not need and which cannot be sent between "
                f"stages; set model.config.use_cache = False for training"
            ) from export_error
        raise ConfigError(_failure(model, export_error, fx_error)) from export_error
    finally:
        for module, training in modes:
            module.training = training
    gm = program.module()
    graph = gm.graph
    guards = getattr(gm, "_guards_fn", None)
    for node in list(graph.nodes):  # stage 0 checks the guards itself (check_inputs)
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    fixed = tuple(_fixed_sizes(n.meta.get("val")) for n in placeholders)
    layout = InputLayout(
        program.call_spec.in_spec, fixed, tuple(str(n.target) for n in placeholders), guards
    )
    _known_paths(graph, model)
    _follow_module_modes(gm, model)
    _name_reads_by_user(graph, model, gm)
    return Captured(
        graph,
        gm,
        {},
        exported=True,
        inputs=layout,
        output_spec=program.call_spec.out_spec,
    )


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
    if not isinstance(value, torch.Tensor):
        return None
    return tuple(s if isinstance(s, int) else None for s in value.shape)


def check_inputs(layout: InputLayout, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Flatten a stage-0 call like the capture sample; a clear error when its structure
    or a size the capture fixed differs."""
    spec_kwargs = layout.spec.child(1).context if layout.spec.num_children == 2 else []
    if list(kwargs) != list(spec_kwargs) and set(kwargs) == set(spec_kwargs):
        kwargs = {k: kwargs[k] for k in spec_kwargs}  # same keys, another order
    flat, spec = pytree.tree_flatten((args, kwargs))
    if spec != layout.spec:
        raise ConfigError(
            f"the model was captured with inputs {_show(layout.spec)} but this step passes "
            f"{_show(spec)}; pass inputs of the same structure every step (the same keys "
            f"and positions), or build a new Pipeline"
        )
    for name, value, fixed in zip(layout.names, flat, layout.fixed, strict=True):
        if fixed is None or not isinstance(value, torch.Tensor):
            continue
        if len(fixed) != value.dim() or any(
            f is not None and f != s for f, s in zip(fixed, value.shape, strict=False)
        ):
            sizes = ["*" if f is None else str(f) for f in fixed]
            raise ConfigError(
                f"input {name!r} has shape {list(value.shape)}, but the captured model fixed "
                f"its sizes to [{', '.join(sizes)}] (* is free: the model's code turns the "
                f"others into constants); pass inputs of those sizes"
            )
    if layout.guards is not None:
        try:
            layout.guards(*flat)
        except Exception as e:
            raise ConfigError(
                f"this step's inputs break a condition the captured model relies on "
                f"({_first_line(e)}); its code fixed a relation between input sizes when it "
                f"was captured: pass inputs that keep it, or build a new Pipeline"
            ) from e
    return flat


def _show(spec: pytree.TreeSpec) -> str:
    try:
        args, kwargs = pytree.tree_unflatten(["·"] * spec.num_leaves, spec)
    except Exception:
        return str(spec)
    parts = [f"{len(args)} positional"] if args else []
    if kwargs:
        parts.append("keywords " + ", ".join(kwargs))
    return " and ".join(parts) or "no arguments"


def _known_paths(graph: fx.Graph, model: nn.Module) -> None:
    """Nodes export files under a module the model does not have (its own bookkeeping,
    like the input size reads) count as the model's top level."""
    names = {name for name, _ in model.named_modules()}
    for node in graph.nodes:
        if module_path(node) not in names:
            node.meta["nn_module_stack"] = {}


def _follow_module_modes(gm: fx.GraphModule, model: nn.Module) -> None:
    """Dropout and batch norm follow their module's ``training`` flag at run time.

    export writes what the model's mode meant at capture into the graph as constants: the
    ``train`` / ``training`` flag of dropout and batch norm, and attention's ``dropout_p``
    (``p if self.training else 0.0`` in the model's code). We replace each with a read of
    the module that ran the operation, so ``model.eval()`` / ``model.train()`` work as
    they do on the unsplit model.
    """
    modules = dict(model.named_modules())
    sources: dict[str, ModeSource] = {}
    gm.__dict__[MODES] = sources  # before the graph reads it
    graph = gm.graph
    for node in list(graph.nodes):
        schema = getattr(node.target, "_schema", None)
        path = module_path(node)
        if node.op != "call_function" or schema is None or path not in modules:
            continue
        for position, argument in enumerate(schema.arguments):
            if argument.name in ("train", "training"):
                read: Any = training_mode
            elif argument.name == "dropout_p":
                read = dropout_rate
            else:
                continue
            given = node.args[position] if position < len(node.args) else node.kwargs.get(
                argument.name, argument.default_value if argument.has_default_value() else None
            )
            if isinstance(given, fx.Node) or given is None:
                continue
            if read is dropout_rate and not given:
                continue  # no dropout at capture: the code may still ask for some in training
            sources.setdefault(path, ModeSource(modules[path]))
            with graph.inserting_before(node):
                table = graph.create_node("get_attr", MODES)
                mode = graph.call_function(read, (table, path, given))
            for made in (table, mode):
                made.meta = {"nn_module_stack": node.meta.get("nn_module_stack", {})}
            if position < len(node.args):
                args = list(node.args)
                args[position] = mode
                node.args = tuple(args)
            else:
                node.kwargs = {**node.kwargs, argument.name: mode}


MODES = "_conveyor_modes"


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


class ModeSource:
    """Points at a module without registering it (its parameters stay where they are)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __repr__(self) -> str:
        return f"ModeSource({type(self.module).__name__})"


def training_mode(sources: dict[str, ModeSource], path: str, captured: bool) -> bool:
    """Whether the module at ``path`` is in training mode (read at run time)."""
    return bool(sources[path].module.training)


def dropout_rate(sources: dict[str, ModeSource], path: str, rate: float) -> float:
    """The dropout rate captured in training mode, or 0 when the module at ``path`` is
    in evaluation mode."""
    return float(rate) if sources[path].module.training else 0.0


def module_path(node: fx.Node) -> str:
    """The qualified name of the module a node runs in ('' at the top level)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    return str(next(reversed(stack.values()))[0]) if stack else ""


# ---------------------------------------------------------------------------- errors
def _failure(model: nn.Module, error: Exception, fx_error: Exception | None = None) -> str:
    """One paragraph: what stopped capture, where, and the ways out."""
    name = type(model).__name__
    where = _site(model, error) or (None if fx_error is None else _site(model, fx_error))
    first = _first_line(error)
    at = f" at {where}" if where else ""
    if fx_error is None:
        return (
            f"torch.fx cannot trace {name} ({first}){at}; conveyor captures such a model with "
            f"torch.export on a sample batch: pass sample=(inputs, targets) to the Pipeline "
            f"(or call train_step first: the first batch is the sample)"
        )
    return (
        f"conveyor cannot capture {name} as a graph: torch.fx stopped ({_first_line(fx_error)}) "
        f"and torch.export stopped ({first}){at}. Ways out: rewrite that line without "
        f"Python control flow on tensor values; or pass an nn.Sequential or a list of "
        f"layers; or an execution sequence: conveyor.sequence(model, ['embed', 'blocks.0', "
        f"...])"
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


_INTERNAL = (
    os.path.dirname(torch.__file__),
    os.path.dirname(os.path.dirname(__file__)),
    os.path.dirname(contextlib.__file__),
)


def _site(model: nn.Module, error: BaseException) -> str | None:
    """'model.<module> (file:line)' of the deepest model-code frame the error went through."""
    names = {id(m): n for n, m in model.named_modules()}
    found: str | None = None
    seen: set[int] = set()
    chain: BaseException | None = error
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        for frame, line in traceback.walk_tb(chain.__traceback__):
            path = frame.f_code.co_filename
            if path.startswith(_INTERNAL) or path.startswith("<"):
                continue
            owner = frame.f_locals.get("self")
            module = names.get(id(owner)) if isinstance(owner, nn.Module) else None
            label = "" if module is None else f"model.{module}" if module else "the model"
            found = f"{label} ({path}:{line})" if label else f"{path}:{line}"
        chain = chain.__cause__ or chain.__context__
    return found


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """export logs (and prints to stderr) its own view of a failure; ours is the one error
    we raise."""
    loggers = [logging.getLogger(n) for n in ("torch.fx.experimental.symbolic_shapes",
                                               "torch._export", "torch.export")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


# ---------------------------------------------------------------------------- cache keys
def _structure(model: nn.Module) -> tuple[Any, ...]:
    """Changes when the model's modules, parameters or mode change."""
    return (
        model.training,
        tuple((n, id(m)) for n, m in model.named_modules()),
        tuple(id(p) for p in model.parameters()),
    )


def _sample_key(sample: Any) -> tuple[Any, ...]:
    leaves, spec = pytree.tree_flatten(sample)
    return (
        str(spec),
        tuple(
            (x.dim(), x.dtype, x.device.type) if isinstance(x, torch.Tensor) else repr(x)
            for x in leaves
        ),
    )
