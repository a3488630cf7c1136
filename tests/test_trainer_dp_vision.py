"""A 2-rank FSDP2 trainer group (gloo, CPU) training a vision-language policy where one rank's rows all hold images
and the other's none: the vision tower gets gradients on one rank only. FSDP2 would reduce-scatter a different set of
gradients on each rank (a mismatched collective); the backend sets `reduce_scatter_unused_params`, so the ranks send
zeros for the tower. The group's gradients and step equal one process's on the same rows."""

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

from molt_nb.actor import FSDP2Backend, PolicyActor, join_group, leave_group
from molt_nb.config import AlgoConfig, OptimConfig
from molt_nb.core import Segment, Trajectory, collate
from molt_nb.vision import draw_shapes, expand_ids, image_processor, process_images, tiny_vl, vision_tokenizer

from test_trainer_dp import WORLD, spawn_group

TOK, PROC = vision_tokenizer(), image_processor()


def batch():
    """8 rows in 2 groups of 4, rewards 1, 0, 1, 0 (every advantage non-zero, so every row trains): rows 0, 2, 4, 6
    (rank 0's) hold an image, rows 1, 3, 5, 7 (rank 1's) none"""
    g = torch.Generator().manual_seed(0)
    trs = []
    for i in range(8):
        if i % 2 == 0:
            img = draw_shapes([('triangle', (20 * i, 90, 200), (4 + i, 6), 24)], size=(32, 48))
            im = process_images(PROC, [img], TOK)
            ids = expand_ids(TOK, [f'row {i}: ', img, ' what?'], im.grid_thw)
        else:
            im, ids = None, TOK.encode(f'row {i}: only text, what?', add_special_tokens=False)
        sampled = torch.randint(10, 200, (5,), generator=g)
        seg = Segment.prompt(ids, images=im).extend(sampled, torch.full((5,), -4.0), torch.zeros(5, dtype=torch.int32))
        trs.append(Trajectory(f'r{i}', f'g{i // 4}', i // 4, [seg], reward=float(i % 2 == 0)))
    return collate(trs)


def make_actor(dp=None) -> PolicyActor:
    model = tiny_vl(TOK, seed=3)
    backend = dict(backend=FSDP2Backend(dp)) if dp is not None else {}
    return PolicyActor(model, AlgoConfig(), OptimConfig(grad_clip=100.0), micro_batch_rows=2, **backend)


def grads_and_step(actor: PolicyActor) -> dict:
    "The whole model's gradient of one accumulation (gathered under FSDP: a collective), then one step's weights"
    b = batch()
    adv = actor.advantages(b)
    rows = actor.live_rows(b, adv)
    out = dict(rows=rows, micro_batches=actor._micro_batches(b, rows))
    actor._accumulate(b, adv, rows)
    grads = {}
    for n, p in actor.model.named_parameters():
        if p.grad is not None:
            grads[n] = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
    actor.opt.zero_grad(set_to_none=True)
    out['grads'] = grads
    out['metrics'] = actor.train_step(b).metrics
    w = actor.full_weights()
    out['weights'] = None if w is None else {n: t.clone() for n, t in w}
    return out


def rank_main(rank: int, port: int, root: str):
    torch.set_num_threads(1)
    dp = join_group(rank, WORLD, port=port, timeout_s=60)
    try:
        torch.save(grads_and_step(make_actor(dp)), f"{root}/rank{rank}.pt")
    finally:
        leave_group()


@pytest.fixture(scope='module')
def group(tmp_path_factory):
    return spawn_group(rank_main, tmp_path_factory.mktemp('dpv'), 180, 'the 2-rank VLM trainer group')


def test_one_rank_with_images_and_one_without_train_as_one_process(group):
    zero, one = group
    assert zero['micro_batches'] == [[0, 2], [4, 6]] and one['micro_batches'] == [[1, 3], [5, 7]]
    single = grads_and_step(make_actor())
    tower = [n for n in single['grads'] if '.visual.' in n]
    assert tower and all(single['grads'][n].abs().sum() > 0 for n in tower)  # only rank 0's rows reach the tower
    for rank in (zero, one):
        assert sorted(rank['grads']) == sorted(single['grads'])
        for n, g in single['grads'].items():
            assert_close(rank['grads'][n], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    for k, v in single['metrics'].items():
        assert_close(torch.tensor(zero['metrics'][k]), torch.tensor(v), rtol=1e-5, atol=1e-6, msg=k)
    for n, w in single['weights'].items():
        assert_close(zero['weights'][n], w, rtol=1e-5, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
