"""The pinned APIs as data: every name molt_nb uses in vLLM, NeMo AutoModel and Ray, read from the pinned wheels.

molt_nb calls into vllm, nemo_automodel and ray, which the CPU virtualenv never installs (they are GPU extras), so the
suite cannot import them. This script reads the *source* of the exact wheels the GPU images pin
(cluster/constraints-gpu-{vllm,automodel}.txt) straight out of the zip files (never importing or installing them),
finds every reference molt_nb's code makes into them (with `ast`: module attributes, imported names, methods of
objects whose type the tables below declare, keyword arguments and keyword dictionaries), resolves each to its
definition and writes what molt_nb relies on to cluster/pinned_api.json, with the behaviours (`FACTS`) the project
relies on, each proven by an exact snippet of the wheel. tests/test_pinned_api.py checks molt_nb against that JSON in
`make test`, with no network and no wheel.

    python cluster/pinned_api.py write    # download the pinned wheels (into .pinned-wheels/), rewrite the JSON
    python cluster/pinned_api.py check    # regenerate in memory; exit 1 with a diff if the committed JSON differs
                                          # or a fact's snippet is gone (`make check-gpu-api`)

Needs the network the first time (pip download, ~420 MB, cached in .pinned-wheels/). Standard library only.
"""

import ast
import difflib
import json
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
API_JSON = ROOT / 'cluster' / 'pinned_api.json'
CACHE = ROOT / '.pinned-wheels'
# top-level package -> (PyPI name, the constraints file that pins it)
LIBS = {
    'vllm': ('vllm', 'cluster/constraints-gpu-vllm.txt'),
    'nemo_automodel': ('nemo-automodel', 'cluster/constraints-gpu-automodel.txt'),
    'ray': ('ray', 'cluster/constraints-gpu-vllm.txt'),
}
# Ray's wheel is per Python: its sources are the same in every one, the cp311 manylinux one is read
PLATFORM_ARGS = {
    'ray': ['--only-binary=:all:', '--implementation', 'cp', '--python-version', '3.11', '--abi', 'cp311']
    + ['--platform', 'manylinux2014_x86_64'],
}

# ---------------------------------------------------------------------------------------------------------------------
# What molt_nb's code cannot say itself. Each entry is a claim about the pinned libraries, checked against the wheel
# by `write`: a wrong one shows up as a missing name or keyword.

# The library type of a name inside a project class (its methods, and `@patch`ed functions whose `self` is annotated
# with it) or function (by qualified name): `self` of a vLLM worker extension is the worker it is mixed into; an
# attribute or local set from an argument. 'kwargs:X' is a dict of keyword arguments of X.
DECLARED = {
    'VLLMEngine': {'self.llm': 'vllm.v1.engine.async_llm.AsyncLLM'},
    'VLLMEngine.start': {'args': 'kwargs:vllm.AsyncEngineArgs'},  # `engine_args(...)`
    # worker_extension_cls: vLLM appends WeightLoader to the bases of its GPU worker class (worker_base.py)
    'WeightLoader': {'self': 'vllm.v1.worker.gpu_worker.Worker'},
    'AutoModelRouteReplay': {
        'gate': 'nemo_automodel.components.moe.layers.Gate',  # a module with `router_replay` set
        'g': 'nemo_automodel.components.moe.layers.Gate',
        # molt_nb's subclass of RouterReplay replaces each gate's (`sentinel_router_replay`)
        'gate.router_replay': 'SentinelRouterReplay',
        'g.router_replay': 'SentinelRouterReplay',
        'h': 'SentinelRouterReplay',
    },
    'AutoModelBackend': {'setup': 'nemo_automodel.components.distributed.config.DistributedSetup'},
    'hf_weights': {'adapter': 'nemo_automodel.components.checkpoint.state_dict_adapter.StateDictAdapter'},
}
# Project functions that return a library module (the lazy-import seams)
SEAMS = {'import_vllm': 'vllm', 'require_automodel': 'nemo_automodel'}
# What a library function returns, or an attribute holds, where molt_nb goes on to use it; None: followed no further
# (an object of another library, or data). A name missing here, when used, is a reference the checker cannot classify.
RETURNS = {
    'ray.get_runtime_context': 'ray.runtime_context.RuntimeContext',
    'ray.get': None,  # what the remote call returned
    'ray.cluster_resources': None,  # dicts of resource name -> amount
    'ray.available_resources': None,
    'ray._private.grpc_utils.init_grpc_channel': None,  # a grpc channel
    'ray.actor.ActorClass.options': 'ray.actor.ActorClass',
    'ray.actor.ActorClass.remote': None,  # a handle of one of molt_nb's own actors
    'ray.remote_function.RemoteFunction.options': 'ray.remote_function.RemoteFunction',
    'ray.remote_function.RemoteFunction.remote': None,
    'ray._raylet.AuthenticationTokenLoader.instance': 'ray._raylet.AuthenticationTokenLoader',
    'ray.core.generated.ray_client_pb2_grpc.RayletDriverStub.ClusterInfo': None,  # a grpc unary-unary callable
    'vllm.v1.engine.async_llm.AsyncLLM.from_engine_args': 'vllm.v1.engine.async_llm.AsyncLLM',
    'vllm.v1.engine.async_llm.AsyncLLM.vllm_config': 'vllm.config.VllmConfig',
    'vllm.config.VllmConfig.model_config': 'vllm.config.ModelConfig',
    'vllm.v1.worker.gpu_worker.Worker.vllm_config': 'vllm.config.VllmConfig',
    # MRV2's runner (the worker builds vllm.v1.worker.gpu.model_runner's for use_v2_model_runner)
    'vllm.v1.worker.gpu_worker.Worker.model_runner': 'vllm.v1.worker.gpu.model_runner.GPUModelRunner',
    'vllm.v1.worker.gpu.model_runner.GPUModelRunner.get_model': None,  # the model's own torch module
    'nemo_automodel.components.distributed.config.DistributedSetup.build': (
        'nemo_automodel.components.distributed.config.DistributedSetup'
    ),
    'nemo_automodel.components.distributed.config.DistributedSetup.mesh_context': (
        'nemo_automodel.components.distributed.mesh.MeshContext'
    ),
    'nemo_automodel.components.distributed.mesh.MeshContext.device_mesh': None,  # torch's DeviceMesh
    'nemo_automodel.components.distributed.mesh_utils.get_flat_mesh': None,  # torch's DeviceMesh
    'nemo_automodel.components.moe.layers.Gate.router_replay': (
        'nemo_automodel.components.moe.router_replay.RouterReplay'
    ),
}
# Library names that are called but defined without a signature to read (set in __init__ to a closure, or built by
# another library): name -> what they take
CALLABLE = {
    'ray.remote_function.RemoteFunction.remote': "the remote function's own arguments (a *args, **kwargs proxy)",
    'ray.core.generated.ray_client_pb2_grpc.RayletDriverStub.ClusterInfo': "a grpc unary-unary callable: request, "
    "timeout=, wait_for_ready=",
}
# Keyword dictionaries molt_nb builds for a library call: a project function (the keys of the dicts it returns) or a
# module constant -> the callable whose keywords they are. A `**dict` at a call is checked where its keys are known.
KWARGS = {
    'sampling_kwargs': 'vllm.SamplingParams',
    'engine_args': 'vllm.AsyncEngineArgs',
    'PINNED_ARGS': 'vllm.AsyncEngineArgs',
    'OWNED': 'vllm.AsyncEngineArgs',
    'Placement.options': 'ray.actor.ActorClass.options',
    'actor_options': 'ray.actor.ActorClass.options',
}
# A keyword argument whose value is itself a dict of another class's keywords
NESTED_KWARGS = {
    ('nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained', 'moe_overrides'): (
        'nemo_automodel.components.moe.config.MoEConfig'
    ),
}
# `**x` at a call whose keys no static reading can know: (function, expression) -> why that is fine
UNCHECKED = {
    ('TrainerGroup.__init__', 'options(r)'): "the caller's per-rank options: steering.start_processes builds them "
    "with actor_options, checked there",
    ('launch', 'options'): "name, namespace, lifetime, num_cpus and remote.ship's options (resources), all Ray's",
    ('check_on_cluster', 'options'): "remote.ship's options for the head node (resources)",
}
# Functions that take **kwargs and check them against a dict of option names: the dict's keys are their keywords
KEYWORD_TABLES = {
    'ray.remote': 'ray._common.ray_option_utils.valid_options',
    'ray.actor.ActorClass.options': 'ray._common.ray_option_utils.actor_options',
    'ray.remote_function.RemoteFunction.options': 'ray._common.ray_option_utils.task_options',
}
# A call on any object's `.remote` that no table types: a method of an actor handle of molt_nb's own actors
ACTOR_METHOD = 'ray.actor.ActorMethod.remote'

# The behaviours the project relies on, each proven by an exact snippet of the pinned source (`absent`: proven by the
# snippet appearing nowhere under `file`, a folder of the wheel).
FACTS = [
    dict(
        id='routed-experts-need-prefix-caching',
        says="enable_return_routed_experts (the AuxOutput connector) refuses to start without prefix caching",
        file='vllm/config/vllm.py',
        contains='raise ValueError("AuxOutput Connector requires prefix caching.")',
    ),
    dict(
        id='placement-group-picks-ray-executor',
        says="inside a Ray placement group vLLM defaults a multi-GPU engine to its Ray executor",
        file='vllm/config/parallel.py',
        contains='if get_current_placement_group():\n                            backend = "ray"',
    ),
    dict(
        id='pause-rejects-new-requests',
        says="pause_generation in 'abort' and 'wait' modes rejects new requests until resume ('keep' queues them)",
        file='vllm/v1/engine/core.py',
        contains='self.reject_new_requests = mode != "keep"',
    ),
    dict(
        id='rejected-request-raises-retryable',
        says="a request rejected during a pause fails with RetryableRequestError in the client",
        file='vllm/outputs.py',
        contains='if self.retryable:\n            return RetryableRequestError(self.message)',
    ),
    dict(
        id='reload-weights-resets-caches',
        says="the MRV2 model runner's reload_weights resets the encoder and multimodal caches after the reload",
        file='vllm/v1/worker/gpu/model_runner.py',
        contains='self.reset_lora_state()\n        self.reset_encoder_cache()\n        self.reset_mm_cache()',
    ),
    dict(
        id='worker-extension-names-must-not-clash',
        says="a worker_extension_cls attribute that the worker class already has is refused at start",
        file='vllm/v1/worker/worker_base.py',
        contains='assert not hasattr(worker_class, attr), (',
    ),
    dict(
        id='automodel-keeps-fsdp-gradient-averaging',
        says="nemo_automodel never sets FSDP's gradient divide factor: gradients are averaged over the dp ranks",
        file='nemo_automodel/',
        contains='set_gradient_divide_factor',
        absent=True,
    ),
    dict(
        id='automodel-dp-mesh-is-flattened',
        says="nemo_automodel's 'dp' mesh is a _flatten() of other dims, read with get_flat_mesh, not device_mesh['dp']",
        file='nemo_automodel/components/distributed/mesh_utils.py',
        contains='if hasattr(root, "_flatten_mapping") and name in root._flatten_mapping:',
    ),
    dict(
        id='qwen3-moe-takes-moe-overrides',
        says="Qwen3-MoE pops moe_overrides from the model kwargs into its MoEConfig (routing replay is switched on so)",
        file='nemo_automodel/components/models/qwen3_moe/model.py',
        contains='moe_overrides',
    ),
]


# ---------------------------------------------------------------------------------------------------------------------
# The walker: molt_nb's references into the libraries


@dataclass
class Ref:
    "One use of a library name at `file:line`; a call carries its keyword names and positional count"

    file: str
    line: int
    name: str
    call: bool = False
    keywords: tuple = ()
    positional: int = 0
    starred: bool = False  # a *args at the call: the positional count is unknown
    sources: tuple = ()  # callables whose keyword dicts were passed with ** (checked where they are built)


@dataclass
class Val:
    "What an expression is: a library name ('name'), an object of a library class ('object'), a keyword dict"

    kind: str  # 'name' | 'object' | 'self' | 'opaque' | 'undeclared' | 'kwargs' | 'decorator'
    path: str = ''
    owner: str = ''  # 'self': the project class deriving from (or mixed into) library class `path`


OPAQUE = Val('opaque')


@dataclass
class Scope:
    names: dict = field(default_factory=dict)  # local name -> Val
    exprs: dict = field(default_factory=dict)  # local name -> the expressions assigned to it (for dict keys)
    keys: dict = field(default_factory=dict)  # local name -> keys stored with name['k'] = ...


def project_classes(sources: dict) -> set:
    "Names of the classes molt_nb defines (`ray.remote` of one makes an actor class)"
    return {n.name for src in sources.values() for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef)}


def own_members(tree: ast.Module) -> dict:
    "class name -> the attributes and methods molt_nb itself gives it (in its body, or `@patch`ed on it)"
    own = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            names = own.setdefault(node.name, set())
            names |= {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            names |= {t.attr for n in ast.walk(node) for t in targets(n) if is_self_attr(t)}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (cls := patched_class(node)):
            own.setdefault(cls, set()).add(node.name)
            own[cls] |= {t.attr for n in ast.walk(node) for t in targets(n) if is_self_attr(t)}
    return own


def targets(node) -> list:
    if isinstance(node, ast.Assign):
        return [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
    return [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []


def is_self_attr(node) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == 'self'


def patched_class(fn) -> str | None:
    "The class a fastcore `@patch` function is a method of (its first argument's annotation)"
    args = fn.args.args
    if args and args[0].arg == 'self' and isinstance(args[0].annotation, ast.Name):
        return args[0].annotation.id
    return None


class Walker(ast.NodeVisitor):
    """Finds the library references of one module. `kind_of(name)` says what a library name is ('module', 'class',
    'function', 'attribute', 'object', or None when unknown): from the wheel when writing, the JSON when testing"""

    def __init__(self, path: str, source: str, kind_of, classes: set = frozenset()):
        self.path, self.kind_of, self.classes = path, kind_of, set(classes)
        self.tree = ast.parse(source)
        self.own, self.consts = own_members(self.tree), module_consts(self.tree)
        self.refs, self.problems = [], []
        self.scopes, self.owner, self.func, self.bases = [Scope()], None, None, {}

    def run(self) -> 'Walker':
        self.classes |= {n.name for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)}
        self.visit(self.tree)
        self.kwargs_sources()
        return self

    def problem(self, node, message: str):
        self.problems.append((self.path, node.lineno, message))

    def ref(self, node, name: str, **kw):
        self.refs.append(Ref(self.path, node.lineno, name, **kw))

    # --- scopes and context

    def lookup(self, name: str) -> Val | None:
        declared = self.declared(name)
        if declared is not None:
            return declared
        for scope in reversed(self.scopes):
            if name in scope.names:
                return scope.names[name]
        return None

    def declared(self, expr: str) -> Val | None:
        "What DECLARED says `expr` is here (a project class deriving from a library class: that class, less its own)"
        for key in (self.func, self.owner):
            t = DECLARED.get(key, {}).get(expr)
            if t is None:
                continue
            if t.startswith('kwargs:'):
                return Val('kwargs', t.split(':', 1)[1])
            if expr == 'self':
                return Val('self', t, self.owner)
            return Val('self', self.bases[t], t) if t in self.bases else Val('object', t)
        if expr == 'self' and self.owner in self.bases:
            return Val('self', self.bases[self.owner], self.owner)
        return None

    def bind(self, target, val: Val | None, value=None):
        scope = self.scopes[-1]
        if isinstance(target, ast.Name):
            scope.names.pop(target.id, None)
            if val is not None:
                scope.names[target.id] = val
            if value is not None:
                scope.exprs.setdefault(target.id, []).append(value)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for e in target.elts:
                self.bind(e, None)
        elif isinstance(target, ast.Starred):
            self.bind(target.value, None)
        elif isinstance(target, ast.Subscript):
            self.store_key(target)
        else:
            self.ev(target)  # an attribute stored on a library object must exist

    def store_key(self, target: ast.Subscript):
        base = self.ev(target.value)
        key = const_str(target.slice)
        if isinstance(target.value, ast.Name) and key is not None:
            self.scopes[-1].keys.setdefault(target.value.id, set()).add(key)
        if base is not None and base.kind == 'kwargs' and key is not None:
            self.ref(target, base.path, call=True, keywords=(key,))

    # --- statements

    def visit(self, node):
        if isinstance(node, ast.expr):
            return self.ev(node)
        return super().visit(node)

    def visit_ClassDef(self, node):
        for b in node.bases:
            v = self.ev(b)
            if v is not None and v.kind == 'name' and self.kind_of(v.path) == 'class':
                self.bases.setdefault(node.name, v.path)
        for d in node.decorator_list:
            self.ev(d)
        saved, self.owner = self.owner, node.name
        for stmt in node.body:
            self.visit(stmt)
        self.owner = saved

    def visit_FunctionDef(self, node):
        for d in node.decorator_list:
            self.ev(d)
        saved = self.owner, self.func
        self.owner = patched_class(node) or self.owner
        self.func = f'{self.owner}.{node.name}' if self.owner else node.name
        self.scopes.append(Scope())
        for stmt in node.body:
            self.visit(stmt)
        self.scopes.pop()
        self.owner, self.func = saved

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node):
        for a in node.names:
            top = a.name.split('.')[0]
            if top in LIBS:
                self.ref(node, a.name)
                self.bind(ast.Name(a.asname or top), Val('name', a.name if a.asname else top))

    def visit_ImportFrom(self, node):
        mod = node.module or ''
        if node.level or mod.split('.')[0] not in LIBS:
            for a in node.names:
                self.bind(ast.Name(a.asname or a.name), None)
            return
        for a in node.names:
            self.ref(node, f'{mod}.{a.name}')
            self.bind(ast.Name(a.asname or a.name), Val('name', f'{mod}.{a.name}'))

    def visit_Assign(self, node):
        if isinstance(node.value, ast.Tuple) and all(
            isinstance(t, ast.Tuple) and len(t.elts) == len(node.value.elts) for t in node.targets
        ):  # a, b = x, y: each name gets its own value
            vals = [self.ev(v) for v in node.value.elts]
            for t in node.targets:
                for e, v, value in zip(t.elts, vals, node.value.elts):
                    self.bind(e, v, value)
            return
        val = self.ev(node.value)
        for t in node.targets:
            self.bind(t, val, node.value)

    def visit_ExceptHandler(self, node):
        val = self.ev(node.type) if node.type is not None else None
        if node.name:  # `except ray.exceptions.RayTaskError as e`: e is one
            is_class = val is not None and val.kind == 'name' and self.kind_of(val.path) == 'class'
            self.bind(ast.Name(node.name), Val('object', val.path) if is_class else None)
        for stmt in node.body:
            self.visit(stmt)

    def visit_AnnAssign(self, node):
        val = self.ev(node.value) if node.value is not None else None
        self.bind(node.target, val, node.value)

    def visit_AugAssign(self, node):
        self.ev(node.value)
        self.ev(node.target)

    def visit_For(self, node):
        self.ev(node.iter)
        self.bind(node.target, None)
        for stmt in node.body + node.orelse:
            self.visit(stmt)

    visit_AsyncFor = visit_For

    def visit_withitem(self, node):
        self.ev(node.context_expr)
        if node.optional_vars is not None:
            self.bind(node.optional_vars, None)

    # --- expressions

    def ev(self, node, store: bool = False) -> Val | None:
        "What `node` is, recording the library references in it"
        if isinstance(node, ast.Name):
            return self.ev_name(node)
        if isinstance(node, ast.Attribute):
            return self.member(self.ev(node.value), node.attr, node, ast.unparse(node.value))
        if isinstance(node, ast.Call):
            return self.ev_call(node)
        if isinstance(node, ast.Await):
            return self.ev(node.value)
        if isinstance(node, ast.Subscript):
            return self.ev_subscript(node)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return self.ev_merge(node)
        if isinstance(node, ast.Lambda):
            self.scopes.append(Scope())
            self.ev(node.body)
            self.scopes.pop()
            return None
        for child in ast.iter_child_nodes(node):
            self.visit(child)
        return None

    def ev_name(self, node) -> Val | None:
        if not isinstance(node.ctx, ast.Load):
            return None
        val = self.lookup(node.id)
        if val is None and node.id in LIBS:  # a library module bound in a way the walker does not follow
            self.problem(
                node, f"cannot classify `{node.id}` here: bind it with `import {node.id}` (or a seam in SEAMS)"
            )
        return val

    def member(self, base: Val | None, attr: str, node, text: str = '') -> Val | None:
        "The library name `base.attr` (`text` is base's source), recorded; None for a name molt_nb owns"
        declared = self.declared(f'{text}.{attr}') if text else None
        if base is None or base.kind in ('opaque', 'kwargs', 'decorator'):
            return declared or (OPAQUE if base is not None and base.kind == 'opaque' else None)
        if base.kind == 'undeclared':
            self.problem(
                node,
                f"cannot classify `.{attr}` on what {base.path} returns: declare its type in RETURNS in "
                "cluster/pinned_api.py (None to follow it no further), then run `cluster/pinned_api.py write`",
            )
            return OPAQUE
        if base.kind == 'self' and attr in self.own.get(base.owner, ()):
            return declared
        owner = self.type_of(base, node)
        if owner is None:
            return declared or (OPAQUE if base.kind == 'name' and self.kind_of(base.path) is not None else None)
        name = f'{owner}.{attr}'
        self.ref(node, name)
        return declared or Val('name', name)

    def type_of(self, base: Val, node) -> str | None:
        "The dotted name whose members `base`'s attributes are"
        if base.kind in ('object', 'self'):
            return base.path
        kind = self.kind_of(base.path)
        if kind in ('module', 'class', 'object'):
            return base.path
        if kind in ('attribute', 'function') and base.path in RETURNS:
            return RETURNS[base.path]
        if kind in ('attribute', 'function'):
            self.problem(node, f"cannot classify an attribute of {base.path}: declare its type in RETURNS")
        return None

    def ev_subscript(self, node) -> Val | None:
        base = self.ev(node.value)
        self.ev(node.slice)
        key = const_str(node.slice)
        if base is not None and base.kind == 'kwargs' and key is not None:
            self.ref(node, base.path, call=True, keywords=(key,))
        return None

    def ev_merge(self, node) -> Val | None:
        "`a | b` of dicts: a keyword dict stays one, and the keys merged into it are its keywords"
        left, right = self.ev(node.left), self.ev(node.right)
        for val, other in ((left, node.right), (right, node.left)):
            if val is not None and val.kind == 'kwargs':
                keys, _, _ = self.dict_keys(other)
                self.ref(node, val.path, call=True, keywords=tuple(sorted(keys)))
                return val
        return None

    def ev_call(self, node) -> Val | None:
        special = self.special_call(node)
        if special is not False:
            return special
        func = self.ev(node.func)
        for a in node.args:
            self.ev(a.value if isinstance(a, ast.Starred) else a)
        for k in node.keywords:
            self.ev(k.value)
        if func is not None and func.kind == 'decorator':  # `ray.remote(num_cpus=0)(fn)`
            return self.remote_result(node)
        if func is None or func.kind != 'name':
            if func is None and isinstance(node.func, ast.Attribute) and node.func.attr == 'remote':
                self.ref(node, ACTOR_METHOD, call=True, **self.call_args(node, ACTOR_METHOD))
            return None if func is None else OPAQUE
        self.ref(node, func.path, call=True, **self.call_args(node, func.path))
        return self.result(func.path, node)

    def special_call(self, node):
        "super(), getattr(x, 'name', ...), seams and dict.get on keyword dicts; False when `node` is none of them"
        f = node.func
        if isinstance(f, ast.Name) and f.id == 'super' and self.owner in self.bases:
            return Val('object', self.bases[self.owner])
        if isinstance(f, ast.Name) and f.id in SEAMS and not node.args:
            return Val('name', SEAMS[f.id])
        if ast.unparse(f) == 'sys.modules.get' and node.args and const_str(node.args[0]) in LIBS:
            return Val('name', const_str(node.args[0]))  # the module if this process imported it
        if isinstance(f, ast.Name) and f.id == 'getattr' and len(node.args) >= 2 and const_str(node.args[1]):
            for a in node.args[2:]:
                self.ev(a)
            return self.member(self.ev(node.args[0]), const_str(node.args[1]), node, ast.unparse(node.args[0]))
        if isinstance(f, ast.Attribute) and f.attr == 'get' and node.args and const_str(node.args[0]):
            base = self.ev(f.value)
            if base is not None and base.kind == 'kwargs':
                self.ref(node, base.path, call=True, keywords=(const_str(node.args[0]),))
                return None
        return False

    def result(self, name: str, node) -> Val:
        "What calling library name `name` gives"
        if name == 'ray.remote':
            return self.remote_result(node) if node.args else Val('decorator', name)
        kind = self.kind_of(name)
        if kind == 'class':
            return Val('object', name)
        if name in RETURNS:
            return OPAQUE if RETURNS[name] is None else Val('object', RETURNS[name])
        return Val('undeclared', name) if kind is not None else OPAQUE

    def remote_result(self, node) -> Val:
        "`ray.remote(x)`: an actor class for one of molt_nb's classes, else a remote function"
        a = node.args[0] if node.args else None
        if isinstance(a, ast.Name) and a.id in self.classes:
            return Val('object', 'ray.actor.ActorClass')
        return Val('object', 'ray.remote_function.RemoteFunction')

    def call_args(self, node, callee: str) -> dict:
        "The keywords, positional count and keyword-dict sources of a call of `callee`"
        names, sources = [], set()
        for k in node.keywords:
            if k.arg is not None:
                names.append(k.arg)
                self.nested(k, callee)
                continue
            keys, srcs, unresolved = self.dict_keys(k.value)
            names += sorted(keys)
            sources |= srcs
            if unresolved and (self.func, ast.unparse(k.value)) not in UNCHECKED:
                self.problem(
                    node,
                    f"cannot classify the keywords of `**{ast.unparse(k.value)}` passed to {callee}: build them with "
                    "dict(...) here, or declare their source in KWARGS or UNCHECKED in cluster/pinned_api.py",
                )
        starred = any(isinstance(a, ast.Starred) for a in node.args)
        positional = sum(not isinstance(a, ast.Starred) for a in node.args)
        return dict(keywords=tuple(names), positional=positional, starred=starred, sources=tuple(sorted(sources)))

    def nested(self, keyword, callee: str):
        target = NESTED_KWARGS.get((callee, keyword.arg))
        if target is not None:
            keys, _, _ = self.dict_keys(keyword.value)
            self.ref(keyword.value, target, call=True, keywords=tuple(sorted(keys)))

    def dict_keys(self, node, seen=None) -> tuple:
        "(keys, declared sources, unresolved parts) of a dict expression, as far as the source shows them"
        seen = set() if seen is None else seen
        keys, sources, unresolved = set(), set(), []

        def add(parts):
            keys.update(parts[0])
            sources.update(parts[1])
            unresolved.extend(parts[2])

        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == 'dict':
            keys |= {k.arg for k in node.keywords if k.arg}
            for part in [k.value for k in node.keywords if k.arg is None] + node.args:
                add(self.dict_keys(part, seen))
        elif isinstance(node, ast.Dict):
            keys |= {const_str(k) for k in node.keys if const_str(k)}
            for k, v in zip(node.keys, node.values):
                if k is None:
                    add(self.dict_keys(v, seen))
        elif isinstance(node, ast.IfExp):
            add(self.dict_keys(node.body, seen))
            add(self.dict_keys(node.orelse, seen))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            add(self.dict_keys(node.left, seen))
            add(self.dict_keys(node.right, seen))
        elif isinstance(node, ast.Lambda):
            add(self.dict_keys(node.body, seen))
        elif isinstance(node, ast.Name) or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            add(self.name_keys(node, seen))
        else:
            unresolved.append(node)
        return keys, sources, unresolved

    def name_keys(self, node, seen: set) -> tuple:
        "dict_keys of a name (or a call of one): a declared source, a keyword dict, or what was assigned to it"
        call = isinstance(node, ast.Call)
        name = node.func.id if call else node.id
        if name in KWARGS:
            return set(), {KWARGS[name]}, []
        val = self.lookup(name)
        if not call and val is not None and val.kind == 'kwargs':
            return set(), {val.path}, []
        exprs, keys = self.assigned(name)
        if not exprs or name in seen:
            return set(), set(), [node]
        out = (set(keys), set(), [])
        for e in exprs:
            if call and not isinstance(e, ast.Lambda):
                return set(), set(), [node]
            part = self.dict_keys(e, seen | {name})
            out = (out[0] | part[0], out[1] | part[1], out[2] + part[2])
        return out

    def assigned(self, name: str) -> tuple:
        "The expressions assigned to `name` (local first, then module constants) and the keys stored into it"
        for scope in reversed(self.scopes):
            if name in scope.exprs:
                return scope.exprs[name], scope.keys.get(name, set())
        return self.consts.get(name, []), set()

    def kwargs_sources(self):
        "The keys of every declared keyword dict this module builds, as keywords of the callable they are for"
        for node in self.tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                if node.targets[0].id in KWARGS:
                    keys, _, _ = self.dict_keys(node.value)
                    self.ref(node, KWARGS[node.targets[0].id], call=True, keywords=tuple(sorted(keys)))
        for fn in ast.walk(self.tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qual = f'{patched_class(fn)}.{fn.name}' if patched_class(fn) else fn.name
                if qual in KWARGS:
                    self.ref(fn, KWARGS[qual], call=True, keywords=tuple(sorted(returned_keys(self, fn))))


def returned_keys(walker: Walker, fn) -> set:
    "The keys of the dicts `fn` returns (its locals' assignments followed; arguments passed in are not its keys)"
    scope = Scope()
    for node in ast.walk(fn):
        for t in targets(node):
            if isinstance(t, ast.Name):
                scope.exprs.setdefault(t.id, []).append(node.value)
            elif isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and const_str(t.slice):
                scope.keys.setdefault(t.value.id, set()).add(const_str(t.slice))
    walker.scopes.append(scope)
    keys = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Return) and node.value is not None:
            keys |= walker.dict_keys(node.value)[0]
    walker.scopes.pop()
    return keys


def module_consts(tree: ast.Module) -> dict:
    "Module-level name -> the expressions assigned to it"
    out = {}
    for node in tree.body:
        for t in targets(node):
            if isinstance(t, ast.Name) and getattr(node, 'value', None) is not None:
                out.setdefault(t.id, []).append(node.value)
    return out


def const_str(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def walk_source(path: str, source: str, kind_of, classes: set = frozenset()) -> tuple:
    "(references, problems) of one module's source; `path` names it in messages"
    w = Walker(path, source, kind_of, classes).run()
    return w.refs, w.problems


def project_sources(root: Path = ROOT) -> dict:
    "molt_nb's modules: 'molt_nb/x.py' -> source"
    return {
        f'molt_nb/{p.name}': p.read_text() for p in sorted((root / 'molt_nb').glob('*.py')) if p.name != '_modidx.py'
    }


def walk_project(kind_of, sources: dict | None = None) -> tuple:
    "(references, problems) of all of molt_nb"
    sources = project_sources() if sources is None else sources
    classes = project_classes(sources)
    refs, problems = [], []
    for path, src in sources.items():
        r, p = walk_source(path, src, kind_of, classes)
        refs += r
        problems += p
    return refs, problems


# ---------------------------------------------------------------------------------------------------------------------
# The checker: references against the symbols


def json_kind_of(symbols: dict):
    "`kind_of` answered from pinned_api.json's symbols"
    return lambda name: symbols.get(name, {}).get('kind')


def check_refs(refs: list, symbols: dict) -> list:
    "Problems (file, line, message) of `refs` against `symbols`: a missing name, keyword, or too many positionals"
    problems = []
    for r in refs:
        entry = symbols.get(r.name)
        if entry is None:
            problems.append(
                (
                    r.file,
                    r.line,
                    f"{r.name} is not in cluster/pinned_api.json: if the pinned wheel has it, run "
                    "`.venv/bin/python cluster/pinned_api.py write` (it says so when the wheel lacks it)",
                )
            )
        elif r.call:
            problems += [(r.file, r.line, m) for m in check_call(r, entry)]
    return sorted(set(problems))


def check_call(r: Ref, entry: dict) -> list:
    "What is wrong with calling `entry` as `r` does"
    if 'params' not in entry:
        return [f"{r.name} ({entry['kind']}) is called, but the pinned source gives it no signature to check against"]
    out = []
    bad = sorted(set(r.keywords) - set(entry['params']))
    if bad and not entry['varkw']:
        out.append(f"{r.name} takes no keyword {', '.join(bad)} (pinned: {entry.get('defined', '?')})")
    if r.positional > entry['positional'] and not entry['varargs'] and not r.starred:
        out.append(f"{r.name} takes {entry['positional']} positional arguments, {r.positional} given")
    for s in r.sources:
        if s != r.name:
            out.append(f"keyword arguments built for {s} are passed to {r.name}")
    return out


def format_problems(problems: list) -> str:
    return '\n'.join(f"  {f}:{line}: {m}" for f, line, m in problems)


# ---------------------------------------------------------------------------------------------------------------------
# The wheels' sources


def pins(root: Path = ROOT) -> dict:
    "top-level package -> the version its constraints file pins"
    out = {}
    for top, (dist, path) in LIBS.items():
        m = re.search(rf'^{re.escape(dist)}==(\S+)', (root / path).read_text(), re.M)
        if not m:
            raise SystemExit(f"{path} pins no {dist}==VERSION: run `make gpu-constraints`, or fix LIBS")
        out[top] = m.group(1)
    return out


def fetch_wheels(versions: dict) -> dict:
    "top-level package -> its pinned wheel in .pinned-wheels/ (downloaded once, with pip, without dependencies)"
    CACHE.mkdir(exist_ok=True)
    out = {}
    for top, version in versions.items():
        dist = LIBS[top][0]
        pattern = f"{dist.replace('-', '_')}-{version}-*.whl"
        if not list(CACHE.glob(pattern)):
            cmd = [sys.executable, '-m', 'pip', 'download', '-q', '--no-deps', f'{dist}=={version}', '-d', str(CACHE)]
            subprocess.run(cmd + PLATFORM_ARGS.get(top, []), check=True)
        found = sorted(CACHE.glob(pattern))
        if not found:
            raise SystemExit(f"pip downloaded no wheel matching {pattern} into {CACHE}: check the pin and the network")
        out[top] = found[0]
    return out


class Wheels:
    "The sources of the pinned wheels, read from the zip files"

    def __init__(self, paths: dict):
        self.zips = {top: zipfile.ZipFile(p) for top, p in paths.items()}
        self.names = {top: set(z.namelist()) for top, z in self.zips.items()}
        self.trees, self.found = {}, {}

    def has(self, rel: str) -> bool:
        return rel in self.names.get(rel.split('/')[0], ())

    def text(self, rel: str) -> str:
        return self.zips[rel.split('/')[0]].read(rel).decode()

    def tree(self, rel: str) -> ast.Module:
        if rel not in self.trees:
            self.trees[rel] = ast.parse(self.text(rel))
        return self.trees[rel]

    def module_file(self, dotted: str) -> str | None:
        base = dotted.replace('.', '/')
        for rel in (f'{base}.py', f'{base}/__init__.py', f'{base}.pyi'):
            if self.has(rel):
                return rel
        return None

    def binary(self, dotted: str) -> str | None:
        base = dotted.replace('.', '/')
        return next(
            (
                n
                for n in sorted(self.names.get(dotted.split('.')[0], ()))
                if re.fullmatch(rf'{re.escape(base)}(\.[\w-]+)?\.so', n)
            ),
            None,
        )

    def files_under(self, folder: str) -> list:
        return sorted(n for n in self.names.get(folder.split('/')[0], ()) if n.startswith(folder) and n.endswith('.py'))


@dataclass
class Found:
    "A definition in a wheel"

    kind: str  # 'module' | 'class' | 'function' | 'attribute' | 'object' | 'compiled' | 'protobuf'
    module: str  # the dotted module it is defined in
    file: str
    node: object = None  # the ast node (a compiled or protobuf member: its signature or descriptor)
    owner: 'Found' = None  # a method's class; an object's class
    proto: str = ''  # a protobuf message's dotted name ('' the module)
    sig: str = ''  # a compiled function's signature, as Cython embeds it


class Resolver:
    "Library dotted names -> their definitions in the wheels, following re-exports and inheritance"

    def __init__(self, wheels: Wheels):
        self.w, self.cache = wheels, {}

    def find(self, dotted: str) -> Found | None:
        if dotted not in self.cache:
            self.cache[dotted] = None  # a re-export cycle finds nothing
            self.cache[dotted] = self._find(dotted)
        return self.cache[dotted]

    def _find(self, dotted: str) -> Found | None:
        head, _, attr = dotted.rpartition('.')
        if not head:
            return self.module(dotted)
        parent = self.find(head)
        if parent is None:
            return None
        if parent.kind == 'module':
            return self.module_member(parent, attr, dotted)
        if parent.kind == 'class':
            return self.class_member(parent, attr, set())
        if parent.kind == 'object':
            return self.class_member(parent.owner, attr, set())
        if parent.kind == 'compiled':
            return self.compiled_member(parent, attr)
        if parent.kind == 'protobuf':
            return protobuf_member(parent, attr)
        return None

    def module(self, dotted: str) -> Found | None:
        rel = self.w.module_file(dotted)
        if rel is not None:
            return Found('module', dotted, rel, self.w.tree(rel))
        folder = dotted.replace('.', '/') + '/'
        if self.w.files_under(folder):  # a namespace package (no __init__.py)
            return Found('module', dotted, folder, ast.Module(body=[], type_ignores=[]))
        so = self.w.binary(dotted)
        return Found('compiled', dotted, so, '') if so else None

    def module_member(self, mod: Found, name: str, dotted: str) -> Found | None:
        stmt = last_binding(mod.node, name)
        if stmt is not None:
            found = self.from_statement(mod, stmt, name)
            if found is not None:
                return found
        target = lazy_target(mod.node, name)
        if target is not None:
            return self.find(absolute(mod, target))
        submodule = self.module(dotted)
        if submodule is not None:
            return submodule
        if mod.file.endswith('_pb2.py'):
            return protobuf_member(Found('protobuf', mod.module, mod.file, descriptor(mod.node)), name)
        so = self.w.binary(mod.module)
        return self.compiled_member(Found('compiled', mod.module, so, ''), name) if so else None

    def from_statement(self, mod: Found, stmt, name: str) -> Found | None:
        "What a module-level statement binds `name` to"
        if isinstance(stmt, ast.ClassDef):
            return Found('class', mod.module, mod.file, stmt)
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Found('function', mod.module, mod.file, stmt)
        if isinstance(stmt, ast.ImportFrom):
            alias = next(a for a in stmt.names if (a.asname or a.name) == name)
            source = absolute(mod, '.' * stmt.level + (stmt.module or ''))
            return self.find(f'{source}.{alias.name}') if source else self.module(alias.name)
        if isinstance(stmt, ast.Import):
            alias = next(a for a in stmt.names if (a.asname or a.name.split('.')[0]) == name)
            return self.module(alias.name if alias.asname else alias.name.split('.')[0])
        value = getattr(stmt, 'value', None)
        if isinstance(value, ast.Call):
            cls = self.in_scope(mod, value.func)
            if cls is not None and cls.kind == 'class':
                return Found('object', mod.module, mod.file, stmt, owner=cls)
        return Found('attribute', mod.module, mod.file, stmt)

    def in_scope(self, mod: Found, expr) -> Found | None:
        "What a name or dotted expression in module `mod` refers to"
        if isinstance(expr, ast.Subscript):  # Generic[T], a parametrised base
            return self.in_scope(mod, expr.value)
        if isinstance(expr, ast.Name):
            stmt = last_binding(mod.node, expr.id)
            return self.from_statement(mod, stmt, expr.id) if stmt is not None else None
        if isinstance(expr, ast.Attribute):
            base = self.in_scope(mod, expr.value)
            if base is not None and base.kind == 'module':
                return self.find(f'{base.module}.{expr.attr}')
        return None

    def class_member(self, cls: Found, name: str, seen: set) -> Found | None:
        "`name` in `cls`'s body, its instances' `self.name` assignments, or its bases (in order)"
        if id(cls.node) in seen:
            return None
        seen.add(id(cls.node))
        stmt = last_binding(cls.node, name, cls_body=True)
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kind = 'attribute' if has_decorator(stmt, 'property', 'cached_property') else 'function'
            return Found(kind, cls.module, cls.file, stmt, owner=cls)
        if stmt is not None:
            return Found('class' if isinstance(stmt, ast.ClassDef) else 'attribute', cls.module, cls.file, stmt, cls)
        assigned = self_assignment(cls.node, name)
        if assigned is not None:
            return Found('attribute', cls.module, cls.file, assigned, owner=cls)
        for base in self.bases(cls):
            found = self.class_member(base, name, seen)
            if found is not None:
                return found
        return None

    def bases(self, cls: Found) -> list:
        mod = self.module(cls.module)
        return [b for b in (self.in_scope(mod, e) for e in cls.node.bases) if b is not None and b.kind == 'class']

    def mro(self, cls: Found) -> list:
        out, todo = [], [cls]
        while todo:
            c = todo.pop(0)
            if all(c.node is not o.node for o in out):
                out.append(c)
                todo += self.bases(c)
        return out

    def compiled_member(self, parent: Found, name: str) -> Found | None:
        """A name of a compiled (Cython) module (parent.node: '' the module, else a class's name in it), proven by
        the signature or the qualified name Cython embeds in the binary"""
        data = self.w.zips[parent.file.split('/')[0]].read(parent.file)
        local = f'{parent.node}.{name}' if parent.node else name
        m = re.search(rb'\x00(' + re.escape(local.encode()) + rb'\([^)\x00]*\))[\x00\n]', data)
        if m:
            return Found('compiled', parent.module, parent.file, local, sig=m.group(1).decode())
        if f'{parent.module}.{local}'.encode() + b'\x00' in data or b'\x00' + local.encode() + b'\x00' in data:
            return Found('compiled', parent.module, parent.file, local)
        return None


def last_binding(scope, name: str, cls_body: bool = False):
    "The last statement of a module or class body (inside if/try blocks too) that binds `name`"
    found = None
    for stmt in scope.body:
        for s in flatten_blocks(stmt):
            if binds(s, name) and not has_decorator(s, 'overload'):
                found = s
    return found


def flatten_blocks(stmt) -> list:
    if isinstance(stmt, (ast.If, ast.Try)):
        blocks = [stmt.body, stmt.orelse] + [h.body for h in getattr(stmt, 'handlers', [])]
        blocks.append(getattr(stmt, 'finalbody', []))
        return [s for block in blocks for b in block for s in flatten_blocks(b)]
    return [stmt]


def binds(stmt, name: str) -> bool:
    if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return stmt.name == name
    if isinstance(stmt, ast.ImportFrom):
        return any((a.asname or a.name) == name for a in stmt.names)
    if isinstance(stmt, ast.Import):
        return any((a.asname or a.name.split('.')[0]) == name for a in stmt.names)
    return any(isinstance(t, ast.Name) and t.id == name for t in targets(stmt))


def has_decorator(stmt, *names) -> bool:
    for d in getattr(stmt, 'decorator_list', ()):
        d = d.func if isinstance(d, ast.Call) else d
        if (d.attr if isinstance(d, ast.Attribute) else getattr(d, 'id', None)) in names:
            return True
    return False


def self_assignment(cls: ast.ClassDef, name: str):
    "The first `self.name = ...` (or annotated) in a method of `cls`"
    for fn in cls.body:
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if any(is_self_attr(t) and t.attr == name for t in targets(node)):
                    return node
    return None


def lazy_target(tree: ast.Module, name: str) -> str | None:
    "A package's lazily exported name (a module-level dict of name -> 'module:attr' or (module, attr)), or None"
    for stmt in tree.body:
        value = getattr(stmt, 'value', None)
        if not isinstance(value, ast.Dict):
            continue
        for k, v in zip(value.keys, value.values):
            if const_str(k) != name:
                continue
            if const_str(v) and ':' in const_str(v):
                return const_str(v).replace(':', '.')
            if isinstance(v, ast.Tuple) and len(v.elts) == 2 and all(const_str(e) for e in v.elts):
                return '.'.join(const_str(e) for e in v.elts)
    return None


def absolute(mod: Found, target: str) -> str:
    "A relative module name (leading dots) made absolute from module `mod`"
    level = len(target) - len(target.lstrip('.'))
    if not level:
        return target
    package = mod.module.split('.')
    if not mod.file.endswith('__init__.py'):
        package = package[:-1]
    base = package[: len(package) - level + 1]
    rest = target[level:]
    return '.'.join(base + ([rest] if rest else []))


# --- protobuf modules: their classes are built at import from a serialized descriptor, which is read here


def descriptor(tree: ast.Module) -> dict:
    "A _pb2 module's messages and enums: dotted name ('' the file) -> dict(fields=..., members=...)"
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, 'attr', '') == 'AddSerializedFile':
            return proto_names(fields_of(ast.literal_eval(node.args[0])), '')
    return {}


def fields_of(data: bytes) -> list:
    "(field number, value) pairs of a protobuf message: varints as ints, length-delimited as bytes"
    out, i = [], 0
    while i < len(data):
        key, i = varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = varint(data, i)
        elif wire == 2:
            size, i = varint(data, i)
            value, i = data[i : i + size], i + size
        else:
            value, i = None, i + {1: 8, 5: 4}[wire]
        out.append((number, value))
    return out


def varint(data: bytes, i: int) -> tuple:
    value, shift = 0, 0
    while True:
        b = data[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if b < 0x80:
            return value, i


def proto_names(fields: list, name: str) -> dict:
    """A FileDescriptorProto's (name '') or DescriptorProto's names: its fields, and its members as Python shows them
    (nested messages and enums, and the values of its enums)"""
    is_file = name == ''
    messages = [fields_of(v) for n, v in fields if n == (4 if is_file else 3)]
    enums = [fields_of(v) for n, v in fields if n == (5 if is_file else 4)]
    values = [name_of(fields_of(v)) for e in enums for n, v in e if n == 2]
    out = {
        name: dict(
            fields=[] if is_file else [name_of(fields_of(v)) for n, v in fields if n == 2],
            members=sorted({name_of(m) for m in messages + enums} | set(values)),
        )
    }
    prefix = f'{name}.' if name else ''
    for e in enums:
        out[prefix + name_of(e)] = dict(fields=[], members=[name_of(fields_of(v)) for n, v in e if n == 2])
    for m in messages:
        out |= proto_names(m, prefix + name_of(m))
    return out


def name_of(fields: list) -> str:
    return next(v.decode() for n, v in fields if n == 1)


def protobuf_member(parent: Found, name: str) -> Found | None:
    "A message or enum of a _pb2 module, a nested one, or an enum value"
    names = parent.node
    full = f'{parent.proto}.{name}' if parent.proto else name
    if full in names:
        return Found('protobuf', parent.module, parent.file, names, proto=full)
    if name in names.get(parent.proto, {}).get('members', ()):
        return Found('attribute', parent.module, parent.file)
    return None


# ---------------------------------------------------------------------------------------------------------------------
# Symbols: what the JSON says of each name


def entry_of(r: Resolver, name: str, found: Found) -> dict:
    "The JSON entry of a found name: its kind, where it is defined, and how it can be called"
    if found.kind == 'module':
        return dict(kind='module', defined=found.file)
    if found.kind == 'compiled':
        return compiled_entry(found)
    if found.kind == 'protobuf':
        fields = found.node[found.proto]['fields']  # a message takes its fields as keywords only
        return dict(kind='class', defined=found.file, protobuf=found.proto, **signature_of([], fields, [], False))
    line = getattr(found.node, 'lineno', None)
    out = dict(kind=found.kind, defined=f'{found.file}:{line}' if line else found.file)
    if name in CALLABLE:
        return out | signature_of([], [], [], True, True) | dict(takes=CALLABLE[name])
    if name in KEYWORD_TABLES:
        return out | function_signature(found.node, found.owner is not None) | keyword_table(r, KEYWORD_TABLES[name])
    if found.kind == 'function':
        return out | function_signature(found.node, found.owner is not None)
    if found.kind == 'class':
        return out | class_signature(r, found)
    return out


def signature_of(positional: list, keywords: list, posonly: list, varargs: bool, varkw: bool = False) -> dict:
    return dict(
        params=list(positional) + [k for k in keywords if k not in positional],
        positional=len(posonly) + len(positional),
        varargs=varargs,
        varkw=varkw,
    )


def function_signature(fn, method: bool) -> dict:
    "Keyword names, positional count and */** of a def (a method's self or cls left out)"
    a = fn.args
    posonly, args = [p.arg for p in a.posonlyargs], [p.arg for p in a.args]
    if method and not has_decorator(fn, 'staticmethod'):
        (posonly if posonly else args).pop(0)
    return signature_of(args, [p.arg for p in a.kwonlyargs], posonly, a.vararg is not None, a.kwarg is not None)


def class_signature(r: Resolver, cls: Found) -> dict:
    "How a class is called: its dataclass (or msgspec Struct) fields, else the nearest __init__ of its bases"
    for c in r.mro(cls):
        if is_fieldclass(c.node):
            return fields_signature(r, cls)
        init = last_binding(c.node, '__init__', cls_body=True)
        if isinstance(init, ast.FunctionDef):
            return dict(function_signature(init, True), init=f'{c.file}:{init.lineno}')
    return {}


def is_fieldclass(node: ast.ClassDef) -> bool:
    "A class whose __init__ is generated from its annotated fields: a dataclass or a msgspec Struct"
    if has_decorator(node, 'dataclass'):
        return True
    return any(ast.unparse(b).endswith('Struct') or ast.unparse(b).endswith('BaseModel') for b in node.bases)


def fields_signature(r: Resolver, cls: Found) -> dict:
    "The generated __init__ of a dataclass: fields of its dataclass bases first (kw_only ones keyword-only)"
    positional, keywords = [], []
    for c in reversed(r.mro(cls)):
        if not is_fieldclass(c.node):
            continue
        kw_only = class_option(c.node, 'kw_only')
        for stmt in c.node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            ann, name = ast.unparse(stmt.annotation), stmt.target.id
            if ann.endswith('KW_ONLY'):
                kw_only = True
            elif 'ClassVar' not in ann and field_option(stmt.value, 'init', True) is not False:
                (keywords if kw_only or field_option(stmt.value, 'kw_only', False) else positional).append(name)
    keywords = [k for k in keywords if k not in positional]
    return dict(signature_of(positional, keywords, [], False), fields=sorted(set(positional + keywords)))


def class_option(node: ast.ClassDef, option: str) -> bool:
    "A dataclass decorator's or msgspec class keyword's boolean option"
    calls = [d for d in node.decorator_list if isinstance(d, ast.Call)]
    kws = [k for c in calls for k in c.keywords] + list(node.keywords)
    return any(k.arg == option and getattr(k.value, 'value', False) is True for k in kws)


def field_option(value, option: str, default):
    if isinstance(value, ast.Call) and ast.unparse(value.func).split('.')[-1] in ('field', 'Field'):
        for k in value.keywords:
            if k.arg == option and isinstance(k.value, ast.Constant):
                return k.value.value
    return default


def keyword_table(r: Resolver, dotted: str) -> dict:
    "The option names a **kwargs function checks its keywords against (a module-level dict of them)"
    found = r.find(dotted)
    if found is None or found.kind != 'attribute':
        raise SystemExit(f"KEYWORD_TABLES names {dotted}, which the pinned wheel does not define: update the table")
    keys = dict_literal_keys(r, r.module(found.module), found.node.value)
    return dict(params=sorted(keys), varkw=False, keys_from=dotted)


def dict_literal_keys(r: Resolver, mod: Found, value) -> set:
    "The keys of a module-level dict literal, its ** parts followed within the module"
    keys = set()
    for k, v in zip(value.keys, value.values):
        if k is not None:
            keys.add(const_str(k))
        elif isinstance(v, ast.Name):
            keys |= dict_literal_keys(r, mod, last_binding(mod.node, v.id).value)
    return keys


def compiled_entry(found: Found) -> dict:
    "A name of a compiled module: a signature Cython embedded (`Class.method(self, a, b)`) or its qualified name"
    text = found.sig
    if not text:
        return dict(kind=kind_of_found(found), compiled=True, defined=found.file)
    params = [p.strip().split(' ')[-1].split('=')[0] for p in text[text.index('(') + 1 : -1].split(',') if p.strip()]
    params = [p for p in params if p != 'self']
    star = [p for p in params if p.startswith('*')]
    plain = [p for p in params if not p.startswith('*')]
    return dict(
        kind='function',
        compiled=True,
        defined=found.file,
        signature=text,
        **signature_of(
            plain,
            [],
            [],
            any(p.startswith('*') and not p.startswith('**') for p in star),
            any(p.startswith('**') for p in star),
        ),
    )


def kind_of_found(found: Found) -> str:
    "The kind the walker sees: a compiled name is a module, a function (it has a signature) or a class"
    if found.kind == 'protobuf':
        return 'class'
    if found.kind == 'compiled':
        return 'function' if found.sig else 'class' if found.node else 'module'
    return found.kind


class WheelKinds:
    "`kind_of` answered from the wheels, remembering every name asked (the JSON keeps exactly those)"

    def __init__(self, resolver: Resolver):
        self.r, self.asked = resolver, set()

    def __call__(self, name: str) -> str | None:
        self.asked.add(name)
        found = self.r.find(name)
        return None if found is None else kind_of_found(found)


def build(wheels: Wheels, versions: dict, sources: dict | None = None) -> tuple:
    "(the JSON document, the names the wheels lack, problems of molt_nb's references)"
    resolver = Resolver(wheels)
    kinds = WheelKinds(resolver)
    refs, problems = walk_project(kinds, sources)
    names = kinds.asked | {r.name for r in refs}
    symbols, missing = {}, []
    for name in sorted(names):
        found = resolver.find(name)
        if found is None:
            missing.append(name)
        else:
            symbols[name] = entry_of(resolver, name, found)
    facts = [prove(wheels, f) for f in FACTS]
    doc = dict(pins=dict(sorted(versions.items())), symbols=symbols, facts=facts)
    return doc, missing, problems + check_refs(refs, symbols)


def prove(wheels: Wheels, fact: dict) -> dict:
    "The fact with where its snippet is (file:line); SystemExit when the snippet is not where the fact says"
    files = wheels.files_under(fact['file']) if fact['file'].endswith('/') else [fact['file']]
    hits = [(f, wheels.text(f).find(fact['contains'])) for f in files if wheels.has(f)]
    hits = [(f, wheels.text(f)[:i].count('\n') + 1) for f, i in hits if i >= 0]
    if fact.get('absent'):
        if hits:
            raise FactBroken(f"fact {fact['id']}: {fact['contains']!r} now appears in {hits[0][0]}:{hits[0][1]}")
        return dict(fact)
    if not hits:
        raise FactBroken(
            f"fact {fact['id']} ({fact['says']}): {fact['contains']!r} is not in {fact['file']} of the pinned wheel: "
            "read what the new version does, then update the fact (and the code that relies on it)"
        )
    return dict(fact, found=f'{hits[0][0]}:{hits[0][1]}')


class FactBroken(Exception):
    pass


def dumps(doc: dict) -> str:
    return json.dumps(doc, indent=1, sort_keys=True) + '\n'


def main(argv: list) -> int:
    if argv[1:] not in (['write'], ['check']):
        print(__doc__)
        return 2
    versions = pins()
    try:
        doc, missing, problems = build(Wheels(fetch_wheels(versions)), versions)
    except FactBroken as e:
        print(f"FAILED: {e}")
        return 1
    if missing:
        print("molt_nb uses names the pinned wheels do not have:\n  " + '\n  '.join(missing))
    if problems:
        print("molt_nb's references that do not match the pinned wheels:\n" + format_problems(problems))
    text = dumps(doc)
    if argv[1] == 'write':
        API_JSON.write_text(text)
        print(f"wrote {API_JSON.relative_to(ROOT)}: {len(doc['symbols'])} names, {len(doc['facts'])} facts")
        return 0
    old = API_JSON.read_text() if API_JSON.exists() else ''
    if old == text:
        print(f"ok: {API_JSON.relative_to(ROOT)} is what the pinned wheels and molt_nb give")
        return 0
    diff = difflib.unified_diff(old.splitlines(), text.splitlines(), 'committed', 'regenerated', lineterm='', n=2)
    print('\n'.join(diff))
    print(
        f"FAILED: {API_JSON.relative_to(ROOT)} differs from what the pinned wheels and molt_nb give (above): review "
        "the diff, then `.venv/bin/python cluster/pinned_api.py write` and commit it"
    )
    return 1


if __name__ == '__main__':
    sys.exit(main(sys.argv))
