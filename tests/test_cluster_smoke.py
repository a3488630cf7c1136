"""cluster/smoke.py's logic on CPU: its four checks over the run's own pieces in this process (the loop's Trainer, a
Router over an EngineActor running VLLMEngine on the CI's stand-in for vLLM, a gloo broadcast for the weight sync),
the report and the exit status; and each check failing when its piece is broken: perturbed logprobs, a weight sync
that drops a tensor, a rollout path that sleeps, shuffled routes."""

import asyncio, dataclasses, json, math, sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'cluster'))
sys.path.insert(0, str(Path(__file__).parent))

import fake_vllm  # noqa: E402
import smoke  # noqa: E402
from engine_contract import policy  # noqa: E402


@pytest.fixture(scope='module')
def rig(tmp_path_factory):
    fake_vllm.install()
    root = tmp_path_factory.mktemp('smoke')
    fp32 = ['rollout.dtype="float32"', f'run_dir="{root}/run"']  # the stand-in's engine and the trainer agree
    dense = smoke.smoke_config(str(policy(False, root).path), 'cpu', fp32)
    moe = smoke.smoke_config(str(policy(True, root).path), 'cpu', fp32)
    r = smoke.local_rig(dense, moe, root=str(root / 'ckpt'))
    yield r
    smoke.close_rig(r)


def run(rig, **kw) -> dict:
    return asyncio.run(smoke.run_checks(rig, rows=6, prompt_len=8, new=12, reps=3, **kw))


class Proxy:
    "An engine that forwards everything to `inner`, with `generate` changed"

    def __init__(self, inner, change):
        self.inner, self.change = inner, change

    async def generate(self, ids, sampling, session_id=None):
        return await self.change(self.inner, ids, sampling)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_every_check_passes_on_the_runs_own_pieces_and_the_report_says_so(rig, tmp_path):
    report = run(rig)
    s = report['sections']
    # the throughput ratio times 0.4 s of decoding: on a loaded 2-core CI machine it read 0.85, 1.25 and 1.04 in three
    # runs, so this test does not judge it (a slowed path failing it is the test below); every other check passes
    assert list(s) == ['logprobs', 'weight_sync', 'throughput', 'r3'] and report['failed'] in ([], ['throughput']), (
        report
    )
    figures = {c['name']: c for r in s.values() for c in r['checks']}
    assert set(figures) == set(smoke.GOALS)
    assert figures['dlogp_mean']['value'] < 1e-4 and figures['k3_kl']['value'] < 1e-6
    assert figures['greedy_identical']['value'] == 1.0 and s['weight_sync']['version'] >= 1
    assert figures['r3_agreement']['value'] == 1.0 and s['r3']['routes'] > 0
    assert figures['r3_dlogp_mean']['value'] < 1e-4
    assert all(set(c) == {'name', 'passed', 'value', 'bound'} for c in figures.values())
    path = tmp_path / 'report.json'
    assert smoke.write_report(report, path) == (0 if report['passed'] else 1)
    assert json.loads(path.read_text())['passed'] is report['passed']


def test_perturbed_logprobs_fail_check_a(rig):
    async def noisy(engine, ids, sampling):
        g = await engine.generate(ids, sampling)
        return dataclasses.replace(g, logprobs=g.logprobs + 0.05 * torch.randn(len(g.logprobs)))

    s = run(dataclasses.replace(rig, engine=Proxy(rig.engine, noisy), moe=None))['sections']
    assert s['logprobs']['passed'] is False, s['logprobs']
    failed = {c['name'] for c in s['logprobs']['checks'] if not c['passed']}
    assert 'dlogp_mean' in failed, s['logprobs']


def test_a_weight_sync_that_drops_a_tensor_fails_check_b(rig, monkeypatch):
    "The broadcast carries every name, but the biggest tensor's new value is dropped: the engine keeps the old one"
    from molt_nb.config import build_policy

    trainer = rig.parts['trainer']
    before = dict(build_policy(trainer.cfg)[0].named_parameters())
    snapshot = trainer._snapshot

    def dropping(version):
        items = list(snapshot(version))
        k = max(range(len(items)), key=lambda i: items[i][1].numel())
        items[k] = (items[k][0], before[items[k][0]].detach().clone())
        return items

    monkeypatch.setattr(trainer, '_snapshot', dropping)
    report = run(dataclasses.replace(rig, moe=None))
    sync = report['sections']['weight_sync']
    assert sync['passed'] is False and report['passed'] is False, sync
    assert sync['checks'][0]['value'] < 1.0, sync


def test_a_rollout_path_that_sleeps_fails_check_c(rig, tmp_path):
    async def slow(engine, ids, sampling):
        await asyncio.sleep(0.5)
        return await engine.generate(ids, sampling)

    report = run(dataclasses.replace(rig, engine=Proxy(rig.engine, slow), moe=None))
    t = report['sections']['throughput']
    assert t['passed'] is False and t['checks'][0]['value'] < 0.9, t
    assert smoke.write_report(report, tmp_path / 'r.json') == 1  # the exit status


def test_shuffled_routes_fail_check_d(rig):
    async def shuffled(
        engine, ids, sampling
    ):  # each token gets its neighbour's experts (the order within top-k is free)
        g = await engine.generate(ids, sampling)
        return dataclasses.replace(g, routes=g.routes.roll(1, dims=0) if g.routes is not None else None)

    moe = dataclasses.replace(rig.moe, engine=Proxy(rig.moe.engine, shuffled))
    r3 = run(dataclasses.replace(rig, moe=moe))['sections']['r3']
    assert r3['passed'] is False, r3
    failed = {c['name'] for c in r3['checks'] if not c['passed']}
    assert failed == {'r3_dlogp_mean'}, r3  # replay itself still works: it replays the wrong experts faithfully


def test_without_a_moe_check_d_is_skipped_not_passed(rig):
    report = run(dataclasses.replace(rig, moe=None))
    assert report['sections']['r3']['passed'] is None and 'r3' not in report['failed']


def test_the_cluster_rig_runs_the_checks_on_ray_actors(ray_local, tmp_path):
    """`ray_rig`, what `main` builds on a cluster: the trainer and two engines as Ray actors placed by the run's
    placement, the weights broadcast between processes, the fresh engine loading what the trainer saved (here the
    torch engine on CPU: the stand-in for vLLM lives in this process only)"""
    from ray import cloudpickle  # Ray's own copy pickles its actor classes

    cloudpickle.register_pickle_by_value(smoke)  # its actor classes travel as code (a script's would anyway)
    cfg = smoke.smoke_config(
        str(policy(False, tmp_path).path), 'cpu', ['rollout.engine="torch"', 'rollout.dtype="float32"']
    )
    rig = smoke.ray_rig(cfg, root=str(tmp_path / 'weights'), name='smoke-test')
    try:
        assert hasattr(rig.parts['trainer'].train_step, 'remote')  # actors, not objects in this process
        report = asyncio.run(smoke.run_checks(rig, rows=4, prompt_len=8, new=8, reps=1))
    finally:
        smoke.close_rig(rig)
    s = report['sections']
    assert s['logprobs']['passed'] and s['weight_sync']['passed'], s
    assert s['weight_sync']['version'] == 1 and len(list((tmp_path / 'weights').iterdir())) == 1
    assert math.isfinite(s['throughput']['checks'][0]['value']), s['throughput']  # on 2 busy cores, not its goal
    assert s['r3']['passed'] is None


def test_a_model_one_gpu_cannot_train_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    """The smoke trains one fp32 rank: Qwen3-8B (its config, from recipes/gsm8k) plans 152 GB and is refused with the
    role and the component before Ray or an engine starts (gpu-review D8: the documented smoke could not pass on an 80
    GB GPU); Qwen3-1.7B's shapes fit"""
    import huggingface_hub.constants

    for hub, recipe in (('Qwen/Qwen3-8B', 'gsm8k'), ('Qwen/Qwen3-1.7B', 'gsm8k_1gpu')):
        snapshot = tmp_path / 'hub' / f"models--{hub.replace('/', '--')}" / 'snapshots' / 'x'
        snapshot.mkdir(parents=True)
        table = json.loads((ROOT / 'recipes' / recipe / 'model_config.json').read_text())
        (snapshot / 'config.json').write_text(json.dumps(table[hub]))
        (snapshot.parents[1] / 'refs').mkdir()
        (snapshot.parents[1] / 'refs' / 'main').write_text('x')
    monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_CACHE', str(tmp_path / 'hub'))
    monkeypatch.setenv('VLLM_BATCH_INVARIANT', '1')  # main sets it for the engines it would start
    monkeypatch.setattr(smoke, 'ray_rig', lambda *a, **kw: pytest.fail('a rig was built for a plan that does not fit'))
    with pytest.raises(SystemExit, match=r'(?s)Qwen/Qwen3-8B does not fit.*trainer 0 plans 15\d\.\d GB.*optimizer'):
        smoke.main(['--dense', 'Qwen/Qwen3-8B', '--report', str(tmp_path / 'r.json')])
    smoke.fits(smoke.smoke_config('Qwen/Qwen3-1.7B', 'cuda', tokens=160))
