"""Escape attempts against the tool sandbox (`molt_nb.tools`), as model-written code would make them.

Every attack first switches the audit hook off (it is only a second layer), then goes for the runner: its
token files and environment, its memory, its process, the project's source, its sockets and network. The
runner is a separate process holding secrets in its environment and home, so that a sandbox which kills or
reads it shows here as a dead runner or a leaked secret, not as a dead pytest. Processes the code starts
carry a marker in their command line and are found by pid from outside while they run.
"""

import asyncio, ctypes, json, os, socket, subprocess, sys, sysconfig, tempfile, threading, time
from pathlib import Path
import pytest
from molt_nb.tools import Sandbox, SandboxUnavailable, run_python

ROOT = Path(__file__).resolve().parents[1]
SECRET = 'sekrit-' + os.urandom(6).hex()
UNHOOK = '''import gc, __main__
__main__._DENY = ()  # the audit hook of old, read from a global
for f in gc.get_objects():
    if getattr(f, '__name__', None) == 'guard':  # the audit hook: empty its deny list, or replace its code
        if f.__closure__: f.__closure__[0].cell_contents = ()
        else: f.__code__ = (lambda event, args: None).__code__
import os, signal, socket, subprocess, sys, time
def attempt(name, f):
    try: print(name, 'DONE', repr(f())[:200], flush=True)
    except BaseException as e: print(name, 'FAILED', type(e).__name__, flush=True)
'''
RUNNER = r'''
import asyncio, json, os, resource, sys, time
from molt_nb.tools import run_python
async def main(calls):
    out = []
    for code, options in calls:
        before, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.monotonic()
        text = await run_python(code.replace('RUNNER_PID', str(os.getpid())), **options)
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        out.append(dict(text=text, seconds=time.monotonic() - start, grew_kb=grew))
    return out
print(json.dumps(asyncio.run(main(json.load(sys.stdin)))))
'''


@pytest.fixture(scope='module')
def home():
    "The runner's home, with a Ray token file as `ray` writes it (0644, as found on this machine)"
    with tempfile.TemporaryDirectory(prefix='sandbox-home-') as d:
        (Path(d) / '.ray').mkdir()
        (Path(d) / '.ray' / 'auth_token').write_text(SECRET)
        yield d


# the runner as root (privileged bwrap; the code drops to a uid of its own) and as an ordinary user (uid 12345 in a
# user namespace made by an outer bwrap: the sandbox then takes the user-namespace path every non-root user gets)
AS_USER = ('bwrap', '--dev-bind', '/', '/', '--unshare-user', '--uid', '12345', '--gid', '12345')


@pytest.fixture(params=['root', 'user'])
def who(request) -> tuple:
    return () if request.param == 'root' else AS_USER


def runner(calls: list, home: str, prefix: tuple = ()) -> list:
    "Run (code, options) calls in a fresh runner process with secrets in its environment and home; its results"
    env = dict(PATH=os.environ['PATH'], HOME=home, PYTHONPATH=str(ROOT), RAY_AUTH_TOKEN=SECRET, MOLT_CHAT_TOKEN=SECRET)
    r = subprocess.run(
        [*prefix, sys.executable, '-c', RUNNER],
        input=json.dumps(calls),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, f"the runner died (exit {r.returncode}): {r.stderr[-2000:]}"
    return json.loads(r.stdout)


def outcomes(text: str) -> dict:
    "{attempt: 'DONE ...' or 'FAILED ...'} of the lines `attempt` printed"
    return {
        l.split(' ', 1)[0]: l.split(' ', 1)[1]
        for l in text.splitlines()
        if l.split(' ', 1)[-1].startswith(('DONE', 'FAILED'))
    }


class Listener:
    "A TCP, a file Unix and an abstract Unix socket server of the runner's side, counting connections"

    def __init__(self, tmp: str):
        self.count, self.path, self.abstract = 0, f"{tmp}/runner.sock", f"\0molt-test-{os.urandom(6).hex()}"
        self.socks = [
            socket.create_server(('127.0.0.1', 0)),
            socket.socket(socket.AF_UNIX),
            socket.socket(socket.AF_UNIX),
        ]
        self.socks[1].bind(self.path)
        self.socks[2].bind(self.abstract)
        self.port = self.socks[0].getsockname()[1]
        for s in self.socks:
            s.listen()
            threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, s):
        while True:
            try:
                s.accept()[0].close()
            except OSError:
                return
            self.count += 1

    def close(self):
        for s in self.socks:
            s.close()


def test_secrets_project_and_network_out_of_reach(home, who, tmp_path):
    "With the audit hook off: no token file, environment, process memory, project file, socket or network is reachable"
    srv, target = Listener(str(tmp_path)), ROOT / 'molt_nb' / 'tools.py'
    before = target.read_bytes()
    code = (
        UNHOOK
        + f'''
attempt('home_token', lambda: open({home!r} + '/.ray/auth_token').read())
attempt('root_token', lambda: open('/root/.ray/auth_token').read())
attempt('environ', lambda: [k for k, v in os.environ.items() if {SECRET!r} in v] or 1 / 0)
attempt('runner_environ', lambda: open('/proc/RUNNER_PID/environ', 'rb').read())
attempt('runner_mem', lambda: open('/proc/RUNNER_PID/mem', 'rb').read(1))
def exposed(p):
    return {SECRET!r}.encode() in open(f'/proc/{{p}}/environ', 'rb').read() + open(f'/proc/{{p}}/cmdline', 'rb').read()
attempt('proc_scan', lambda: [p for p in os.listdir('/proc') if p.isdigit() and exposed(p)] or 1 / 0)
attempt('write_project', lambda: open({str(target)!r}, 'a').write('pwned'))
attempt('new_project_file', lambda: open({str(ROOT / 'pwned')!r}, 'w').write('pwned'))
attempt('write_usr', lambda: open('/usr/pwned', 'w').write('pwned'))
attempt('tcp', lambda: socket.create_connection(('127.0.0.1', {srv.port}), timeout=1))
attempt('internet', lambda: socket.create_connection(('1.1.1.1', 53), timeout=1))
attempt('unix_file', lambda: socket.socket(socket.AF_UNIX).connect({srv.path!r}))
attempt('unix_abstract', lambda: socket.socket(socket.AF_UNIX).connect({srv.abstract!r}))
attempt('nested_userns', lambda: subprocess.run(['unshare', '--user', '--map-root-user', 'true'], check=True))
attempt('write_root', lambda: open('/pwned', 'w').write('x'))
attempt('write_dev', lambda: open('/dev/pwned', 'w').write('x'))
attempt('fill_shm', lambda: [open(f'/dev/shm/f{{i}}', 'wb').write(b'x' * 2**19) for i in range(8)])
attempt('vsock', lambda: socket.socket(40, socket.SOCK_STREAM))
import ctypes
syscall = ctypes.CDLL(None, use_errno=True).syscall
nr = dict(x86_64=dict(keyctl=250, add_key=248, userfaultfd=323),
          aarch64=dict(keyctl=219, add_key=217, userfaultfd=282))[os.uname().machine]
calls = (('add_key', (b'user', b'k', b'x', 1, -4)), ('keyctl', (0, 0)), ('userfaultfd', (1,)),
         ('io_uring_setup', (8, 0)))
for name, args in calls:
    # FAILED only when seccomp refused it (ENOSYS): any other answer means the call reached the kernel
    attempt(name, lambda: syscall(nr.get(name, 425), *args) == -1 and ctypes.get_errno() == 38 and 1 / 0)
attempt('scratch', lambda: open('/tmp/notes', 'w').write('scratch is writable'))
'''
    )
    try:
        (r,) = runner([(code, dict(timeout_s=20))], home, who)
    finally:
        srv.close()
    got = outcomes(r['text'])
    assert SECRET not in r['text'], r['text']
    expected = [
        'home_token',
        'root_token',
        'environ',
        'runner_environ',
        'runner_mem',
        'proc_scan',
        'write_project',
        'new_project_file',
        'write_usr',
        'tcp',
        'internet',
        'unix_file',
        'unix_abstract',
        'nested_userns',
        'write_root',
        'write_dev',
        'fill_shm',
        'vsock',
        'add_key',
        'keyctl',
        'userfaultfd',
        'io_uring_setup',
    ]
    assert {k: v for k, v in got.items() if k in expected and not v.startswith('FAILED')} == {}, r['text']
    assert set(expected) <= set(got) and got['scratch'].startswith('DONE'), r['text']
    assert srv.count == 0 and target.read_bytes() == before and not (ROOT / 'pwned').exists()


def test_runner_cannot_be_killed(home, who):
    "pidfd, kill by pid, kill(-1) and fork_exec of a shell that kills: the runner lives and answers the next call"
    code = (
        UNHOOK
        + '''
import _posixsubprocess
attempt('pidfd', lambda: signal.pidfd_send_signal(os.pidfd_open(RUNNER_PID), signal.SIGKILL))
attempt('kill', lambda: os.kill(RUNNER_PID, signal.SIGKILL))
attempt('shell', lambda: subprocess.run(['/bin/sh', '-c', 'kill -9 RUNNER_PID'], check=True))
attempt('fork_exec', lambda: _posixsubprocess.fork_exec(
        [b'/usr/bin/kill', b'-9', b'RUNNER_PID'], [b'/usr/bin/kill'], True, (), None, None,
        -1, -1, -1, -1, -1, -1, *os.pipe(), False, False, -1, None, None, None, -1, None, False))
time.sleep(0.5)
attempt('kill_all', lambda: os.kill(-1, signal.SIGKILL))
'''
    )
    r, after = runner([(code, dict(timeout_s=20)), ('print(6 * 7)', {})], home, who)
    got = outcomes(r['text'])
    assert (
        got['pidfd'].startswith('FAILED') and got['kill'].startswith('FAILED') and got['shell'].startswith('FAILED')
    ), r['text']
    assert after['text'] == '42\n'


def _marked(marker: str) -> set:
    "Host pids of live processes whose command line holds `marker`"
    out = set()
    for p in os.listdir('/proc'):
        if not p.isdigit():
            continue
        try:
            if marker.encode() in Path(f"/proc/{p}/cmdline").read_bytes():
                out.add(int(p))
        except OSError:
            pass
    return out


def test_fork_tree_dies_at_the_deadline(home, who):
    """setsid and double-forked children holding stdout open: the call returns at its deadline and every one is gone (by
    pid)"""
    marker = f"tree-{os.urandom(4).hex()}"
    child = f'''import os, time  # {marker}
os.setsid()
for i in range(12):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0: time.sleep(120)
        time.sleep(120)
time.sleep(120)'''
    code = (
        UNHOOK
        + f'''subprocess.Popen([sys.executable, '-c', {child!r}])
print('started', flush=True)
time.sleep(120)'''
    )
    seen, result = set(), {}
    t = threading.Thread(
        target=lambda: result.update(r=runner([(code, dict(timeout_s=3, max_processes=64))], home, who)[0])
    )
    t.start()
    while t.is_alive():
        seen |= _marked(marker)
        time.sleep(0.05)
    t.join()
    assert len(seen) >= 20, f"only {len(seen)} processes of the tree were seen running"
    assert (
        result['r']['text'].endswith('TimeoutError: the code ran longer than 3 s and was stopped')
        and result['r']['seconds'] < 5
    ), result
    assert _marked(marker) == set(), 'processes of the tree outlived the deadline'


def test_fork_bomb_is_bounded(home, who):
    "Processes are capped per sandbox: a fork bomb stops at max_processes, and the next call runs"
    if who:
        pytest.skip(
            "the emulated ordinary user is host root outside its user namespace, and the kernel exempts root from "
            "RLIMIT_NPROC; "
            "a real non-root runner's sandbox is capped by the same rlimit (the root runner's case, with a uid of its "
            "own, runs here)"
        )
    code = (
        UNHOOK
        + '''n = 0
try:
    while True:
        if os.fork() == 0: time.sleep(60); os._exit(0)
        n += 1
except OSError as e: print('forked', n, type(e).__name__, flush=True)
'''
    )
    r, after = runner([(code, dict(max_processes=8, timeout_s=10)), ('print(6 * 7)', {})], home, who)
    assert r['text'].startswith('forked') and int(r['text'].split()[1]) < 8, r['text']
    assert after['text'] == '42\n'


def test_output_floods_cost_the_runner_nothing(home):
    """A 100 MB print and endless writes: the answer is cut, the program stopped, the runner's peak memory grows < limit
    + 10 MB"""
    calls = [
        ('print(1)', {}),
        ('import sys; sys.stdout.write("x" * 100_000_000)', dict(max_output=2000, memory_mb=512, timeout_s=20)),
        ('import sys\nwhile True: sys.stdout.write("y" * 65536)', dict(timeout_s=2)),
    ]
    _, flood, endless = runner(calls, home)
    for r in (flood, endless):
        assert r['grew_kb'] < 10 * 1024 + 2, f"the runner's peak memory grew by {r['grew_kb']} kB"
        assert (
            r['text'].startswith('x' * 2000 if r is flood else 'y' * 2000) and 'the program was stopped' in r['text']
        ), r['text'][-200:]
        assert len(r['text']) < 2200 and r['seconds'] < 3, r[
            'seconds'
        ]  # stopped at once (a pipe left unread used to hold the exit 5 s)


def test_limits_hold():
    "Files over file_mb fail; the scratch dir is private to each call; the runner is undumpable after a call"
    out = asyncio.run(run_python('open("big", "wb").write(b"x" * 3 * 2**20)', file_mb=1))
    assert 'File size limit exceeded' in out or 'OSError' in out or out == '', out
    asyncio.run(run_python('open("/tmp/left", "w").write("x")'))
    assert asyncio.run(run_python('import os; print(os.listdir("/tmp"))')) == '[]\n'
    assert ctypes.CDLL(None).prctl(3, 0, 0, 0, 0) == 0, 'the runner is still dumpable (PR_GET_DUMPABLE)'


def test_refuses_without_isolation(home):
    """No bwrap, or a kernel that refuses the namespaces: SandboxUnavailable says what to enable; unsafe=True is the
    explicit way out"""
    with pytest.raises(SandboxUnavailable, match='apt-get install bubblewrap'):
        asyncio.run(run_python('print(1)', bwrap='no-such-bwrap'))
    # an ordinary user's runner where user namespaces are disabled (as Docker's default seccomp profile or Ubuntu's
    # AppArmor do)
    code = (
        'from molt_nb.tools import run_python, SandboxUnavailable\nimport asyncio\n'
        'try: asyncio.run(run_python("print(1)"))\nexcept SandboxUnavailable as e: print(e)\n'
        'print(asyncio.run(run_python("print(2)", unsafe=True)))'
    )
    r = subprocess.run(
        [
            'bwrap',
            '--dev-bind',
            '/',
            '/',
            '--unshare-user',
            '--uid',
            '1000',
            '--disable-userns',
            sys.executable,
            '-c',
            code,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(PATH=os.environ['PATH'], PYTHONPATH=str(ROOT)),
    )
    assert (
        'could not build the sandbox' in r.stdout
        and 'unprivileged user namespaces' in r.stdout
        and 'unsafe=True' in r.stdout
    ), r.stdout + r.stderr
    assert r.stdout.endswith('unsafe=True.\n2\n\n'), r.stdout


def test_binds_add_packages(tmp_path):
    """The virtualenv's packages are not in the sandbox unless bound; bound, they import (numpy needs ctypes, which the
    kernel bounds), also from under /tmp, where the sandbox's own /tmp must not hide them (a fresh clone in /tmp failed
    so)"""
    (tmp_path / 'hello_bind.py').write_text('WHO = "bound"\n')
    tmp_path.chmod(0o755)  # pytest makes it 0700: the sandbox's user could not read it
    assert asyncio.run(run_python('import hello_bind; print(hello_bind.WHO)', binds=(str(tmp_path),))) == 'bound\n'
    site = sysconfig.get_paths()['purelib']
    assert 'ModuleNotFoundError' in asyncio.run(run_python('import numpy'))
    assert asyncio.run(run_python('import numpy; print(numpy.arange(4).sum())', binds=(site,), memory_mb=1024)) == '6\n'


def _parents() -> dict:
    "pid -> parent pid of every live process"
    parent = {}
    for p in os.listdir('/proc'):
        if p.isdigit():
            try:
                parent[int(p)] = int(Path(f"/proc/{p}/stat").read_text().rsplit(')', 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    return parent


def _tree(root: int) -> set:
    "Pids of the live processes below `root` (not `root` itself)"
    parent, tree, new = _parents(), set(), {root}
    while new:
        new = {p for p, pp in parent.items() if pp in new} - tree
        tree |= new
    return tree


def _children(pid: int) -> set:
    "Pids of the live processes whose parent is `pid`"
    return {p for p, pp in _parents().items() if pp == pid}


def held_by(pids: set) -> int:
    "Bytes the processes hold: their resident memory plus the memfd files they keep open (mapped or not)"
    rss, memfds = 0, {}
    for p in pids:
        try:
            status = Path(f"/proc/{p}/status").read_text()
            rss += int(status.split('VmRSS:')[1].split()[0]) * 1024 if 'VmRSS:' in status else 0
            for fd in os.listdir(f"/proc/{p}/fd"):
                if os.readlink(f"/proc/{p}/fd/{fd}").startswith('/memfd:'):
                    st = os.stat(f"/proc/{p}/fd/{fd}")
                    memfds[st.st_dev, st.st_ino] = st.st_blocks * 512
        except (OSError, IndexError, ValueError):
            pass  # gone while read
    return rss + sum(memfds.values())


HOG = '''import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
for i in range(7):  # eight processes, each after 320 MiB: 2.5 GiB in all
    try:
        if os.fork() == 0: break
    except OSError: break
held, me = [], os.getpid()
def report(name, f):  # one write per line: the processes print at once
    try: os.write(1, f'{name}{me} DONE {f()}\\n'.encode())
    except BaseException as e:
        why = errno.errorcode.get(getattr(e, 'errno', None)) or type(e).__name__
        os.write(1, f'{name}{me} FAILED {why}\\n'.encode())
def memfds():  # 4 x 32 MiB outside the address space (each file under RLIMIT_FSIZE)
    for i in range(4):
        held.append(os.memfd_create('hog'))
        os.write(held[-1], b'x' * 2**25)
def sysv():  # a SysV segment outlives its mapping: 2 x 32 MiB touched, then detached
    libc.shmat.restype = ctypes.c_void_p
    for i in range(2):
        seg = libc.shmget(0, 2**25, 0o1600)
        if seg < 0: raise OSError(ctypes.get_errno(), 'shmget')
        addr = libc.shmat(seg, None, 0)
        ctypes.memset(addr, 1, 2**25)
        libc.shmdt(ctypes.c_void_p(addr))
def grab():  # up to 128 MiB resident, 8 MiB at a time
    for i in range(16): held.append(b'x' * 2**23)
report('memfd', memfds)
report('sysv', sysv)
report('grab', grab)
time.sleep(1.5)
'''


def test_memory_is_bounded_per_call():
    """Eight processes each after 128 MiB of memfds, 64 MiB of SysV segments and 128 MiB of address space (2.5 GiB in
    all): what the call holds, sampled from outside (resident memory and memfds of its process tree), stays under its
    bound (memfd and SysV refused; before, 1003 MiB sampled against a 529 MiB bound, and 256 MiB of SysV unseen)"""
    sandbox = Sandbox(memory_mb=128, max_processes=4, file_mb=32, timeout_s=4)
    result, peak = {}, 0
    # only the call's processes: this process's other children (a session's Ray, its workers) are not the call's
    others = _children(os.getpid())
    t = threading.Thread(target=lambda: result.update(text=asyncio.run(sandbox.run(UNHOOK + HOG))))
    t.start()
    while t.is_alive():
        calls = _children(os.getpid()) - others
        peak = max(peak, held_by(set().union(calls, *map(_tree, calls))))
        time.sleep(0.02)
    t.join()
    got = outcomes(result['text'])
    grabs = [v for k, v in got.items() if k.startswith('grab')]
    assert 2 <= len(grabs) <= 4 and set(grabs) == {'FAILED MemoryError'}, result['text']  # at max_processes
    refused = [v for k, v in got.items() if k.startswith(('memfd', 'sysv'))]  # by seccomp, in every process
    assert len(refused) == 2 * len(grabs) and set(refused) == {'FAILED ENOSYS'}, result['text']
    assert 200 * 2**20 < peak < sandbox.memory_bound_mb * 2**20, (peak / 2**20, result['text'])


def test_socket_buffers_stay_at_their_defaults():
    """SO_SNDBUF raised to 8 MiB on 24 Unix socket pairs that nobody reads: the kernel queues what the default buffers
    take (before, 8 MiB a socket: 390 MiB from one process, outside every limit); setsockopt still answers 0"""
    code = (
        UNHOOK
        + '''held, queued = [], 0
for i in range(24):
    a, b = socket.socketpair()
    held += [a, b]
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2**23)
        s.setblocking(False)
        try:
            while True: queued += s.send(b'x' * 2**16)
        except BlockingIOError: pass
print(queued >> 20)'''
    )
    default = int(Path('/proc/sys/net/core/wmem_default').read_text())
    out = asyncio.run(run_python(code))
    assert int(out) <= 48 * 2 * default / 2**20, f"{out.strip()} MiB queued: more than 48 default buffers"
