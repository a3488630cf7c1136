"""The CI's stand-in for vLLM: a `vllm` module with the surface `molt_nb.vllm_engine` uses, over a `TorchEngine`.

`install()` puts it in `sys.modules`; `start(args)` starts a `VLLMEngine` on it. Its `AsyncLLM` runs a real
`TorchEngine` on the checkpoint (so logprobs, routes and weight loads are real numbers), checks the arguments the
real one would take (only `vllm.SamplingParams`' recorded fields, `logprobs=0`, `ignore_eos`, the pinned engine
args) and answers as vLLM 0.32 does: a final `RequestOutput` whose `routed_experts` cover the prompt and the
generation as processed (the last sampled token has no row) and only the MoE layers. `make test-vllm` runs the same
contract on real vLLM.
"""

import asyncio, contextlib, enum, json, sys, types
from pathlib import Path
from types import SimpleNamespace

import torch

# every field of the real vllm.SamplingParams (0.32) with its default; the input fields are those not set by vLLM itself
RECORDED = json.loads((Path(__file__).parent / 'vllm_cpu' / 'sampling_fields.json').read_text())
SAMPLING_FIELDS = [f for f in RECORDED if not f.startswith('_') and f != 'output_text_buffer_length']


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParams:
    "Takes exactly the recorded fields of the real one; a field left out gets its recorded default"

    def __init__(self, **kw):
        unknown = set(kw) - set(RECORDED)
        if unknown:
            raise TypeError(f"SamplingParams got unexpected keyword arguments {sorted(unknown)}")
        self.given = set(kw)
        self.__dict__.update(kw)


# every field of the real vllm.AsyncEngineArgs of the pinned vLLM (read from its wheel by cluster/pinned_api.py)
PINNED_API = Path(__file__).parents[1] / 'cluster' / 'pinned_api.json'
ENGINE_FIELDS = set(json.loads(PINNED_API.read_text())['symbols']['vllm.AsyncEngineArgs']['fields'])


class AsyncEngineArgs:
    "Takes exactly the fields of the pinned vLLM's, as the real dataclass does"

    def __init__(self, **kw):
        unknown = set(kw) - ENGINE_FIELDS
        if unknown:
            raise TypeError(f"AsyncEngineArgs.__init__() got unexpected keyword arguments {sorted(unknown)}")
        self.__dict__.update(kw)
        self.kw = kw


class Worker:
    "What a vLLM worker gives its extension: `rank`, `device`, `vllm_config`, `model_runner.get_model()`"

    def __init__(self, engine):
        self.rank, self.device, self.engine, self.loop = 0, engine.device, engine, None
        self.vllm_config = SimpleNamespace(model_config=None)
        model = Model(self)
        self.model_runner = SimpleNamespace(model=model, get_model=lambda: model)


class Model:
    "vLLM's model surface: `config`, `named_parameters`, `named_modules` and `load_weights(weights) -> names loaded`"

    def __init__(self, worker):
        self.worker, self.config, self.reloads = worker, worker.engine.model.config, []

    def named_parameters(self):
        return self.worker.engine.model.named_parameters()

    def named_modules(self):  # a module with a kernel to rebuild has a quant_method: none here
        return self.worker.engine.model.named_modules()

    def load_weights(self, weights):
        items, e = list(weights), self.worker.engine
        asyncio.run_coroutine_threadsafe(e.load_weights(items, e.version), self.worker.loop).result()
        return {n for n, _ in items}


class RetryableRequestError(Exception):
    "vLLM 0.33's error for a request it refuses while paused ('abort' and 'wait' modes): `vllm.exceptions`"


class AsyncLLM:
    def __init__(self, args: AsyncEngineArgs):
        from molt_nb.engine import TorchEngine
        from molt_nb.models import load_policy
        from molt_nb.vllm_engine import PINNED_ARGS

        for k, v in PINNED_ARGS.items():
            assert args.kw.get(k) == v, f"engine arg {k} = {args.kw.get(k)!r}, expected {v!r}"
        model, _ = load_policy(args.model, getattr(torch, args.dtype))
        self.engine = TorchEngine(
            model, seed=args.seed, max_batch=args.max_num_seqs, max_model_len=args.kw.get('max_model_len')
        )
        self.routes = bool(args.kw.get('enable_return_routed_experts'))
        module, name = args.worker_extension_cls.rsplit('.', 1)
        extension = getattr(__import__(module, fromlist=[name]), name)
        self.worker = type('ExtendedWorker', (Worker, extension), {})(self.engine)
        self.tasks, self.calls, self.label = {}, [], None  # label: the weight version vLLM stamps tokens with
        self.rejecting = False  # as vLLM 0.33 while paused in 'abort' or 'wait' mode: new requests raise
        self.args = args.kw  # what the engine was started with

    @classmethod
    def from_engine_args(cls, args):
        return cls(args)

    async def generate(self, prompt, params, request_id):
        from molt_nb.core import SamplingParams as Ours
        from molt_nb.models import moe_gates

        assert params.given == set(SAMPLING_FIELDS), set(SAMPLING_FIELDS) - params.given
        if self.rejecting:
            raise RetryableRequestError('Generation is paused. Please retry after it resumes.')
        assert params.logprobs == 0 and params.ignore_eos and params.output_kind is RequestOutputKind.FINAL_ONLY
        sp = Ours(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_tokens=params.max_tokens,
            stop_token_ids=tuple(params.stop_token_ids),
        )
        label = self.label
        task = asyncio.ensure_future(self.engine.generate(prompt['prompt_token_ids'], sp))
        self.tasks[request_id] = task
        try:
            g = await task
        except asyncio.CancelledError:
            if task.cancelled() and not asyncio.current_task().cancelling():
                g = None  # aborted by `abort`
            else:
                raise
        finally:
            self.tasks.pop(request_id, None)
        ids = [] if g is None else g.token_ids.tolist()
        lps = [] if g is None else g.logprobs.tolist()
        routed = None
        if self.routes and g is not None and g.routes is not None:
            moe = sorted(moe_gates(self.engine.model))
            routed = g.routes[:-1, moe].numpy()  # as processed: the last sampled token has no row; MoE layers only
        out = SimpleNamespace(
            token_ids=ids,
            logprobs=[{t: SimpleNamespace(logprob=lp, rank=1, decoded_token=None)} for t, lp in zip(ids, lps)],
            finish_reason='abort' if g is None else g.finish_reason,
            routed_experts=routed,
            # vLLM's spans of the label its tokens were sampled under (no load happens while one runs: one span)
            weight_versions=[SimpleNamespace(version=label, start=0, end=len(ids))] if ids and label else None,
        )
        yield SimpleNamespace(request_id=request_id, finished=True, outputs=[out])

    async def abort(self, request_id):
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            task = self.tasks.get(rid)
            if task is not None:
                task.cancel()

    async def update_weight_version(self, version: str):
        self.label = version

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.calls.append(('reset_prefix_cache', reset_running_requests))
        return True

    async def reset_mm_cache(self):
        self.calls.append(('reset_mm_cache',))

    async def reset_encoder_cache(self):
        self.calls.append(('reset_encoder_cache',))

    async def pause_generation(self, mode: str = 'abort', **kw):
        assert mode in ('wait', 'keep', 'abort'), mode
        self.calls.append(('pause', mode))
        await self.engine.pause(keep=mode != 'abort', drain=mode == 'wait')

    async def resume_generation(self):
        self.calls.append(('resume',))
        await self.engine.resume()

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(('rpc', method))
        self.worker.loop = asyncio.get_running_loop()
        return [await asyncio.to_thread(getattr(self.worker, method), *args, **(kwargs or {}))]

    def shutdown(self):
        self.engine.close()


@contextlib.contextmanager
def set_current_vllm_config(config):
    yield


def initialize_layerwise_reload(model):
    model.reloads.append('initialize')


def finalize_layerwise_reload(model, model_config):
    model.reloads.append('finalize')


def stub() -> types.ModuleType:
    "A `vllm` package of the surface above (with its submodules)"
    vllm = types.ModuleType('vllm')
    vllm.config = types.ModuleType('vllm.config')
    vllm.config.set_current_vllm_config = set_current_vllm_config
    reload = types.ModuleType('vllm.model_executor.model_loader.reload')
    reload.initialize_layerwise_reload, reload.finalize_layerwise_reload = (
        initialize_layerwise_reload,
        finalize_layerwise_reload,
    )
    vllm.reload = reload
    vllm.SamplingParams, vllm.AsyncEngineArgs, vllm.__version__ = SamplingParams, AsyncEngineArgs, '0.32.0+fake'
    vllm.sampling_params = types.ModuleType('vllm.sampling_params')
    vllm.sampling_params.RequestOutputKind = RequestOutputKind
    vllm.sampling_params.SamplingParams = SamplingParams
    vllm.v1 = types.ModuleType('vllm.v1')
    vllm.v1.engine = types.ModuleType('vllm.v1.engine')
    vllm.v1.engine.async_llm = types.ModuleType('vllm.v1.engine.async_llm')
    vllm.v1.engine.async_llm.AsyncLLM = AsyncLLM
    vllm.exceptions = types.ModuleType('vllm.exceptions')
    vllm.exceptions.RetryableRequestError = RetryableRequestError
    return vllm


def modules() -> dict:
    "{module name: module} of the stub, for `sys.modules` (or a monkeypatch of it)"
    v = stub()
    return {
        'vllm': v,
        'vllm.sampling_params': v.sampling_params,
        'vllm.v1': v.v1,
        'vllm.v1.engine': v.v1.engine,
        'vllm.v1.engine.async_llm': v.v1.engine.async_llm,
        'vllm.config': v.config,
        'vllm.exceptions': v.exceptions,
        'vllm.model_executor': types.ModuleType('vllm.model_executor'),
        'vllm.model_executor.model_loader': types.ModuleType('vllm.model_executor.model_loader'),
        'vllm.model_executor.model_loader.reload': v.reload,
    }


def install():
    "Put the stub in `sys.modules` (once)"
    if not getattr(sys.modules.get('vllm'), '__version__', '').endswith('+fake'):
        sys.modules.update(modules())


def start(args: dict, **kw):
    "A `VLLMEngine` over the stub's `AsyncLLM` started with engine `args`"
    install()
    from molt_nb.vllm_engine import VLLMEngine

    return VLLMEngine.start(args, **kw)


def torch_engine(engine):
    "The `TorchEngine` a stub-backed `VLLMEngine` runs on"
    return engine.llm.engine


def absent(fn):
    "Call `fn` with vLLM made unimportable"
    saved = {k: v for k, v in sys.modules.items() if k == 'vllm' or k.startswith('vllm.')}
    for k in saved:
        del sys.modules[k]
    sys.modules['vllm'] = None
    try:
        return fn()
    finally:
        del sys.modules['vllm']
        sys.modules.update(saved)
