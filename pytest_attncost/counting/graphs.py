"""Graphs without containers: a ``torch.fx.GraphModule`` counted in its original modules' scopes.

``torch.export.export(model, args).module()`` and ``torch.fx.symbolic_trace(model)`` run the model's ops
flat, from one ``forward``: the modules that held them are left as empty shells that keep the parameters
(symbolic_trace still calls its leaf modules, ``nn.Linear`` and the like), so the counters' module hooks
would put every op at the root: one layer, the head an FFN. The graph's nodes keep the original module
paths in ``meta["nn_module_stack"]``; the twin of such a graph (:func:`run_in_scopes`) runs node by node,
as ``torch.fx.Interpreter`` does, and calls each shell on the path of a stretch of nodes around them, so
every counter sees the scopes (and the calls) the original model had. A graph without that metadata
cannot tell its layers: :func:`unscoped` is the warning that says so.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)

__all__ = ["NO_SCOPES", "graph_metadata", "model_class", "run_in_scopes", "shell_containers", "unscoped"]

NO_SCOPES = ("{name} is a torch.fx GraphModule whose nodes carry no nn_module_stack: its ops run in no module of "
             "the original model, so its layers cannot be told (counted as one layer, a head as an FFN); count the "
             "original model, or the module of torch.export.export(model, args) (exported.module()), whose nodes "
             "keep the module paths")


def _path(node: torch.fx.Node, modules: dict[str, nn.Module]) -> tuple[str, ...]:
    """The shells a node runs in, outermost first (the module a call_module node calls is not one)."""
    stack = node.meta.get("nn_module_stack") or {}
    path = [entry[0] for entry in stack.values() if isinstance(entry, tuple) and entry and entry[0] in modules]
    if node.op == "call_module" and path and path[-1] == node.target:
        path.pop()
    return tuple(name for name in path if name)


def _shell_forward(thunk: Callable[[], Any]) -> Any:
    """A shell's forward while counting: it runs the stretch of nodes it held."""
    return thunk()


def graph_metadata(model: nn.Module) -> dict[int, Any]:
    """A deepcopy memo that shares, not copies, the tensors the graphs of *model* keep in their nodes' metadata
    (the fake tensors torch.export records as ``val``; after ``torch.export.unflatten`` they can no longer be
    copied). They are read, never written: a copy of the module may hold the same ones."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        graph = getattr(module, "graph", None)  # a GraphModule's, or an unflattened export's
        if isinstance(graph, torch.fx.Graph):
            for node in graph.nodes:
                for leaf in pytree.tree_leaves(list(node.meta.values())):
                    if isinstance(leaf, torch.Tensor):
                        memo[id(leaf)] = leaf
    return memo


def unscoped(model: nn.Module) -> str | None:
    """The warning for a GraphModule that holds modules but none of whose nodes carries a module path (see
    :data:`NO_SCOPES`); a graph of a model without modules has no layers to tell."""
    if not isinstance(model, torch.fx.GraphModule):
        return None
    modules = dict(model.named_modules())
    if not set(modules) - {"", "_guards_fn"} or any(_path(node, modules) for node in model.graph.nodes):
        return None
    return NO_SCOPES.format(name=type(model).__name__)


def run_in_scopes(twin: nn.Module) -> None:
    """Make *twin*, a GraphModule (a copy of the user's), run its nodes inside the calls of the modules their
    metadata names. Any other module, and a graph whose nodes name none, is left as it is."""
    if not isinstance(twin, torch.fx.GraphModule):
        return
    modules = dict(twin.named_modules())
    paths = {node: _path(node, modules) for node in twin.graph.nodes}
    if not any(paths.values()):
        return
    called = {node.target for node in twin.graph.nodes if node.op == "call_module"}
    for name in {name for path in paths.values() for name in path} - called:
        modules[name].forward = _shell_forward  # an instance attribute on the twin: the class is untouched
    signature = inspect.signature(type(twin).forward)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if kwargs:  # the graph's inputs are positional, in the order of its forward's parameters
            args = signature.bind(twin, *args, **kwargs).args[1:]
        interpreter = _OnTwinDevice(twin)
        interpreter.env = {}
        interpreter.args_iter = iter(twin.graph.process_inputs(*args))
        output = _run(interpreter, list(twin.graph.nodes), paths, modules, 0)
        return twin.graph.process_outputs(output)

    twin.forward = forward


class _OnTwinDevice(torch.fx.Interpreter):
    """Runs the graph on the twin's device: torch.export bakes the device it ran on into the graph (``arange(...,
    device=cpu)``, ``to(cpu)``, ``_assert_tensor_metadata(..., device=cpu)``), and the twin lives on the meta device.
    The asserts check what export saw, not what is counted: they are skipped."""

    def __init__(self, module: torch.fx.GraphModule) -> None:
        super().__init__(module, garbage_collect_values=False)
        self.device = next((t.device for t in [*module.parameters(), *module.buffers()]), None)

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if str(target) == "aten._assert_tensor_metadata.default":
            return None
        if self.device is not None:
            device = self.device
            args, kwargs = pytree.tree_map(
                lambda v: device if isinstance(v, torch.device) and v != device else v, (args, kwargs))
        return super().call_function(target, args, kwargs)


def _run(interpreter: torch.fx.Interpreter, nodes: Sequence[torch.fx.Node], paths: dict[torch.fx.Node, tuple[str, ...]],
         modules: dict[str, nn.Module], depth: int) -> Any:
    """Run *nodes*, each stretch of them that shares a shell at *depth* inside a call of that shell; the value
    of the output node, if it is among them."""
    output, i = None, 0
    while i < len(nodes):
        path = paths[nodes[i]]
        if len(path) > depth:
            name, end = path[depth], i
            while end < len(nodes) and paths[nodes[end]][depth:depth + 1] == (name,):
                end += 1
            stretch = nodes[i:end]
            found = modules[name](lambda stretch=stretch: _run(interpreter, stretch, paths, modules, depth + 1))
            output = found if found is not None else output
            i = end
            continue
        node = nodes[i]
        interpreter.env[node] = interpreter.run_node(node)
        if node.op == "output":
            output = interpreter.env[node]
        i += 1
    return output


def model_class(model: nn.Module) -> str:
    """The class name of the model a graph was exported from (its nodes' outermost module), else *model*'s own."""
    if isinstance(model, torch.fx.GraphModule):
        for node in model.graph.nodes:
            for entry in (node.meta.get("nn_module_stack") or {}).values():
                if isinstance(entry, tuple) and len(entry) == 2 and entry[0] == "":
                    kind = entry[1]
                    return str(getattr(kind, "__name__", kind)).rsplit(".", 1)[-1]
    return type(model).__name__


def shell_containers(twin: nn.Module) -> list[str]:
    """The shells of a GraphModule that held a list of modules (children named 0, 1, ...: a ModuleList or a
    Sequential of the original model), where the layers are looked for."""
    if not isinstance(twin, torch.fx.GraphModule):
        return []
    return [name for name, module in twin.named_modules()
            if type(module) is nn.Module and (children := [child for child, _ in module.named_children()])
            and all(child.isdigit() for child in children)]
