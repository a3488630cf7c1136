"""Resolve (or re-check) the pins of molt-nb's GPU images: `cluster/constraints-gpu-vllm.txt` (the rollout side,
extra `vllm`) and `cluster/constraints-gpu-automodel.txt` (the trainer side, extra `automodel`).

They are two sets because no vLLM on PyPI installs next to nemo-automodel 0.7.0: every vllm from 0.30 to 0.34 pins
quack-kernels==0.6.5 (with nvidia-cutlass-dsl>=4.7), nemo-automodel 0.7.0 pins quack-kernels==0.6.4 (which pins
nvidia-cutlass-dsl==4.6.2). The trainer set is resolved inside the rollout set's versions, so the two differ only
where they must (ALLOWED_TO_DIFFER) and the processes that exchange weights run the same torch, NCCL, triton,
transformers and Ray.

    python cluster/gpu_constraints.py write    # resolve from the roots, rewrite both files
    python cluster/gpu_constraints.py check    # resolve the roots again *under* each file: fail if the result is
                                               # not exactly the file (a pin gone from PyPI, a missing package, an
                                               # inconsistent set)
    python cluster/gpu_constraints.py check --fresh   # resolve from the roots as `write` does and fail on any
                                                      # drift (new upstream releases): the file is stale

Needs the network (PyPI) and a CPython 3.12 on Linux x86_64 (environment markers are evaluated by the running
interpreter, so it must be the image's Python). Installs nothing: `pip install --dry-run --report` into a throwaway
--target. It downloads the wheels it resolves (torch alone is 555 MB) into pip's cache.
"""

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import textwrap
import tomllib
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INDEX = 'https://pypi.org/simple'
PYTHON = '3.12'
# Ubuntu 22.04's glibc (2.35), the oldest Ubuntu CUDA 13 supports: wheels tagged up to manylinux_2_35 are allowed.
# (manylinux_2_28 alone is not enough: vllm's llguidance 1.7 ships only manylinux_2_31 wheels.)
GLIBC_MAX = 35
PLATFORMS = [f'manylinux_2_{v}_x86_64' for v in range(GLIBC_MAX, 4, -1)] + [
    'manylinux2014_x86_64',
    'manylinux2010_x86_64',
    'manylinux1_x86_64',
]
# Pins both GPU sets share, on top of molt-nb's own dependencies and the extra's package:
# torch 2.14.0 is what vllm 0.33.0 pins (==); the trainer must run the same torch (NCCL weight sync);
# transformers 5.18.0 is what nemo-automodel 0.7.0 pins (==), and vllm 0.33.0 allows (<5.21). protobuf<7: the trainer's
# nvidia-cutlass-dsl 4.6.2 (through quack-kernels 0.6.4) needs it, and the rollout side (Ray's gRPC) keeps the same.
SHARED = ['torch==2.14.0', 'transformers==5.18.0', 'protobuf<7']
# Read from constraints.txt (the notebook's side): the Ray client and the cluster must run the same Ray, and what the
# notebook pickles (a swapped-in function) the cluster unpickles.
CLIENT_PINS = ('ray', 'cloudpickle')
# (extra, file): the rollout set first; the trainer set is resolved inside its versions.
SETS = [('vllm', 'cluster/constraints-gpu-vllm.txt'), ('automodel', 'cluster/constraints-gpu-automodel.txt')]
# What the trainer set may pin differently from the rollout set (the conflict above), and nothing else: these
# packages and the ones whose names start with them (nvidia-cutlass-dsl-libs-*).
ALLOWED_TO_DIFFER = ('quack-kernels', 'nvidia-cutlass-dsl')


def may_differ(name: str) -> bool:
    return name.startswith(ALLOWED_TO_DIFFER)


def canon(name: str) -> str:
    return re.sub(r'[-_.]+', '-', name).lower()


def client_pins() -> list:
    "the pins of CLIENT_PINS in constraints.txt"
    cpu = read_pins(ROOT / 'constraints.txt')
    missing = [n for n in CLIENT_PINS if n not in cpu]
    if missing:
        raise SystemExit(f'constraints.txt pins no {missing}')
    return [f'{n}=={cpu[n]}' for n in CLIENT_PINS]


def roots(extra: str) -> list:
    "what a GPU image installs: molt-nb's dependencies, the extra, the shared pins"
    project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
    return project['dependencies'] + project['optional-dependencies'][extra] + SHARED + client_pins()


def read_pins(path: Path) -> dict:
    "canonical name -> version of each `name==version` line"
    out = {}
    for line in path.read_text().splitlines():
        line = line.split('#')[0].strip()
        if line:
            name, _, version = line.partition('==')
            out[canon(name)] = version.strip()
    return out


def pip_command(report: str, target: str, reqs: str, cons: str | None) -> list:
    cmd = ['pip', 'install', '--dry-run', '--ignore-installed', '--report', report, '--target', target]
    cmd += ['--index-url', INDEX, '--python-version', PYTHON, '--only-binary=:all:']
    cmd += [a for p in PLATFORMS for a in ('--platform', p)]
    cmd += ['-r', reqs] + (['-c', cons] if cons else [])
    return cmd


def resolve(reqs: list, cons: dict | None) -> tuple:
    "(pins, the max manylinux glibc minor of the chosen wheels) from a pip dry run against PyPI alone"
    # this machine's pip config (extra indexes, find-links, a global constraint) must not leak into the resolution
    env = {k: v for k, v in os.environ.items() if not k.startswith('PIP_') or k in ('PIP_CERT', 'PIP_DEFAULT_TIMEOUT')}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK='1')
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / 'req.txt').write_text('\n'.join(reqs) + '\n')
        cons_file = None
        if cons is not None:
            cons_file = str(Path(tmp) / 'cons.txt')
            Path(cons_file).write_text(''.join(f'{k}=={v}\n' for k, v in sorted(cons.items())))
        cmd = pip_command(f'{tmp}/report.json', f'{tmp}/target', f'{tmp}/req.txt', cons_file)
        run = subprocess.run([sys.executable, '-m'] + cmd, env=env, capture_output=True, text=True)
        if run.returncode:
            sys.stderr.write(run.stdout[-4000:] + run.stderr[-8000:])
            raise SystemExit(f'pip could not resolve {reqs}')
        report = json.loads((Path(tmp) / 'report.json').read_text())
    pins, glibc = {}, (0, '')
    for item in report['install']:
        pins[canon(item['metadata']['name'])] = item['metadata']['version']
        wheel = item['download_info']['url'].rsplit('/', 1)[-1]
        glibc = max(glibc, (wheel_glibc(wheel), wheel.split('-')[0] + ' ' + item['metadata']['version']))
    return pins, glibc


def wheel_glibc(wheel: str) -> int:
    "the glibc minor a wheel needs: the lowest of its manylinux tags (0 for a pure-Python wheel)"
    legacy = {'manylinux2014': 17, 'manylinux2010': 12, 'manylinux1': 5}
    tags = [int(v) for v in re.findall(r'manylinux_2_(\d+)_x86_64', wheel)]
    tags += [v for k, v in legacy.items() if f'{k}_x86_64' in wheel]
    return min(tags, default=0)


def header(extra: str, rel: str, glibc: tuple, pip_version: str) -> str:
    side = 'rollout (vLLM engines)' if extra == 'vllm' else 'trainer (NeMo AutoModel + FSDP2)'
    cons = None if extra == 'vllm' else SETS[0][1]
    cmd = ' '.join(pip_command('report.json', '/tmp/x', 'req.txt', cons))
    cmd = textwrap.wrap(cmd, 112, break_on_hyphens=False)
    inside = (
        f'and `-c {SETS[0][1]}` without {", ".join(ALLOWED_TO_DIFFER)}* (the trainer set is resolved inside the '
        'rollout set)'
        if cons
        else ''
    )
    text = f"""\
molt-nb on a GPU image, the {side} side, every package pinned. Install with
  pip install -c {rel} -e '.[{extra}]'
Do not edit by hand: `make gpu-constraints` rewrites it, `make check-gpu-constraints` checks it (network).

Produced on {date.today().isoformat()} by cluster/gpu_constraints.py with pip {pip_version} under CPython \
{platform.python_version()} on Linux x86_64, against PyPI alone (this machine's pip config ignored):
{chr(10).join('  ' + c for c in cmd)}
where req.txt is molt-nb's [project] dependencies, the `{extra}` extra, {', '.join(SHARED)} and \
{', '.join(client_pins())} (as in constraints.txt, the notebook's side) {inside}.
Target: CPython 3.12, Linux x86_64, CUDA 13 (PyPI's torch 2.14.0 is the cu130 build: cuda-toolkit 13.0.3, \
nvidia-nccl-cu13), NVIDIA driver >= 580 or the cuda-compat-13-0 layer. The chosen wheels need glibc >= 2.{glibc[0]} \
({glibc[1]}); the resolution allowed wheels up to manylinux_2_{GLIBC_MAX} (Ubuntu 22.04).
NOT verified: nothing of this set was installed, imported or run: there is no GPU on the machine that resolved it, \
and pip resolved metadata only. Why two files and not one: no vllm on PyPI installs next to nemo-automodel 0.7.0 \
(quack-kernels ==0.6.5 vs ==0.6.4, nvidia-cutlass-dsl >=4.7 vs ==4.6.2); see cluster/README.md ("Installing on a GPU image")."""
    out = []
    for para in text.split('\n'):
        indent = '  ' if para.startswith('  ') else ''
        out += textwrap.wrap(para, 118, break_on_hyphens=False, subsequent_indent=indent) or ['']
    return ''.join(f'# {line}'.rstrip() + '\n' for line in out)


def pip_version() -> str:
    return subprocess.run([sys.executable, '-m', 'pip', '--version'], capture_output=True, text=True).stdout.split()[1]


def diff(want: dict, got: dict) -> list:
    return [
        f'{k}: file {want.get(k, "-")}, resolved {got.get(k, "-")}'
        for k in sorted(set(want) | set(got))
        if want.get(k) != got.get(k)
    ]


def main(argv: list) -> int:
    if sys.version_info[:2] != (3, 12) or platform.system() != 'Linux' or platform.machine() != 'x86_64':
        raise SystemExit(
            f'run under CPython 3.12 on Linux x86_64 (markers are evaluated by this interpreter), not '
            f'{platform.python_version()} on {platform.system()} {platform.machine()}'
        )
    mode, fresh = (argv + ['check'])[0], '--fresh' in argv
    rollout = None
    failed = False
    for extra, rel in SETS:
        path = ROOT / rel
        # the rollout set first; the trainer's inside it, but for the packages that must differ
        inside = None if rollout is None else {k: v for k, v in rollout.items() if not may_differ(k)}
        if mode == 'check' and not fresh:
            inside = read_pins(path)
        pins, glibc = resolve(roots(extra), inside)
        if rollout is None:
            rollout = pins
        else:  # the two sides agree on everything they share, but the conflict
            differ = [
                f'{k}: {rollout[k]} vs {pins[k]}'
                for k in sorted(set(rollout) & set(pins))
                if rollout[k] != pins[k] and not may_differ(k)
            ]
            if differ:
                print(f'FAILED: the rollout and trainer sets differ outside {ALLOWED_TO_DIFFER}: {differ}')
                failed = True
        if mode == 'write':
            body = ''.join(f'{k}=={v}\n' for k, v in sorted(pins.items()))
            path.write_text(header(extra, rel, glibc, pip_version()) + body)
            print(f'wrote {rel}: {len(pins)} pins, glibc >= 2.{glibc[0]} ({glibc[1]})')
        else:
            changes = diff(read_pins(path), pins)
            if changes:
                print(f'FAILED: {rel} differs from what pip resolves now ({"fresh" if fresh else "under the file"}):')
                print('\n'.join('  ' + c for c in changes))
                failed = True
            else:
                how = 'fresh' if fresh else 'under the file'
                print(f'ok: {rel} is exactly what pip resolves ({len(pins)} pins, {how})')
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
