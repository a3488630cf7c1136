"""NVIDIA AutoModel 0.7.0 against plain FSDP2 on 2 gloo ranks, on a CPU (`make test-automodel`, in .venv-automodel):
the same tiny Qwen3 (dense) and Qwen3-MoE checkpoint, the same batch, one `PolicyActor` step each. AutoModel's FSDP
modules average their gradients unless the backend makes them sum (gpu-review D6: every gradient 1/dp of the loss's)
and add the MoE load-balancing loss's gradient unless it is off; the routes the trainer uses under replay are the
batch's on both; the weights exported after the step are the same under Hugging Face's names. AutoModel builds on a
CPU with three redirections of its device lookup (cpu_patches.py)."""

import socket, time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from molt_nb.actor import FSDP2Backend, PolicyActor, join_group, leave_group
from molt_nb.automodel import AutoModelBackend, hf_weights
from molt_nb.config import AlgoConfig, OptimConfig
from molt_nb.core import collate
from molt_nb.golden import golden_trajectories
from molt_nb.models import build_tokenizer, load_policy, save_policy, tiny_dense, tiny_moe

WORLD = 2
KINDS = ('dense', 'moe')


def per_expert(name: str, t: torch.Tensor) -> list:
    "transformers' fused experts (E, 2I, H) and (E, H, I) under the checkpoint's per-expert names; others as they are"
    if name.endswith('mlp.experts.gate_up_proj'):
        pre, i = name.removesuffix('gate_up_proj'), t.shape[1] // 2
        return [
            p
            for e in range(len(t))
            for p in ((f'{pre}{e}.gate_proj.weight', t[e, :i]), (f'{pre}{e}.up_proj.weight', t[e, i:]))
        ]
    if name.endswith('mlp.experts.down_proj'):
        return [(f"{name.removesuffix('down_proj')}{e}.down_proj.weight", t[e]) for e in range(len(t))]
    return [(name, t)]


def canonical(actor: PolicyActor, grads: bool) -> dict:
    "{checkpoint name: full tensor} of the actor's gradients or weights (a collective)"
    out = {}
    for n, p in actor.model.named_parameters():
        t = p.grad if grads else p.detach()
        if t is None:
            continue
        t = t.full_tensor() if isinstance(t, DTensor) else t
        pairs = hf_weights(actor.model, [(n, t)]) if isinstance(actor.backend, AutoModelBackend) else per_expert(n, t)
        out |= {k: v.clone() for k, v in pairs}
    return out


def step(actor: PolicyActor, batch) -> dict:
    "Gradients of the step's accumulation, then the step itself: its routes and the weights it leaves"
    adv = actor.advantages(batch)
    actor._accumulate(batch, adv, actor.live_rows(batch, adv))
    grads = canonical(actor, grads=True)
    actor.opt.zero_grad(set_to_none=True)
    result = actor.train_step(batch)
    return dict(grads=grads, routes=result.routes, weights=canonical(actor, grads=False), metrics=result.metrics)


def rank_main(rank: int, port: int, root: str):
    import cpu_patches

    torch.set_num_threads(1)
    dp = join_group(rank, WORLD, port=port, timeout_s=120)
    cpu_patches.apply()
    try:
        out = {}
        for kind in KINDS:
            path, batch = str(Path(root) / kind), collate(golden_trajectories())
            make = lambda backend, model: PolicyActor(  # noqa: E731
                model, AlgoConfig(), OptimConfig(grad_clip=1.0), micro_batch_rows=2, version=5, backend=backend
            )
            automodel = AutoModelBackend(path)
            start = time.perf_counter()
            out[kind] = dict(
                automodel=step(make(automodel, automodel.model), batch), built_s=time.perf_counter() - start
            )
            out[kind]['fsdp2'] = step(make(FSDP2Backend(dp), load_policy(path)[0]), batch)
        torch.save(out, Path(root) / f'rank{rank}.pt')
    finally:
        leave_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.fixture(scope='module')
def ranks(tmp_path_factory):
    "Both backends' step on 2 spawned gloo ranks, for each kind of model; rank 0's results"
    root = tmp_path_factory.mktemp('automodel')
    tok = build_tokenizer()
    # AutoModel's Qwen3-MoE refuses tied embeddings (so do the real ones); the dense one is tied, as Qwen3-1.7B's
    save_policy(tiny_dense(tok), tok, root / 'dense')
    save_policy(tiny_moe(tok, tie_embeddings=False), tok, root / 'moe')
    ctx = mp.spawn(rank_main, args=(free_port(), str(root)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + 300
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail('the 2-rank AutoModel group did not finish in 300 s')
    return torch.load(root / 'rank0.pt', weights_only=False)


@pytest.mark.parametrize('kind', KINDS)
def test_automodel_gradients_are_fsdp2s(ranks, kind):
    "Summed over the ranks, not averaged (D6), and no load-balancing loss: the gradient of the actor's loss"
    am, plain = ranks[kind]['automodel']['grads'], ranks[kind]['fsdp2']['grads']
    assert sorted(am) == sorted(plain)
    ratio = {n: float(am[n].norm() / plain[n].norm()) for n in plain if plain[n].norm() > 0}
    print(f"{kind}: AutoModel/FSDP2 gradient norm ratios {min(ratio.values()):.6f}..{max(ratio.values()):.6f}")
    torch.testing.assert_close(am, plain, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('kind', KINDS)
def test_automodel_steps_to_fsdp2s_weights(ranks, kind):
    "The same loss and, after the step, the same weights under the checkpoint's names (what the engines load)"
    am, plain = ranks[kind]['automodel'], ranks[kind]['fsdp2']
    assert abs(am['metrics']['loss'] - plain['metrics']['loss']) < 1e-5
    torch.testing.assert_close(am['weights'], plain['weights'], rtol=1e-4, atol=1e-6)


def test_automodel_replays_the_batchs_routes(ranks):
    """MoE: where the batch knows a token's experts the trainer used them (agreement 1.0) on both backends, and where
    the routers choose for themselves they choose alike"""
    am, plain = ranks['moe']['automodel'], ranks['moe']['fsdp2']
    assert am['metrics']['routing/agreement'] == plain['metrics']['routing/agreement'] == 1.0
    assert am['metrics']['routing/tokens'] == plain['metrics']['routing/tokens'] > 0
    assert am['routes'] is not None and torch.equal(am['routes'], plain['routes'])
