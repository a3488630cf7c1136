"""`connect()` as a new user meets it (issue 15): a fresh kernel with no `RAY_*` variable and no token file reaches a
token-auth `ray start --head` through Ray Client with only the address and the token, wherever the token comes from and
whatever was imported first; a wrong or stale token, or a version mismatch, is an error that says so within seconds."""

import contextlib, json, os, subprocess, sys, tempfile, textwrap, uuid
from pathlib import Path
import psutil, pytest
from test_controller import RAY, ROOT, free_port, session_processes, stop_session
from molt_nb.controller import CLIENT_START_FAILED


@contextlib.contextmanager
def token_head(home: Path, cwd: Path | None = None, cpus: int = 1, **extra):
    """A token-auth Ray head on 127.0.0.1 only, free ports, its own temp dir, HOME `home`, started in `cwd` with
    `extra` in its environment (its workers inherit both); yields (address, token, the session's marks)"""
    temp_dir = tempfile.mkdtemp(prefix='molt-cn-')  # short: Ray's socket paths must fit in 107 bytes
    token, gcs_port, client_port = uuid.uuid4().hex, free_port(), free_port()
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps --node-ip-address=127.0.0.1 (ray start otherwise swaps in the
    # machine's address), and only then do GCS and raylet listen on loopback alone (the notebook's docs say so)
    env = {k: v for k, v in os.environ.items() if not k.startswith('RAY_')} | dict(
        RAY_AUTH_MODE='token',
        RAY_AUTH_TOKEN=token,
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER='0',
        RAY_USAGE_STATS_ENABLED='0',
        HOME=str(home),
        **extra,
    )
    ports = [
        f'--{flag}={free_port()}'
        for flag in (
            'node-manager-port',
            'object-manager-port',
            'dashboard-agent-listen-port',
            'dashboard-agent-grpc-port',
            'runtime-env-agent-port',
            'metrics-export-port',
        )
    ]
    cmd = [
        RAY,
        'start',
        '--head',
        '--node-ip-address=127.0.0.1',
        f'--port={gcs_port}',
        f'--ray-client-server-port={client_port}',
        *ports,
        f'--num-cpus={cpus}',
        f'--temp-dir={temp_dir}',
        '--include-dashboard=false',
        '--disable-usage-stats',
    ]
    marks = [temp_dir, f"127.0.0.1:{gcs_port}"]
    for attempt in range(3):  # Ray waits a fixed 30 s for its raylet, which a loaded 2-core machine can miss
        out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=180)
        if out.returncode == 0 or 'timed out during startup' not in out.stderr:
            break
        stop_session(marks)
    try:
        assert out.returncode == 0, out.stderr[-3000:]
        yield f"ray://127.0.0.1:{client_port}", token, marks
    finally:
        stop_session(marks)


@pytest.fixture(scope='module')
def head(tmp_path_factory):
    """A token-auth head (`token_head`), warmed up by one client; yields (address, token, the session's marks, how long
    connect may take there: `ray_floor`'s seconds plus `SLACK`)"""
    with token_head(tmp_path_factory.mktemp('head-home')) as (address, token, marks):
        # one client first, untimed: on a head just started, the proxy's first per-client server sometimes exits at
        # once (no log) and the proxy waits out its 30 s channel timeout before the client's retry gets a working one
        # (Ray's side, seen in 2 of 4 runs here); the tests below time what a kernel meets on a head that is up
        ray_floor(address, token, tmp_path_factory.mktemp('warm-up'))
        yield address, token, marks, ray_floor(address, token, tmp_path_factory.mktemp('floor')) + SLACK


# Ray Client's own connection and a first task take 14 s on an idle 2-core machine here (a per-client server and a
# worker start, each importing Ray), and connect 15 s; on a loaded CI machine connect took 22.8 and 24.6 s. So
# connect is timed against Ray's own, measured on the same head just before: what connect adds must stay under half
# the 30 s channel timeout that a missing token or a lost server costs
SLACK = 15


def ray_floor(address: str, token: str, home: Path) -> float:
    """The seconds Ray itself takes, in a fresh kernel set up the way Ray documents (the auth variables set before
    `import ray`), to connect to `address` through Ray Client and run a task, the work connect does"""
    # the proxy's start of this client's server can fail (the process exits at once, seen on a loaded CI machine);
    # connect retries that (`_start`), so the floor does too, timing the attempt that works
    code = f'''
    os.environ.update(RAY_AUTH_MODE='token', RAY_AUTH_TOKEN={token!r})
    import ray
    for attempt in range(3):
        t = time.monotonic()
        try:
            ray.init({address!r}, logging_level='ERROR', log_to_driver=False)
            break
        except ConnectionAbortedError as e:
            if attempt == 2 or not any(m in str(e) for m in {CLIENT_START_FAILED!r}):
                raise
            ray.shutdown()
            time.sleep(2)
    ray.get(ray.remote(num_cpus=0)(lambda: 1).remote(), timeout=120)
    print(json.dumps(dict(seconds=round(time.monotonic() - t, 1))))
    ray.shutdown()
    '''
    return kernel(code, home)['seconds']


def kernel(code: str, home: Path, cwd: Path = ROOT, prefix: tuple = (), **env) -> dict:
    """Run `code` as a fresh kernel would: no RAY_* variable, HOME a temp dir (no ~/.ray/auth_token unless the test
    writes one), under `prefix` (e.g. nsenter into a network namespace); its last line of output is JSON"""
    clean = (
        {k: v for k, v in os.environ.items() if not k.startswith('RAY_')}
        | dict(HOME=str(home), PYTHONPATH=str(ROOT))
        | env
    )
    prelude = 'import json, os, sys, time\nfrom molt_nb.controller import connect\n' + ATTEMPT
    p = subprocess.run(
        [*prefix, sys.executable, '-c', prelude + textwrap.dedent(code)],
        env=clean,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


# one connect attempt: the seconds connect took (to return or raise), and the answer of a trivial task on the cluster or
# the error
ATTEMPT = '''
def attempt(*args, **kw):
    import ray
    t, env = time.monotonic(), {k: v for k, v in os.environ.items() if k.startswith('RAY_')}
    try:
        connect(*args, **kw)
        out = dict(seconds=round(time.monotonic() - t, 1))
        # Ray keeps what it read: the kernel's environment is as it was, so no child process inherits the token
        out['env_kept'] = env == {k: v for k, v in os.environ.items() if k.startswith('RAY_')}
        out['answer'] = ray.get(ray.remote(lambda: 6 * 7).remote(), timeout=60)
    except Exception as e: out = dict(error=f"{type(e).__name__}: {e}", seconds=round(time.monotonic() - t, 1))
    ray.shutdown()
    return out
'''


def timed(run, limit: float) -> dict:
    """`run()`'s connect attempt, made once more if it worked but took `limit` seconds or more: a head's proxy now and
    then loses the server it starts for a client and waits out its 30 s channel timeout (Ray's side, as in `head`; seen
    once in CI on a later client: 52.6 s against a 23.2 s limit, and the same file passed 10 of 10 when rerun). A
    connect that is slow every time, or fails, still fails the test"""
    out = run()
    return run() if out.get('answer') == 42 and out['seconds'] >= limit else out


def test_head_listens_on_loopback_only(head):
    "What the docs promise for a one-machine head: no port of the session is reachable from outside"
    listening = []
    for p in session_processes(head[2]):
        try:
            listening += [c.laddr.ip for c in p.net_connections('tcp') if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            pass
    assert listening and all(ip in ('127.0.0.1', '::ffff:127.0.0.1') for ip in listening), listening


def test_fresh_kernel_connects_with_address_and_token(head, tmp_path):
    address, token, _, limit = head
    out = timed(lambda: kernel(f"print(json.dumps(attempt({address!r}, token={token!r})))", tmp_path), limit)
    assert out.get('answer') == 42, out
    assert out['seconds'] < limit, (out, limit)
    assert out['env_kept'], out  # the token passed to connect() is not left in os.environ


def test_connects_after_ray_was_imported_and_read_a_stale_token(head, tmp_path):
    "`import ray` first, and Ray already loaded (and cached) the stale ~/.ray/auth_token a local Ray left behind"
    address, token, _, limit = head
    (tmp_path / '.ray').mkdir()
    (tmp_path / '.ray' / 'auth_token').write_text('stale' + uuid.uuid4().hex)
    code = f'''
    import ray
    from ray._raylet import AuthenticationTokenLoader
    assert AuthenticationTokenLoader.instance().get_raw_token(ignore_auth_mode=True).startswith('stale')
    print(json.dumps(attempt({address!r}, token={token!r})))
    '''
    out = timed(lambda: kernel(code, tmp_path), limit)
    assert out.get('answer') == 42, out
    assert out['seconds'] < limit, (out, limit)


@pytest.mark.parametrize('where', ['RAY_AUTH_TOKEN', 'RAY_AUTH_TOKEN_PATH', '~/.ray/auth_token'])
def test_token_from_the_environment_or_a_file(head, tmp_path, where):
    address, token, _, limit = head
    home = tmp_path / 'home'
    if where == 'RAY_AUTH_TOKEN':
        env = dict(RAY_AUTH_TOKEN=token)
    elif where == 'RAY_AUTH_TOKEN_PATH':
        (tmp_path / 'token').write_text(token)
        env = dict(RAY_AUTH_TOKEN_PATH=str(tmp_path / 'token'))
    else:
        (home / '.ray').mkdir(parents=True)
        (home / '.ray' / 'auth_token').write_text(token)
        env = {}
    out = timed(lambda: kernel(f"print(json.dumps(attempt({address!r})))", home, **env), limit)
    assert out.get('answer') == 42, out
    assert out['seconds'] < limit, (out, limit)


def test_wrong_or_stale_token_says_so_and_where_it_came_from(head, tmp_path):
    address, token, *_ = head
    (tmp_path / '.ray').mkdir()
    (tmp_path / '.ray' / 'auth_token').write_text(uuid.uuid4().hex)  # a token of another (earlier) cluster
    (tmp_path / 'token').write_text(uuid.uuid4().hex)
    code = f'''
    import os
    out = dict(argument=attempt({address!r}, token='not-the-token'), home=attempt({address!r}))
    os.environ['RAY_AUTH_TOKEN_PATH'] = {str(tmp_path / 'token')!r}
    out['path'] = attempt({address!r})
    os.environ['RAY_AUTH_TOKEN'] = 'not-the-token-either'
    out['variable'] = attempt({address!r})
    print(json.dumps(out))
    '''
    out = kernel(code, tmp_path)
    where = dict(
        argument='the token passed to connect()',
        home=str(tmp_path / '.ray' / 'auth_token'),
        path=f"RAY_AUTH_TOKEN_PATH names ({tmp_path / 'token'})",
        variable='the RAY_AUTH_TOKEN variable',
    )
    for case, said in where.items():
        assert 'error' in out[case] and 'refused the auth token' in out[case]['error'], (case, out[case])
        assert said in out[case]['error'] and 'ray get-auth-token' in out[case]['error'], (case, out[case])
        assert out[case]['seconds'] < 10, (case, out[case])
    assert 'left from an earlier' in out['home']['error']


def test_version_mismatch_is_reported(head, tmp_path):
    "Ray Client refuses another Ray version; connect compares molt_nb on the cluster's workers with the kernel's"
    address, token, *_ = head
    code = f'''
    import molt_nb, ray
    mine = molt_nb.__version__
    molt_nb.__version__ = '0.0.0.other'
    out = dict(molt_nb=attempt({address!r}, token={token!r}))
    molt_nb.__version__, ray_version, ray.__version__ = mine, ray.__version__, '2.0.0'
    out['ray'] = attempt({address!r}, token={token!r})
    ray.__version__ = ray_version
    out['after'] = attempt({address!r}, token={token!r})
    print(json.dumps(out))
    '''
    out = kernel(code, tmp_path)
    assert 'molt_nb' in out['molt_nb'].get('error', '') and '0.0.0.other' in out['molt_nb']['error'], out['molt_nb']
    assert 'Version mismatch' in out['ray'].get('error', '') and 'pip install' in out['ray']['error'], out['ray']
    assert out['after'].get('answer') == 42, out['after']  # a failed check leaves nothing behind


def test_local_ray_listens_on_loopback_only(tmp_path):
    """connect() with no address (start_ray) keeps the private Ray on loopback, and this process's own settings as they
    were"""
    out = kernel(
        '''
    import os, tempfile, psutil, ray
    from ray._private import ray_constants
    from molt_nb.controller import start_ray
    start_ray(temp_dir=tempfile.mkdtemp(prefix='molt-cl-'), num_cpus=1)
    ray.get(ray.remote(lambda: 1).remote(), timeout=120)  # a worker listens too
    ips = set()
    for p in psutil.Process().children(recursive=True):
        try: ips |= {c.laddr.ip for c in p.net_connections('tcp') if c.status == psutil.CONN_LISTEN}
        except psutil.Error: pass
    variable = os.environ.get('RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER')
    print(json.dumps(dict(ips=sorted(ips), variable=variable, clusters=ray_constants.ENABLE_RAY_CLUSTER)))
    ray.shutdown()
    ''',
        tmp_path,
    )
    assert out['ips'] and set(out['ips']) <= {'127.0.0.1', '::ffff:127.0.0.1'}, out
    assert out['variable'] is None and out['clusters'] is True, out


def test_no_server_at_the_address_says_what_to_check(tmp_path):
    """Nothing listens on the port (a wrong port, a closed firewall, no tunnel): an error saying so, not Ray Client's 30
    s timeout"""
    out = kernel(
        f'''
    import molt_nb.controller
    molt_nb.controller.PING_SECONDS = 2
    print(json.dumps(attempt('ray://127.0.0.1:{free_port()}', token='any')))
    ''',
        tmp_path,
    )
    assert 'no Ray Client server answered' in out.get('error', '') and 'ssh -N -L' in out['error'], out
    assert out['seconds'] < 10, out
