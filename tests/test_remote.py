"""The kernel and a cluster that is not its machine (issue 20): `connect` names what differs from a head whose molt_nb
is another, and `launch` runs a recipe on a head started in another directory, with another home, after the
kernel's copy of the recipe is gone: the recipe travels with the run, the run store lives on the cluster, and the
dashboard reads it through the run."""

import dataclasses, os, shutil
from pathlib import Path
import pytest
from test_connect import kernel, token_head
from test_controller import PARITY, ROOT


def test_connect_names_both_molt_nb_versions(tmp_path):
    "A head whose workers import another molt_nb: connect refuses, naming both versions and the node"
    other = tmp_path / 'site'
    shutil.copytree(ROOT / 'molt_nb', other / 'molt_nb', ignore=shutil.ignore_patterns('__pycache__'))
    init = other / 'molt_nb' / '__init__.py'
    init.write_text(init.read_text().replace('__version__ = "', '__version__ = "9.9.9+other-'))
    with token_head(tmp_path / 'home', PYTHONPATH=str(other)) as (address, token, _):
        out = kernel(
            f"import molt_nb\nprint(json.dumps(dict(mine=molt_nb.__version__, got=attempt({address!r}, "
            f"token={token!r}))))",
            tmp_path,
        )
    mine, error = out['mine'], out['got'].get('error', '')
    assert f"molt_nb {mine} here, 9.9.9+other-{mine} on node 127.0.0.1" in error, out
    assert 'install the same molt_nb' in error, error


LAUNCH = '''
import shutil
from molt_nb.config import load_config
from molt_nb.controller import launch
from molt_nb.widgets import Dashboard
recipe = shutil.copytree({parity!r}, 'recipes/parity')  # the notebook's own copy, relative to its directory
cfg = load_config('recipes/parity', ['loop.steps=3', 'loop.eval_tasks=8', 'rollout.groups_per_step=2'])
connect({address!r}, token={token!r})
broken = Path(shutil.copytree('recipes/parity', 'recipes/broken'))
(broken / 'agent.py').write_text((broken / 'agent.py').read_text().replace('def tasks(', 'def tusks('))
try:
    launch(load_config('recipes/broken'), name='broken')
    refused = None
except Exception as e:
    refused = f"{{type(e).__name__}}: {{e}}"
run = launch(cfg, name='elsewhere')
shutil.rmtree('recipes')  # gone from here: the run can only use what travelled with it
st = run.wait(timeout=400)
dash = Dashboard(run, live=False)
out = dict(refused=refused, state=st['state'], reason=st.get('reason'), steps=[int(s) for s in run.metrics().step],
           shown=[int(s) for s in dash.metrics.step], store=run.config()['run_dir'],
           recipe=run.config()['recipe'], here=sorted(str(p) for p in Path('.').rglob('*')))
run.kill()
print(json.dumps(out))
'''


def test_launch_on_a_head_elsewhere_runs_the_recipe_it_sent(tmp_path):
    """The head runs in its own directory with its own home; the kernel in another, with a relative recipe path that
    does not exist on the head and is deleted once launched: the run ends, its store is under the head's home"""
    (tmp_path / 'head').mkdir()
    (tmp_path / 'kernel').mkdir()
    home = tmp_path / 'head-home'
    with token_head(home, cwd=tmp_path / 'head', cpus=2) as (address, token, _):
        code = 'from pathlib import Path\n' + LAUNCH.format(parity=str(PARITY), address=address, token=token)
        out = kernel(code, tmp_path / 'kernel-home', cwd=tmp_path / 'kernel')
    # checked where it would run, on the files that travel: the recipe's own error, before any run starts
    assert out['refused'].startswith('RecipeError') and 'does not export tasks' in out['refused'], out
    assert out['state'] == 'finished', out
    assert out['steps'] == [0, 1, 2, 3] and out['shown'] == out['steps'], out
    assert out['store'] == str(home / 'molt-runs' / 'elsewhere'), out
    assert (home / 'molt-runs' / 'elsewhere' / 'metrics.parquet').exists()
    assert out['here'] == [], out  # nothing was written on the kernel's side
    assert out['recipe'] == str(home / 'molt-runs' / 'elsewhere' / 'recipe'), out  # the code that ran, kept
    assert (home / 'molt-runs' / 'elsewhere' / 'recipe' / 'agent.py').read_text() == (PARITY / 'agent.py').read_text()


@pytest.mark.parametrize('recipe', sorted(p.parent.name for p in (ROOT / 'recipes').glob('*/recipe.toml')))
def test_every_recipe_travels_whole(recipe, tmp_path):
    "What `launch` uploads holds the recipe's agent module, also one that lives in a sibling recipe (gsm8k_moe's)"
    from molt_nb.config import load_config
    from molt_nb.remote import on_cluster, ship

    cfg = load_config(ROOT / 'recipes' / recipe, [f'run_dir="{tmp_path}/here"'])
    there = on_cluster(*ship(dataclasses.replace(cfg), recipe, 'upload', store=str(tmp_path / 'there'))[:2])
    assert there.agent_path.is_file() and there.agent_path.read_text() == cfg.agent_path.read_text()
    assert there.agent_path.resolve().is_relative_to(tmp_path / 'there' / 'recipe')


def peak_growth_mib(fn) -> float:
    "How far (MiB) this process's resident memory rose above where it was while `fn()` ran (Linux's peak RSS, reset)"
    import re

    def status():
        return dict(re.findall(r'(Vm\w+):\s+(\d+) kB', Path('/proc/self/status').read_text()))

    Path('/proc/self/clear_refs').write_text('5')  # VmHWM := VmRSS
    before = int(status()['VmRSS'])
    fn()
    return (int(status()['VmHWM']) - before) / 1024


def random_file(path, mib: int):
    with open(path, 'wb') as f:
        for _ in range(mib):
            f.write(os.urandom(2**20))


def refused(fn, match: str):
    with pytest.raises(ValueError, match=match):
        fn()


def test_pack_refuses_a_big_recipe_without_holding_it(tmp_path, monkeypatch):
    """A recipe holding a 96 MiB file is refused by name before it is zipped; one whose file grew after it was counted
    is refused as the zip grows, spooled to disk: the process grows by under 20 MiB either way"""
    from molt_nb.remote import pack

    rec = tmp_path / 'rec'
    rec.mkdir()
    (rec / 'agent.py').write_text('')
    random_file(rec / 'data.bin', 96)
    grew = peak_growth_mib(lambda: refused(lambda: pack(rec), r'96 MiB of files \(the largest: data.bin'))
    print(f"refused at 96 MiB: grew {grew:.1f} MiB")
    assert grew < 20, f"the refusal grew the process by {grew:.0f} MiB"
    real_stat = Path.stat

    def stale(self, **kw):  # data.bin counted before it grew: only the zip's own size can stop it
        st = real_stat(self, **kw)
        return os.stat_result((*st[:6], 0, *st[7:])) if self.name == 'data.bin' else st

    monkeypatch.setattr(Path, 'stat', stale)
    grew = peak_growth_mib(lambda: refused(lambda: pack(rec, limit=32 * 2**20), 'MiB zipped so far, over the 32 MiB'))
    print(f"refused streaming: grew {grew:.1f} MiB")
    assert grew < 20, f"the streamed refusal grew the process by {grew:.0f} MiB"


def test_pack_sends_only_the_recipe(tmp_path):
    """A symlink out of the recipe (a file, a folder) is refused by name, or sent resolved when asked; symlinks inside
    it arrive working"""
    from molt_nb.remote import pack, unpack

    rec, outside = tmp_path / 'rec', tmp_path / 'outside'
    (rec / 'data').mkdir(parents=True)
    outside.mkdir()
    (rec / 'agent.py').write_text('A')
    (rec / 'data' / 'rows.jsonl').write_text('{}')
    (rec / 'rows.jsonl').symlink_to('data/rows.jsonl')
    (rec / 'current').symlink_to(rec / 'data')  # (absolute, still inside)
    there = Path(unpack(pack(rec), tmp_path / 'there'))
    assert sorted(str(p.relative_to(there)) for p in there.rglob('*') if p.is_file()) == [
        'agent.py',
        'current/rows.jsonl',
        'data/rows.jsonl',
        'rows.jsonl',
    ]
    assert (there / 'current' / 'rows.jsonl').read_text() == '{}'
    (outside / 'secret').write_text('SECRET')
    (rec / 'linked.txt').symlink_to(outside / 'secret')
    (rec / 'sets').symlink_to(outside)
    with pytest.raises(ValueError) as e:
        pack(rec)
    assert f"linked.txt -> {outside / 'secret'}, sets -> {outside} point outside the recipe" in str(e.value)
    there = Path(unpack(pack(rec, resolve_links=True), tmp_path / 'there'))
    assert (there / 'linked.txt').read_text() == 'SECRET' and (there / 'sets' / 'secret').read_text() == 'SECRET'
