"""bench/gpu_smoke.py, the script a session runs once on a lent GPU: its logic on CPU (tiny sizes, the CUDA-only parts
skipped with a reason), its exit status, a refused transport pairing recorded rather than raised, and on a CUDA
machine (-m gpu) the full run. Where nbval is missing (the lent GPU machine), the root conftest cannot load:
`python3 -m pytest --noconftest -m gpu tests/test_gpu_smoke.py` there, or run the script itself."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / 'bench' / 'gpu_smoke.py'
CPU_SECTIONS = (
    'logprobs',
    'routing',
    'weight_sync.inprocess',
    'weight_sync.ipc',
    'weight_sync.gloo',
    'fsdp',
    'throughput',
)
CUDA_ONLY = ('weight_sync.gloo_cuda_buffers', 'weight_sync.nccl', 'memory')


def run_script(out: Path, *args, timeout: float) -> tuple:
    "The script's exit status, its records by section, its stdout"
    env = os.environ | {'PYTHONPATH': str(ROOT), 'HF_HUB_OFFLINE': '1', 'TOKENIZERS_PARALLELISM': 'false'}
    p = subprocess.run(
        [sys.executable, str(SCRIPT), '--out', str(out), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = (out / 'gpu_smoke.jsonl').read_text().splitlines()
    return p.returncode, {r['section']: r for r in map(json.loads, lines)}, p.stdout + p.stderr


@pytest.fixture(scope='module')
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp('smoke')
    t0 = time.perf_counter()
    rc, records, log = run_script(out, '--device', 'cpu', '--quick', timeout=120)
    return rc, records, log, time.perf_counter() - t0


@pytest.fixture
def gpu_smoke(monkeypatch):
    "The script as a module (on sys.path for the test: the processes it spawns import it by name)"
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import gpu_smoke

    return gpu_smoke


def test_cpu_run_passes_and_skips_the_cuda_parts(cpu_run):
    rc, rec, log, seconds = cpu_run
    assert rc == 0, log
    # ~25 s on an idle 2-core machine; the margin is for a loaded one
    assert seconds < 90, f"the quick CPU run took {seconds:.0f} s"
    env = rec['environment']
    assert env['device'] == 'cpu' and env['quick'] and env['torch'] and env['transformers']
    assert env['model_forward_takes_cache']  # else TorchEngine's logprobs are wrong (see the script's environment())
    for name in CPU_SECTIONS:
        r = rec[name]
        assert 'error' not in r and 'skipped' not in r, r
        assert r['passed'] and all(c['passed'] for c in r['checks']), r
    for name in CUDA_ONLY:
        assert 'CUDA' in rec[name]['skipped'], rec[name]
    s = rec['summary']
    assert s['failed_checks'] == [] and s['errors'] == [] and sorted(s['skipped']) == sorted(CUDA_ONLY)
    assert s['absent_there_but_imported'] == []
    assert 'summary: 7 passed, 0 failed checks, 0 errors, 3 skipped' in log


def test_cpu_run_figures(cpu_run):
    _, rec, _, _ = cpu_run
    lp = rec['logprobs']
    assert lp['engine_float32_vs_trainer_float32']['tokens'] == lp['rows'] * lp['new_tokens']
    assert lp['engine_float32_vs_trainer_float32']['max'] < 1e-4  # CPU: the summation order alone
    # bf16 rollouts against an fp32 trainer differ measurably (else the figure measures nothing)
    assert 1e-4 < lp['engine_bfloat16_vs_trainer_float32']['mean'] < 0.1
    assert 'engine_bfloat16_vs_trainer_bfloat16' in lp
    for arm in ('engine_bfloat16', 'engine_float32'):
        r = rec['routing'][arm]
        assert r['direct_agreement'] == 1.0 and r['step']['agreement'] == 1.0 and r['direct_tokens'] > 0
        assert 0.5 < r['natural_agreement'] <= 1.0 and 'live_logp_gap_mean' in r['step']
    sync = rec['weight_sync.inprocess']
    assert sync['exact'] and sync['buckets'] > 1 and sync['alone'] and set(sync['dtypes']) >= {'bfloat16', 'float32'}
    assert rec['weight_sync.ipc']['mechanism'].startswith('CPU shared memory')
    sender, receiver = rec['weight_sync.gloo']['ranks']
    assert sender['ok'] and receiver['exact'] and receiver['landed_on'] == ['cpu']
    fsdp = rec['fsdp']
    assert fsdp['backend'] == 'gloo'
    for kind in ('dense', 'moe'):
        assert fsdp[kind]['sharded'].startswith('FSDP')
        # world 1 on CPU: the same arithmetic, bit for bit
        assert fsdp[kind]['fsdp_vs_plain']['bitwise'] and fsdp[kind]['control_vs_plain']['bitwise']
    t = rec['throughput']
    assert t['generate_tok_s'] > 0 and t['engine_tok_s'] > 0 and t['engine_over_generate'] > 0


def test_exit_status_says_what_went_wrong(tmp_path, monkeypatch, gpu_smoke):
    "0 all passed, 1 a check failed (even beside an error), 2 a section raised; each failure recorded, the rest run"

    def ok(device, sizes):
        return dict(checks=[gpu_smoke.check('fine', True, 0.0)])

    def bad(device, sizes):
        return dict(checks=[gpu_smoke.check('exact', False, 0.5, '== 0')])

    def boom(device, sizes):
        raise RuntimeError('kaboom')

    cases = {0: [ok], 1: [boom, bad, ok], 2: [ok, boom]}
    for want, fns in cases.items():
        sections = [(f"s{i}", fn, False) for i, fn in enumerate(fns)]
        monkeypatch.setattr(gpu_smoke, 'SECTIONS', sections + [('cuda', ok, True)])
        out = tmp_path / str(want)
        assert gpu_smoke.main(['--device', 'cpu', '--out', str(out), '--deadline', '60']) == want
        rec = {r['section']: r for r in map(json.loads, (out / 'gpu_smoke.jsonl').read_text().splitlines())}
        assert set(rec) == {'environment', 'summary', 'cuda', *(s for s, _, _ in sections)}
        assert 'CUDA' in rec['cuda']['skipped']
        if want == 1:
            assert rec['summary']['failed_checks'] == ['s1: exact'] and rec['s0']['error'] == 'RuntimeError: kaboom'
            assert rec['s2']['passed']  # the sections after a failure still ran


@pytest.mark.skipif(torch.cuda.is_available(), reason='on CUDA the pairing is tried for real (-m gpu)')
def test_a_refused_pairing_is_recorded_not_raised(gpu_smoke):
    "NCCL where it cannot run (here: no CUDA build): both ranks end within seconds and the refusal is the record"
    t0 = time.perf_counter()
    r = gpu_smoke.section_sync_nccl(torch.device('cpu'), gpu_smoke.QUICK)
    assert r['outcome'] == 'refused' and 'NCCL' in r['reason'] and r['checks'] == []
    assert [x['ok'] for x in r['ranks']] == [False, False]
    assert time.perf_counter() - t0 < 45  # its peer is stopped 5 s after the first refusal, not at the group timeout


def test_the_memory_section_runs_on_cpu_with_its_measures_stubbed(gpu_smoke, monkeypatch, tmp_path):
    """Its code on CPU (what CUDA's allocator would report is stubbed to 0, so the figures' checks fail here and only
    the GPU can pass them): the smoke's config, the trainer's step and snapshot, the streamed intake into a second copy
    (bitwise) and the one host snapshot, against the plan"""
    for name in ('allocated', 'peak'):
        monkeypatch.setattr(gpu_smoke, name, lambda: 0)
    monkeypatch.setattr(gpu_smoke, 'reset_peak', lambda: None)
    monkeypatch.chdir(tmp_path)
    r = gpu_smoke.section_memory(torch.device('cpu'), gpu_smoke.QUICK)
    checks = {c['name']: c for c in r['checks']}
    assert checks["every tensor of the second copy is the snapshot's, bitwise"]['passed']
    assert checks["one host snapshot of the model in the engines' dtype"]['passed']
    assert {'parameters', 'gradients', 'optimizer', 'logits', 'activations'} <= set(r['plan']) and r['buckets'] >= 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
def test_full_run_on_cuda(tmp_path):
    rc, rec, log = run_script(tmp_path, timeout=480)
    assert rc == 0, log
    assert rec['environment']['cuda_available'] and rec['summary']['errors'] == []
    assert rec['summary']['failed_checks'] == [] and rec['summary']['skipped'] == []
    assert rec['weight_sync.ipc']['mechanism'] == 'CUDA IPC handles'
    assert rec['weight_sync.nccl']['outcome'] in ('ok', 'refused')
    assert rec['fsdp']['backend'] == 'nccl'
