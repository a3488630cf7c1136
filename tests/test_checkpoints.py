"""Checkpoints are kept sanely (issue 47, item 7): the newest `keep`, every `keep_every`-th step, the one `latest` names
and every one asked for survive a save, nothing else does; a save that dies leaves no `.tmp_` directory behind once
the next save or a resumed run starts; what `latest` names is on disk (fsynced) before it moves; re-saving a step
never leaves `latest` naming a directory that is gone. A `PolicyActor` on the tiny dense model, in this process."""

import json, os, shutil, unittest.mock
from pathlib import Path
import pytest
from molt_nb import actor as actor_module
from molt_nb.actor import PolicyActor, latest_checkpoint
from molt_nb.config import TrainConfig
from molt_nb.models import build_tokenizer, tiny_dense
from molt_nb.store import RunStore


@pytest.fixture(scope='module')
def policy():
    return PolicyActor(tiny_dense(build_tokenizer()))


def steps(root: Path) -> list:
    "The steps of the checkpoints under `root`, in order (a step twice if saved twice)"
    found = [json.loads((p / 'state.json').read_text())['step'] for p in root.iterdir() if (p / 'state.json').exists()]
    return sorted(found)


def save_at(policy, root: Path, step: int, **kw) -> Path:
    policy.step = step
    return policy.save(root, **kw)


def test_keeps_the_newest_every_nth_latest_and_requested(policy, tmp_path):
    requested = {}
    for step in range(1, 13):
        path = save_at(policy, tmp_path, step, keep=3, keep_every=5, requested=step in (2, 7))
        if step in (2, 7):
            requested[step] = path
    assert steps(tmp_path) == [2, 5, 7, 10, 11, 12]
    assert all((p / 'model.safetensors').exists() for p in requested.values())  # the paths the caller was given
    assert latest_checkpoint(tmp_path).name == 'step_00000012'
    # keep=0 keeps every one; an unrequested re-save of a requested step keeps the requested directory too
    save_at(policy, tmp_path, 7, keep=0)
    assert steps(tmp_path) == [2, 5, 7, 7, 10, 11, 12] and (requested[7] / 'state.json').exists()
    save_at(policy, tmp_path, 13, keep=1, keep_every=5)
    assert steps(tmp_path) == [2, 5, 7, 10, 13]  # latest moved on: the unrequested step 7 and 11, 12 go


def test_crashed_saves_leave_no_temporary_directories(policy, tmp_path):
    "Three saves die after writing part of the weights (disk full), a killed process left one: none stays"
    save_at(policy, tmp_path, 1)
    (tmp_path / '.tmp_killed').mkdir()
    (tmp_path / '.tmp_killed' / 'model.safetensors').write_bytes(b'x' * 1000)

    def disk_full(model, path):
        Path(path).write_bytes(b'x' * 1000)
        raise OSError(28, 'No space left on device')

    with unittest.mock.patch.object(actor_module, 'save_model', disk_full):
        for step in (2, 3, 4):
            with pytest.raises(OSError, match='No space left'):
                save_at(policy, tmp_path, step)
    assert latest_checkpoint(tmp_path).name == 'step_00000001'
    save_at(policy, tmp_path, 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['latest', 'step_00000001', 'step_00000005']
    # a resumed run's store removes what a save killed since left, before the run's first save
    run = tmp_path.parent / f"{tmp_path.name}_run"
    shutil.copytree(tmp_path, run / 'checkpoints')
    (run / 'checkpoints' / '.tmp_killed').mkdir()
    RunStore(run).truncate(5)
    assert sorted(p.name for p in (run / 'checkpoints').iterdir()) == ['latest', 'step_00000001', 'step_00000005']


def test_resaving_a_step_never_leaves_latest_naming_nothing(policy, tmp_path):
    "At every rename and removal of a re-save of the latest step, `latest` names a complete checkpoint"
    save_at(policy, tmp_path, 3)
    seen = []

    def check(fn):
        def checked(*args, **kw):
            out = fn(*args, **kw)
            seen.append(fn.__name__)
            assert (latest_checkpoint(tmp_path) / 'state.json').exists(), (fn.__name__, args)
            return out

        return checked

    with (
        unittest.mock.patch.object(actor_module.shutil, 'rmtree', check(shutil.rmtree)),
        unittest.mock.patch.object(actor_module.os, 'replace', check(os.replace)),
    ):
        path = save_at(policy, tmp_path, 3)
    assert 'rmtree' in seen and steps(tmp_path) == [3] and latest_checkpoint(tmp_path) == path


def test_files_and_directories_are_synced_before_latest_moves(policy, tmp_path):
    "Every file of the checkpoint, its directory and the root are fsynced before `latest` is written"
    synced, at_latest = [], []
    real_fsync, real_write = os.fsync, actor_module.write_atomic

    def fsync(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        real_fsync(fd)

    def write_atomic(path, data):
        at_latest.append(list(synced))
        real_write(path, data)

    with (
        unittest.mock.patch.object(actor_module.os, 'fsync', fsync),
        unittest.mock.patch.object(actor_module, 'write_atomic', write_atomic),
    ):
        path = save_at(policy, tmp_path, 4)
    (before,) = at_latest
    files = {p.name for p in path.iterdir()}
    assert files >= {'model.safetensors', 'trainer.pt', 'state.json', 'config.json'}
    assert files <= set(before), (files, before)
    assert tmp_path.name in before  # the root, after the checkpoint's directory was renamed into it
    assert any(name.startswith('.tmp_') or name == path.name for name in before)  # the checkpoint's directory


def test_keep_checkpoints_config():
    assert TrainConfig().keep_checkpoints == 3
    with pytest.raises(ValueError, match=r"train.keep_checkpoints is -1, expected an int >= 0"):
        TrainConfig(keep_checkpoints=-1)
