"""The controller against a real `ray start --head` on loopback with token auth, driven through Ray Client (`ray://`)
from separate driver processes: launch, kill the driver, attach from a new one, hot-swap, a rejected swap."""

import json, os, signal, socket, subprocess, sys, tempfile, textwrap, uuid
from pathlib import Path
import psutil, pytest

ROOT = Path(__file__).resolve().parents[1]
PARITY = ROOT / 'recipes' / 'parity'
RAY = str(Path(sys.executable).parent / 'ray')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def session_processes(marks: list) -> list:
    """The processes of one Ray session: those naming any of `marks` (its temp dir, its GCS address) on their command
    line, and their descendants"""
    roots = []
    for p in psutil.process_iter(['cmdline']):
        try:
            if any(m in a for a in (p.info['cmdline'] or []) for m in marks):
                roots.append(p)
        except psutil.Error:
            pass
    found = {p.pid: p for p in roots}
    for p in roots:
        try:
            found |= {c.pid: c for c in p.children(recursive=True)}
        except psutil.Error:
            pass
    return list(found.values())


def stop_session(marks: list):
    "Stop our head by pid (never `ray stop`, which would kill every Ray on the machine)"
    procs = session_processes(marks)
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=15)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


@pytest.fixture(scope='module')
def ray_head():
    "A Ray head on 127.0.0.1 with token auth and a Ray Client server; yields (address, env of an authorised client)"
    temp_dir = tempfile.mkdtemp(prefix='molt-rh-')  # short: Ray's socket paths must fit in 107 bytes
    token = uuid.uuid4().hex
    env = os.environ | dict(
        RAY_AUTH_MODE='token',
        RAY_AUTH_TOKEN=token,
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER='0',
        RAY_USAGE_STATS_ENABLED='0',
        HF_HUB_OFFLINE='1',
        TOKENIZERS_PARALLELISM='false',
    )
    env.pop('RAY_AUTH_TOKEN_PATH', None)
    env.pop('RAY_ADDRESS', None)
    client_port, gcs_port = free_port(), free_port()
    env['RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S'] = (
        '180'  # a client's server process starts slowly while the run keeps 2 cores busy
    )
    ports = [
        '--port',
        str(gcs_port),
        '--ray-client-server-port',
        str(client_port),
        '--node-manager-port',
        str(free_port()),
        '--object-manager-port',
        str(free_port()),
        '--dashboard-agent-listen-port',
        str(free_port()),
        '--dashboard-agent-grpc-port',
        str(free_port()),
        '--runtime-env-agent-port',
        str(free_port()),
        '--metrics-export-port',
        str(free_port()),
    ]
    cmd = [
        RAY,
        'start',
        '--head',
        '--node-ip-address=127.0.0.1',
        *ports,
        '--num-cpus=2',
        f'--temp-dir={temp_dir}',
        '--include-dashboard=false',
        '--disable-usage-stats',
    ]
    for attempt in range(
        3
    ):  # Ray waits a fixed 30 s for its raylet, which a loaded 2-core machine can miss: clean up by pid and start again
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        if out.returncode == 0 or 'timed out during startup' not in out.stderr:
            break
        stop_session([temp_dir, f"127.0.0.1:{gcs_port}"])
    try:
        assert out.returncode == 0, out.stderr[-3000:]
        yield f"ray://127.0.0.1:{client_port}", env, temp_dir
    finally:
        stop_session([temp_dir, f"127.0.0.1:{gcs_port}"])  # the Ray Client proxy names only the GCS address


def driver(code: str, env: dict) -> subprocess.Popen:
    """A separate Python process running `code` from a file, so its functions have source (a fresh driver, as a new
    kernel would be)"""
    fd, path = tempfile.mkstemp(suffix='.py', prefix='molt-driver-')
    with os.fdopen(fd, 'w') as f:
        f.write(textwrap.dedent(code))
    return subprocess.Popen(
        [sys.executable, path], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def result(p: subprocess.Popen, timeout: float) -> dict:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"driver failed:\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


LAUNCH = '''
import sys, time
from molt_nb.config import load_config
from molt_nb.controller import connect, launch
connect({address!r})
overrides = ['loop.steps=100000', 'loop.mode="async"', 'rollout.groups_in_flight=8', 'loop.eval_tasks=8']
cfg = load_config({recipe!r}, [*overrides, 'run_dir="{run_dir}"'])
run = launch(cfg, name='ctl', store=cfg.run_dir)  # through Ray Client the recipe is uploaded; the store is here
run.wait(until_step=2, timeout=300)
print('launched', flush=True)
time.sleep(3600)  # the test kills this driver while the run steps
'''

ATTACH = '''
import json, time
import ray
from molt_nb.controller import NAMESPACE, connect, attach, runs, SwapRejected
connect({address!r})
listed = runs()
run = attach('ctl')
first = run.status()['step']
run.wait(until_step=first + 2, timeout=300)  # still stepping without any driver
m = run.metrics()

def loo_unscaled(x):
    from molt_nb.estimators import rloo
    return rloo(x)
def broken(x):
    raise RuntimeError('a bug in the cell')
def batch_normalised(x):  # fine on the golden batch, NaN on a batch whose rewards are all equal
    from molt_nb.estimators import rollout_rewards, to_tokens
    R = rollout_rewards(x)
    return to_tokens(x, (R - R.mean()) / R.std())
def hang(x):
    while True: pass
# passes every check (golden batches carry critic values, a run's do not), breaks on its second batch of the run
def flaky(x, calls=[]):
    from molt_nb.estimators import rloo
    if x.values is None: calls.append(1)
    if len(calls) >= 2: raise RuntimeError('flaky broke on a real batch')
    return rloo(x)
def refusal(fn, *args, **kw):
    try: fn(*args, **kw)
    except SwapRejected as e: return str(e)

run.pause()
deadline = time.time() + 300
while (st := run.status())['state'] != 'paused':
    assert time.time() < deadline and st['state'] == 'running', st
    time.sleep(0.2)
paused_at = run.status()['step']
run.set_estimator(loo_unscaled)
rejected = refusal(run.set_estimator, broken)
degenerate = refusal(run.set_estimator, batch_normalised)
start = time.time()
hung = refusal(run.set_estimator, hang, timeout=1)
hang_s = time.time() - start
run.resume()
run.wait(until_step=paused_at + 3, timeout=300)
after = run.metrics()
run.set_estimator(flaky)
failure = run.wait(timeout=300)  # returns when the run pauses for a failed swap
algo = ray.get(ray.get_actor('ctl/trainer', namespace=NAMESPACE).algo.remote())
run.resume()
run.wait(until_step=failure['step'] + 2, timeout=300)
resumed = run.metrics()
swaps = run.swaps()
status = run.status()
run.stop(); final = run.wait(timeout=300)
ended = refusal(run.set_estimator, loo_unscaled)
trained, held = run.samples(), run.samples(split='eval')
spans = run.conversation(trained.rollout_id.iloc[-1], int(trained.step.iloc[-1]))
held_spans = run.conversation(held.rollout_id.iloc[0], int(held.step.iloc[0]), split='eval')
row = resumed[resumed.step == failure['step'] + 1].iloc[0]
swapped = after['swap/estimator']
print(json.dumps(dict(listed=listed.name.tolist(), first=first, steps_at_attach=m.step.tolist(),
                      steps=after.step.tolist(),
                      swap_steps=after.loc[swapped.notna(), 'step'].tolist(), swap_names=swapped.dropna().tolist(),
                      swap_source=after['swap/estimator/source'].dropna().tolist(), paused_at=paused_at,
                      rejected=rejected, degenerate=degenerate, hung=hung, hang_s=hang_s,
                      failure={{k: failure[k] for k in ('state', 'step', 'reason', 'failed_swap')}},
                      trainer=algo.estimator, failed_row=[row.get('swap/failed'), row.get('swap/failed/reason')],
                      resumed_steps=resumed.step.tolist(),
                      swap_table=swaps[['kind', 'name', 'step', 'failed']].values.tolist(),
                      state=status['state'], final=final['state'], ended=ended,
                      conversation=[[t, trained_] for t, trained_ in spans], action_text=trained.text.iloc[-1],
                      held=len(held), held_trained=[t for _, t in held_spans])))
run.kill()
'''


def test_launch_kill_driver_attach_and_hot_swap(ray_head, tmp_path):
    address, env, _ = ray_head
    first = driver(LAUNCH.format(address=address, recipe=str(PARITY), run_dir=tmp_path / 'run'), env)
    try:
        line = first.stdout.readline()
        assert line.strip() == 'launched', first.stderr.read()[-4000:] if first.poll() is not None else line
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()  # the kernel dies
    out = result(driver(ATTACH.format(address=address), env), timeout=600)
    assert out['listed'] == ['ctl']
    assert out['first'] >= 2
    steps = out['steps']
    assert (
        steps == list(range(len(steps))) and steps[-1] >= out['paused_at'] + 3
    )  # no step missing, from 0; the row of the step waited for is there
    assert out['steps_at_attach'] == list(range(len(out['steps_at_attach'])))
    assert out['swap_steps'] == [out['paused_at'] + 1] and out['swap_names'] == [
        'loo_unscaled'
    ]  # took effect at the boundary after the pause
    assert 'def loo_unscaled(x):' in out['swap_source'][0]
    assert out['rejected'] and 'a bug in the cell' in out['rejected'] and 'keeps its estimator' in out['rejected']
    assert (
        'fails on the golden batch with every reward equal' in out['degenerate'] and 'non-finite' in out['degenerate']
    )
    assert 'took over 1 s' in out['hung'] and out['hang_s'] < 10  # refused within its limit (and the Ray round trips)
    # flaky broke at run time: the run went back to loo_unscaled, paused before that step and said why, in a line
    f, broke = out['failure'], out['failure']['step'] + 1
    assert f['state'] == 'paused' and f['failed_swap'] == "estimator 'flaky'" and '\n' not in f['reason']
    assert (
        f"failed at step {broke} (RuntimeError: flaky broke on a real batch)" in f['reason']
        and "went back to 'loo_unscaled'" in f['reason']
    )
    assert out['trainer'] == 'swap/loo_unscaled'
    assert out['failed_row'] == ['estimator flaky', f"step {broke}: RuntimeError: flaky broke on a real batch"]
    resumed = out['resumed_steps']
    assert (
        resumed == list(range(len(resumed))) and resumed[-1] >= broke + 1
    )  # resumed: the failed step trained, and the next
    (_, _, loo_step, loo_failed), (_, _, flaky_step, flaky_failed) = out['swap_table']
    assert (
        loo_step == out['paused_at'] + 1 and not isinstance(loo_failed, str) and flaky_step < broke
    )  # flaky ran fine for a step first
    assert flaky_failed.startswith(f"step {broke}: RuntimeError")
    assert [k[:2] for k in out['swap_table']] == [
        ['estimator', 'loo_unscaled'],
        ['estimator', 'flaky'],
    ]  # the refused ones never reached the run
    assert out['state'] == 'running' and out['final'] == 'stopped'
    # a rollout read back through the run: its prompt (not trained), then its turn (trained), as the run decodes it
    assert [t for _, t in out['conversation']] == [False, True]
    assert out['conversation'][1][0] == out['action_text']
    assert out['held'] > 0 and out['held_trained'] == [False, True]  # the held-out rollouts of its evaluations
    assert (
        "is stopped at step" in out['ended']
        and 'would never take effect' in out['ended']
        and 'from_checkpoint=True' in out['ended']
    )


def test_ray_client_without_the_token_is_refused(ray_head):
    address, env, _ = ray_head
    env = {k: v for k, v in env.items() if k not in ('RAY_AUTH_TOKEN',)} | dict(
        RAY_AUTH_TOKEN_PATH='/nonexistent/auth_token'
    )
    p = driver(f"from molt_nb.controller import connect\nconnect({address!r})", env)
    _, err = p.communicate(timeout=120)
    assert p.returncode != 0 and "needs the cluster's auth token" in err


RESUME = '''
import json, time
from pathlib import Path
import ray, torch
from molt_nb.config import load_config
from molt_nb.controller import NAMESPACE, SwapRejected, connect, launch
connect({address!r})
cfg = load_config({recipe!r}, ['loop.steps=100000', 'loop.mode="async"', 'loop.eval_tasks=8', 'run_dir="{run_dir}"'])

def quarter(x):
    return torch.full(x.action_mask.shape, 0.25)  # unmistakable: every trained token's advantage is 0.25
def plus_ten(trajectory, text):
    return trajectory.reward + 10

def until(pred, what, timeout=300):
    deadline = time.time() + timeout
    while not pred():
        assert time.time() < deadline, f"{{what}} within {{timeout}} s"
        time.sleep(0.5)

def named():
    return {{a['name'] for a in ray.util.list_named_actors(all_namespaces=True)}}

run = launch(cfg, name='res', store=cfg.run_dir)
run.wait(until_step=1, timeout=300)
run.set_estimator(quarter)
run.set_reward(plus_ten)
until(lambda: run.swaps().step.notna().all(), 'both swaps took effect')
ckpt = json.loads((Path(run.checkpoint()) / 'state.json').read_text())['step']
run.kill()  # orchestrator and trainer: their processes die with what they had registered
until(lambda: not {{'res', 'res/trainer'}} & named(), 'the killed actors released their names')
# fresh actors, given the config the run was launched with (grpo)
run = launch(cfg, name='res', from_checkpoint=True, store=cfg.run_dir)
run.wait(until_step=ckpt + 2, timeout=300)
m = run.metrics()
m = m[m.step > ckpt]
algo = ray.get(ray.get_actor('res/trainer', namespace=NAMESPACE).algo.remote())
ray.kill(ray.get_actor('res/trainer', namespace=NAMESPACE))  # the run fails at its next step
try: run.wait(timeout=300); waited = None
except RuntimeError as e: waited = str(e)
try: run.stop(); stopped = None
except RuntimeError as e: stopped = str(e)
try: run.set_estimator(quarter); refused = None
except SwapRejected as e: refused = str(e)
print(json.dumps(dict(ckpt=ckpt, steps=m.step.tolist(), adv_mean=m['train/adv_mean'].tolist(), reward=m.reward.tolist(),
                      swapped=m.get('swap/estimator', m.step * 0).tolist(),
                      rewarded=m.get('swap/reward', m.step * 0).tolist(),
                      trainer=algo.estimator, config=run.config()['algo']['estimator'],
                      swap_table=run.swaps()[['kind', 'name', 'step']].values.tolist(), waited=waited,
                      stopped=stopped, refused=refused)))
run.kill()
'''


def test_resume_restores_hot_swaps(ray_head, tmp_path):
    address, env, _ = ray_head
    code = RESUME.format(address=address, recipe=str(PARITY), run_dir=tmp_path / 'run')
    out = result(driver(code, env), timeout=600)
    steps, ckpt = out['steps'], out['ckpt']
    assert steps[:2] == [ckpt + 1, ckpt + 2]
    assert out['trainer'] == 'swap/quarter' and out['config'] == 'swap/quarter'
    assert all(a == 0.25 for a in out['adv_mean'])  # the swapped estimator gave every resumed step's advantages
    assert all(r >= 10 for r in out['reward'])  # and the swapped reward scored its rollouts
    # the first resumed step records the swaps it installed again
    assert out['swapped'][0] == 'quarter' and out['rewarded'][0] == 'plus_ten'
    table = out['swap_table']  # each at the step it first took effect, before the checkpoint
    assert [k[:2] for k in table] == [['estimator', 'quarter'], ['reward', 'plus_ten']] and all(
        k[2] <= ckpt for k in table
    )
    # its trainer killed, the run failed: wait() says so in a line or two, stop() and a swap are refused saying it
    # failed
    assert (
        out['waited'].startswith("run 'res' failed: ")
        and len(out['waited'].splitlines()) <= 2
        and 'Traceback' not in out['waited']
    )
    assert 'Error: ' in out['waited'] and '(after step ' in out['waited'] and 'from_checkpoint=True' in out['waited']
    assert out['stopped'].startswith("run 'res' had already failed, so there was nothing to stop")
    assert "is failed (" in out['refused'] and 'would never take effect' in out['refused']
