"""The GPU path's defects found by reading the pinned vLLM, AutoModel and torch sources (shared/reference/gpu-review.md,
D1-D14), each shown on CPU where a CPU can show it: the checkpoint directory handed to AutoModel and vLLM (D1, D13), a
one-rank AutoModel trainer in a process group (D5), bounded waits on the host (D10, D11), groups closed when rebuilt
and a colocated trainer built before its engine (D14), activation checkpointing under routing replay (D7), and chunked
logprobs equal to the full computation in a fraction of its memory (D7)."""

import asyncio, dataclasses, datetime, os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from molt_nb import weight_sync
from molt_nb.actor import DataParallel, FSDP2Backend, PolicyActor, leave_group
from molt_nb.config import AlgoConfig, OptimConfig, build_policy, load_config
from molt_nb.core import collate
from molt_nb.golden import golden_trajectories
from molt_nb.models import build_tokenizer, save_policy, tiny_dense, tiny_moe
from molt_nb.placement import ClusterShape
from molt_nb.routing import RoutingConfig
from measure import profiled_peak

ROOT = Path(__file__).resolve().parents[1]
HUB_ID = 'molt-nb-tests/Qwen3-tiny'


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    "A Hugging Face cache holding `HUB_ID` (a tiny policy saved as its snapshot): the directory it resolves to"
    import huggingface_hub.constants

    repo = tmp_path / 'hub' / f"models--{HUB_ID.replace('/', '--')}"
    snapshot = repo / 'snapshots' / 'abc123'
    save_policy(tiny_dense(build_tokenizer()), build_tokenizer(), snapshot)
    (repo / 'refs').mkdir(parents=True)
    (repo / 'refs' / 'main').write_text('abc123')
    monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_CACHE', str(tmp_path / 'hub'))
    return snapshot


def gpu_config(tmp_path, **sections):
    "The parity recipe on model `HUB_ID`, its sections replaced as given, unchecked (AutoModel and vLLM need CUDA)"
    cfg = load_config(ROOT / 'recipes' / 'parity', [f'run_dir="{tmp_path / "run"}"'])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=HUB_ID))
    return dataclasses.replace(cfg, **{k: dataclasses.replace(getattr(cfg, k), **v) for k, v in sections.items()})


def test_automodel_gets_the_checkpoint_directory_and_a_group_of_one(hub_cache, tmp_path, monkeypatch):
    """One AutoModel trainer rank (recipes/gsm8k_1gpu) joins a world-1 process group before AutoModel builds the policy
    (it raised 'join it first'), from the checkpoint's directory, never the hub id (its config.json was opened under
    'Qwen/Qwen3-8B/'): D1 and D5"""
    import molt_nb.automodel
    from molt_nb.loop import Trainer

    seen = {}

    class AutoModel(FSDP2Backend):  # AutoModel needs CUDA here: a stand-in that builds the policy as it would
        def __init__(self, path, param_dtype=None, activation_checkpointing=False):
            seen.update(
                path=path, group=dist.is_initialized() and dist.get_world_size(), recompute=activation_checkpointing
            )
            self.model = build_policy(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=path)))[0]
            mesh = torch.distributed.device_mesh.init_device_mesh('cpu', (1,))
            super().__init__(DataParallel(0, 1, mesh))

    monkeypatch.setattr(molt_nb.automodel, 'AutoModelBackend', AutoModel)
    cfg = gpu_config(tmp_path, train=dict(backend='automodel', activation_checkpointing=True))
    try:
        trainer = Trainer(cfg)
        assert seen == dict(path=str(hub_cache), group=1, recompute=True)
        trainer.snapshot()
        assert trainer.weights_version == 0 and trainer.weights is not None
    finally:
        leave_group()


def test_vllm_gets_the_checkpoint_directory(hub_cache, tmp_path, monkeypatch):
    "vLLM is started on the checkpoint's directory, never the hub id (D13: it would try the hub on every node)"
    import molt_nb.vllm_engine
    from molt_nb.router import vllm_engine_of

    started = []
    monkeypatch.setattr(
        molt_nb.vllm_engine.VLLMEngine, 'start', classmethod(lambda cls, args, **kw: started.append(args))
    )
    vllm_engine_of(gpu_config(tmp_path, rollout=dict(engine='vllm')), nonce=0)
    assert started[0]['model'] == str(hub_cache)


class Work:
    "A broadcast's work as NCCL's behaves: `wait()` without a timeout only orders streams and returns at once"

    def __init__(self, log: list):
        self.log, self.done = log, False

    def wait(self, timeout=None):
        self.log.append(timeout)
        self.done = self.done or timeout is not None  # only a timed wait blocks the host until the broadcast ends


def test_the_sender_holds_at_most_two_buckets_its_host_has_not_waited_for():
    """NCCL's `Work.wait()` does not block the host: the window of two buckets must wait with a timeout, which does
    (D11: the host packed every bucket of the model before the network drained them); and every wait is bounded (D10)"""
    waits, works = [], []

    class Group:
        rank, device, timeout_s = 0, torch.device('cpu'), 7.0

        def broadcast(self, flat):
            assert sum(not w.done for w in works) < 2, 'a third bucket was packed before the first had left'
            works.append(Work(waits))
            return works[-1]

        def wait(self, work):
            weight_sync.TransportGroup.wait(self, work)

    items = [(f"w{i}", torch.full((1000,), float(i))) for i in range(6)]
    weight_sync.WeightSender('broadcast', Group(), bucket_mb=4000 / 2**20).send(items, 1)
    assert len(works) == 6 and waits and all(t == datetime.timedelta(seconds=7.0) for t in waits)


def test_a_timed_out_nccl_broadcast_raises_instead_of_ending_the_process(monkeypatch):
    """The weight group is built with TORCH_NCCL_ASYNC_ERROR_HANDLING=0 and a watchdog timeout past the host's wait:
    with torch's default (3) the watchdog ends the trainer's process on a timed-out broadcast, so the router could
    never retry without the dead engine (D10). The variable is restored after"""
    seen = {}

    class NCCL:
        class Options:
            _timeout = None

        def __init__(self, store, rank, size, options):
            seen.update(env=os.environ.get('TORCH_NCCL_ASYNC_ERROR_HANDLING'), timeout=options._timeout)

    monkeypatch.setattr(dist, 'ProcessGroupNCCL', NCCL, raising=False)  # a CPU build of torch has none
    monkeypatch.setattr(torch.cuda, 'current_device', lambda: 0)
    monkeypatch.setenv('TORCH_NCCL_ASYNC_ERROR_HANDLING', '3')
    group = weight_sync.join_transport_group('127.0.0.1', weight_sync.free_port(), 0, 1, 'nccl', timeout_s=60)
    assert seen == dict(env='0', timeout=datetime.timedelta(seconds=180)) and group.timeout_s == 60
    assert os.environ['TORCH_NCCL_ASYNC_ERROR_HANDLING'] == '3'


def test_a_rebuilt_group_aborts_the_last_one(monkeypatch):
    "An engine joining a new weight group aborts its last one (D14: every rebuild leaked an NCCL communicator)"
    from molt_nb.engine import TorchEngine
    from molt_nb.router import Intake

    closed = []

    class Old:
        def close(self, abort=False):
            closed.append(abort)

    monkeypatch.setattr('molt_nb.router.join_transport_group', lambda *a: 'new')
    intake = Intake(TorchEngine(tiny_dense(build_tokenizer())))
    try:
        intake.group = Old()
        asyncio.run(intake.join('127.0.0.1', 1, 1, 2, 'gloo', 5))
        assert (closed, intake.group) == ([True], 'new')
    finally:
        intake.engine.close()


def test_a_colocated_trainer_is_built_before_its_engine_starts(monkeypatch, tmp_path):
    """vLLM profiles its GPU's free memory as it starts and refuses to start when another process frees memory
    meanwhile: a colocated run waits for its trainer before it makes an engine (D14)"""
    import ray
    from molt_nb import steering

    events = []

    class Handle:
        def __init__(self, *a, **kw):
            events.append('trainer started')
            self.state = type('M', (), {'remote': lambda _self: 'state-ref'})()

    class Remote:
        def __init__(self, cls):
            self.cls = cls

        def options(self, **kw):
            return self

        def remote(self, *a):
            return Handle()

    monkeypatch.setattr(ray, 'remote', Remote)
    monkeypatch.setattr(ray, 'get', lambda ref, timeout=None: events.append(f'waited for {ref}'))
    monkeypatch.setattr(steering, 'cluster_shape', lambda: ClusterShape.uniform(1, 1, 4))
    monkeypatch.setattr(steering, 'Placement', lambda *a: type('P', (), {'options': lambda self, role, i: {}})())
    cfg = load_config(ROOT / 'recipes' / 'gsm8k_1gpu', [f'run_dir="{tmp_path}"', f'task_options={{data="{tmp_path}"}}'])
    trainer, make_engine, _ = steering.start_processes(cfg, 'run')
    assert events == ['trainer started', 'waited for state-ref'] and make_engine is not None


def golden_batch():
    return collate(golden_trajectories())


def step_grads(kind: str, recompute: bool) -> dict:
    "The gradients of one step's accumulation on the golden batch, routes replayed (MoE), layers recomputed or not"
    torch.manual_seed(0)
    model = (tiny_moe if kind == 'moe' else tiny_dense)(build_tokenizer())
    if recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
    replay = RoutingConfig(replay=True)
    actor = PolicyActor(model, AlgoConfig(), OptimConfig(), micro_batch_rows=4, version=5, routing=replay)
    batch = golden_batch()
    adv = actor.advantages(batch)
    actor._accumulate(batch, adv, actor.live_rows(batch, adv))
    return {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize('kind', ['dense', 'moe'])
def test_activation_checkpointing_keeps_the_gradient_with_routes_replayed(kind):
    """train.activation_checkpointing recomputes each layer in the backward: a MoE layer must route there as its forward
    did (the replayed routes), or the gradient is another model's (the replay was closed before the backward)"""
    plain, recomputed = step_grads(kind, False), step_grads(kind, True)
    assert sorted(plain) == sorted(recomputed)
    torch.testing.assert_close(recomputed, plain, rtol=1e-5, atol=1e-6)


def logprob_pass(model, ids, temperature: float, chunk: int | None):
    "(logprobs, the gradient of the head and embedding) of `ids`' next tokens: in chunks, or the full computation"
    from molt_nb.actor import scoring_head

    model.zero_grad()
    targets = ids[:, 1:]
    if chunk is None:
        logits = model(input_ids=ids).logits[:, :-1].float() / temperature
        lp = -F.cross_entropy(logits.transpose(1, 2), targets, reduction='none')
    else:
        with scoring_head(model, targets, temperature, chunk):
            lp = model(input_ids=ids).logits
    (lp * torch.linspace(0, 1, lp.shape[1])).sum().backward()
    return lp.detach(), model.get_output_embeddings().weight.grad.clone()


@pytest.mark.parametrize('kind', ['dense', 'moe'])
def test_chunked_logprobs_equal_the_full_computation(kind):
    "The same logprobs (within 1e-6 in fp32) and gradient at temperature 0.7, on a dense and a MoE model"
    torch.manual_seed(0)
    model = (tiny_moe if kind == 'moe' else tiny_dense)(build_tokenizer())
    ids = torch.randint(0, model.config.vocab_size, (3, 40))
    full, full_grad = logprob_pass(model, ids, 0.7, None)
    for chunk in (1, 16, 1000):
        lp, grad = logprob_pass(model, ids, 0.7, chunk)
        assert (lp - full).abs().max() < 1e-6
        torch.testing.assert_close(grad, full_grad, rtol=1e-5, atol=1e-5)  # fp32 sums in another order


def test_chunked_logprobs_need_a_chunk_of_the_full_computations_memory():
    """The full computation holds several (positions x vocab) fp32 tensors at once; in chunks of 1/16 of the positions
    the peak is about 1/16 of it (what the head's input and the weight's gradient take is the same in both)"""
    g = torch.Generator().manual_seed(0)
    n, vocab, hidden, chunks = 1024, 8192, 8, 16
    h = torch.randn(n, hidden, generator=g, requires_grad=True)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    t = torch.randint(0, vocab, (n,), generator=g)

    def full():
        lp = -F.cross_entropy(head(h).float() / 0.7, t, reduction='none')
        lp.sum().backward()

    def chunked():
        from molt_nb.actor import ChunkedLogprobs

        ChunkedLogprobs.apply(h, head.weight, t, 0.7, n // chunks, None).sum().backward()

    full_peak, chunk_peak = profiled_peak(full), profiled_peak(chunked)
    ratio = full_peak / chunk_peak
    print(f"peak {full_peak / 2**20:.1f} MiB whole, {chunk_peak / 2**20:.1f} MiB in {chunks} chunks: {ratio:.1f}x")
    assert full_peak > 2 * n * vocab * 4  # several fp32 (positions x vocab) tensors at once
    assert chunks / 2 < ratio < chunks * 2


def test_a_model_that_changes_its_logits_after_the_head_is_refused():
    """Chunked logprobs replace the LM head's output: a model that softcaps or scales the logits after it (Gemma-2,
    Granite, Cohere) would be scored without that, silently; it is refused, naming the field"""
    from molt_nb.actor import output_head

    model = tiny_dense(build_tokenizer())
    assert output_head(model) is model.lm_head
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"transforms its logits after the LM head \(\['final_logit_softcapping'\]\)"):
        output_head(model)


def test_a_forward_that_bypasses_its_head_is_caught():
    "A model computing logits without calling its lm_head module would return them where logprobs were expected"
    from molt_nb.actor import one_per_target

    targets = torch.zeros(2, 5, dtype=torch.long)
    assert one_per_target(torch.zeros(2, 5), targets).shape == (2, 5)
    with pytest.raises(RuntimeError, match=r'returned \(2, 6, 9\) where its LM head gave \(\(2, 5\)\) logprobs'):
        one_per_target(torch.zeros(2, 6, 9), targets)


def test_a_failed_take_closes_its_own_group_not_one_joined_since():
    """A take that fails (a broadcast peer gone) aborts the group it received on; if the router has joined the engine
    to a new group meanwhile (its retry), that one is left alone"""
    from molt_nb.engine import TorchEngine
    from molt_nb.router import Intake

    closed = []

    class Group:
        rank, device, timeout_s = 1, torch.device('cpu'), 1.0

        def __init__(self, name):
            self.name = name

        def broadcast(self, flat):
            intake.group = retry if self.name == 'first' and rejoin else intake.group  # the router's retry joined
            raise RuntimeError('Connection reset by peer')

        def wait(self, work):
            pass

        def close(self, abort=False):
            closed.append((self.name, abort))

    intake = Intake(TorchEngine(tiny_dense(build_tokenizer())))
    manifest = weight_sync.WeightSender('inprocess').manifest(weight_sync.named_weights(intake.engine.model), 1)
    retry = Group('retry')
    try:
        for rejoin in (False, True):
            intake.group, closed = Group('first'), []
            with pytest.raises(RuntimeError, match='reset by peer'):
                asyncio.run(intake.take(manifest, 'broadcast'))
            assert closed == ([] if rejoin else [('first', True)])
            assert intake.group is (retry if rejoin else None)
    finally:
        intake.engine.close()
