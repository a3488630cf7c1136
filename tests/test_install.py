"""The install story, read from the files (no network, nothing installed): the CPU default never pulls a GPU
package, and each GPU extra is pinned by its constraints file (cluster/constraints-gpu-*.txt, written by
cluster/gpu_constraints.py; `make check-gpu-constraints` re-resolves them against PyPI)."""

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
EXTRAS = PROJECT['optional-dependencies']
# extra -> the constraints file it is installed with (cluster/README.md, "Installing on a GPU image")
GPU_EXTRAS = {'vllm': 'cluster/constraints-gpu-vllm.txt', 'automodel': 'cluster/constraints-gpu-automodel.txt'}
# what only a GPU image may install: the backends and what pulls a CUDA build (a torch from a CUDA index, NVIDIA's
# CUDA wheels, triton, which torch's CUDA build brings)
GPU_ONLY = re.compile(r'^(vllm|nemo-automodel|triton|flashinfer-python|nvidia-.*|cuda-.*|quack-kernels)$')
# what the rollout and trainer sets may pin differently (the conflict between vllm and nemo-automodel 0.7.0)
MAY_DIFFER = ('quack-kernels', 'nvidia-cutlass-dsl')


def pins(path: Path) -> dict:
    "canonical name -> version of each `name==version` line of a constraints file"
    out = {}
    for line in path.read_text().splitlines():
        line = line.split('#')[0].strip()
        if line:
            name, sep, version = line.partition('==')
            assert sep and version.strip(), f'{path.name}: `{line}` is not name==version'
            out[canonicalize_name(name)] = version.strip()
    return out


def extra_closure(extra: str) -> list:
    "the requirements of an extra, following molt-nb[other] references to other extras"
    reqs, todo, seen = [], [extra], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for spec in EXTRAS[name]:
            req = Requirement(spec)
            if canonicalize_name(req.name) == canonicalize_name(PROJECT['name']):
                todo += sorted(req.extras)
            else:
                reqs.append(req)
    return reqs


def test_cpu_default_installs_no_gpu_package():
    "the default dependencies and the dev extra (what `make setup` installs) name no GPU backend, CUDA torch or extra"
    bad = [str(r) for r in map(Requirement, PROJECT['dependencies']) if GPU_ONLY.match(canonicalize_name(r.name))]
    bad += [f'dev: {r}' for r in extra_closure('dev') if GPU_ONLY.match(canonicalize_name(r.name))]
    # a torch in dev could only be there to change the build (a CUDA one): the CPU build comes from constraints.txt
    bad += [f'dev: {r}' for r in extra_closure('dev') if canonicalize_name(r.name) == 'torch' or r.url]
    assert not bad, f'the CPU default would install GPU packages: {bad}'
    makefile = (ROOT / 'Makefile').read_text()
    installed = set(re.findall(r"-e '\.\[([\w,-]+)\]'", makefile))
    assert installed == {'dev'}, f"the Makefile installs extras {installed}, expected only '.[dev]'"


def test_every_gpu_extra_is_pinned_by_its_constraints_file():
    "each package a GPU extra names is pinned in the extra's constraints file, at the version the extra asks for"
    gpu_extras = {
        e for e, reqs in EXTRAS.items() for r in reqs if GPU_ONLY.match(canonicalize_name(Requirement(r).name))
    }
    assert gpu_extras == set(GPU_EXTRAS), f'GPU extras {gpu_extras}, with constraints files for {set(GPU_EXTRAS)}'
    bad = []
    for extra, rel in GPU_EXTRAS.items():
        pinned = pins(ROOT / rel)
        for req in extra_closure(extra) + [Requirement(d) for d in PROJECT['dependencies']]:
            version = pinned.get(canonicalize_name(req.name))
            if version is None or not req.specifier.contains(version, prereleases=True):
                bad.append(f'{extra}: {req} but {rel} pins {version}')
    assert not bad, 'pins missing or outside what pyproject.toml asks (run `make gpu-constraints`):\n' + '\n'.join(bad)


def test_gpu_sets_run_the_notebooks_ray():
    "the cluster runs the Ray (and the cloudpickle) of the notebook's client, and its two sides agree on the rest"
    cpu = pins(ROOT / 'constraints.txt')
    sets = {rel: pins(ROOT / rel) for rel in GPU_EXTRAS.values()}
    for name in ('ray', 'cloudpickle'):
        for rel, pinned in sets.items():
            assert pinned.get(name) == cpu[name], f'{rel} pins {name} {pinned.get(name)}, constraints.txt {cpu[name]}'
    rollout, trainer = sets.values()
    differ = [
        f'{k}: {rollout[k]} vs {trainer[k]}'
        for k in sorted(rollout.keys() & trainer.keys())
        if rollout[k] != trainer[k] and not k.startswith(MAY_DIFFER)
    ]
    assert not differ, f'the rollout and trainer sets differ (torch, NCCL, triton must match for weight sync): {differ}'
