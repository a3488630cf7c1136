"""Trackers behind a real run of the loop: TensorBoard, W&B (offline) and MLflow (file store) read back with each
library's own reader hold the run store's metrics and sample tables; a stuck or failing tracker never blocks `log`."""

import asyncio, glob, json, math, os, struct, threading, time
from pathlib import Path
import pytest
from molt_nb.config import load_config
from molt_nb.loop import Orchestrator, Trainer
from molt_nb.store import RunStore
from molt_nb.trackers import SAMPLE_TABLE_COLUMNS, TrackedRun, Trackers, mlflow_name, nesting

ROOT = Path(__file__).resolve().parents[1]
PARITY = ROOT / 'recipes' / 'parity'
STEPS, SAMPLES_EVERY, SAMPLES_ROWS = 4, 2, 3
# a plain metric, the trainer's, a slash-nested one from the engine and the one it nests under (MLflow's file store
# renames that: engine_idle/value), one whose '@' MLflow refuses, and the evaluation (steps 0 and the last only: NaN
# in the store's other rows, never logged)
NAMES = ['reward', 'train/loss', 'engine_idle/starved', 'engine_idle', 'pass@1', 'eval']


TINY = [
    'loop.eval_tasks=2',
    'rollout.groups_per_step=2',
    'rollout.n_samples=2',
    'rollout.groups_in_flight=4',
    'train.micro_batch_rows=4',
    'trackers.tensorboard="tensorboard"',
    'trackers.wandb="wandb"',
    'trackers.mlflow="file:mlruns"',
]


def run_here(cfg, from_checkpoint: bool = False) -> Orchestrator:
    "Run `cfg` to its end in this process (an `Orchestrator` and a `Trainer`, no Ray); the orchestrator"
    orch = Orchestrator(cfg, Trainer(cfg), from_checkpoint)
    try:
        asyncio.run(orch.run())
        assert not orch.trackers.thread.is_alive()  # the run's end flushed and closed them (not only `close`)
    finally:
        orch.close()
    assert orch.trackers.first_error is None, orch.trackers.first_error
    return orch


@pytest.fixture(scope='module')
def tracked(tmp_path_factory):
    "A short sync run of the parity recipe, in this process, with the three trackers; (its config, its store)"
    run_dir = tmp_path_factory.mktemp('tracked') / 'run'
    cfg = load_config(
        PARITY,
        [
            f'run_dir="{run_dir}"',
            f'loop.steps={STEPS}',
            *TINY,
            'trackers.experiment="parity-test"',
            f'trackers.samples_every={SAMPLES_EVERY}',
            f'trackers.samples_rows={SAMPLES_ROWS}',
        ],
    )
    run_here(cfg)
    return cfg, RunStore(cfg.run_dir)


def expected(store: RunStore, name: str) -> dict:
    "step -> the store's value of metric `name`, where it has one"
    m = store.metrics()
    return {int(s): float(v) for s, v in zip(m.step, m[name]) if not math.isnan(v)}


def same(got: dict, want: dict, name: str):
    assert sorted(got) == sorted(want), (name, got, want)
    for step, v in want.items():
        assert got[step] == pytest.approx(v, rel=1e-6, abs=1e-12), (name, step, got[step], v)


def test_store_counts_nothing_lost(tracked):
    _, store = tracked
    m = store.metrics()
    assert list(m.step) == list(range(STEPS + 1))
    assert (m['trackers/dropped'].dropna() == 0).all() and (m['trackers/errors'].dropna() == 0).all()
    assert len(expected(store, 'eval')) == 2  # the first and the last evaluation


def test_tensorboard_holds_the_store(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg, store = tracked
    acc = EventAccumulator(str(Path(cfg.run_dir) / 'tensorboard'), size_guidance={'scalars': 0, 'tensors': 0})
    acc.Reload()
    for name in NAMES:
        same({e.step: e.value for e in acc.Scalars(name)}, expected(store, name), name)  # float32 in TensorBoard
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors('samples/text_summary')}
    assert sorted(texts) == list(range(SAMPLES_EVERY, STEPS + 1, SAMPLES_EVERY))
    for step, text in texts.items():
        lines = text.split('\n')  # one line a rollout: line breaks in a text are spaces
        assert lines[0] == '| ' + ' | '.join(SAMPLE_TABLE_COLUMNS) + ' |'
        assert [line.split(' | ')[1] for line in lines[2:]] == list(store.samples(step).rollout_id[:SAMPLES_ROWS])


def test_mlflow_holds_the_store(tracked):
    from mlflow import MlflowClient

    cfg, store = tracked
    os.environ.setdefault('MLFLOW_ALLOW_FILE_STORE', 'true')
    client = MlflowClient(tracking_uri=(Path(cfg.run_dir) / 'mlruns').as_uri())
    run_id = json.loads((Path(cfg.run_dir) / 'trackers.json').read_text())['mlflow']
    run = client.get_run(run_id)
    assert run.info.run_name == 'run' and run.info.status == 'FINISHED'
    assert client.get_experiment(run.info.experiment_id).name == 'parity-test'
    assert run.data.params['rollout.n_samples'] == '2' and run.data.params['loop.steps'] == str(STEPS)
    nested = nesting(store.metrics().columns)
    assert mlflow_name('engine_idle', nested) == 'engine_idle/value' and mlflow_name('pass@1') == 'pass_at_1'
    for name in NAMES:
        got = {m.step: m.value for m in client.get_metric_history(run_id, mlflow_name(name, nested))}
        same(got, expected(store, name), name)
    steps = range(SAMPLES_EVERY, STEPS + 1, SAMPLES_EVERY)
    assert [a.path for a in client.list_artifacts(run_id, 'samples')] == [f"samples/step_{s:08d}.json" for s in steps]
    table = json.loads(Path(client.download_artifacts(run_id, 'samples/step_00000002.json')).read_text())
    assert table['columns'] == list(SAMPLE_TABLE_COLUMNS)
    assert [r[1] for r in table['data']] == list(store.samples(2).rollout_id[:SAMPLES_ROWS])


def mlflow_history(cfg, name: str) -> list:
    "(step, value) of every point MLflow holds for metric `name` of the run in `cfg`'s run directory"
    from mlflow import MlflowClient

    os.environ.setdefault('MLFLOW_ALLOW_FILE_STORE', 'true')
    client = MlflowClient(tracking_uri=(Path(cfg.run_dir) / 'mlruns').as_uri())
    run_id = json.loads((Path(cfg.run_dir) / 'trackers.json').read_text())['mlflow']
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))


WANDB_BLOCK = 32768  # the .wandb file is a LevelDB-style log of 32 KiB blocks, each record a protobuf `Record`


def wandb_records(path: str):
    """The `wandb_internal_pb2.Record`s of an offline run's .wandb file (wandb 0.31 reads it in its Go core only, so
    the framing, a 7-byte file header then chunks of <crc32 length type>, is read here)"""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, magic, _ = struct.unpack('<4sHB', data[:7])
    assert ident == b':W&B' and magic == 0xBEE1, (ident, magic)
    pos, chunks = 7, b''
    while pos + 7 <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        _, n, kind = struct.unpack('<IHB', data[pos : pos + 7])
        if left < 7 or (n == 0 and kind == 0):  # the rest of a block is padding
            pos += left
            continue
        chunks, pos = chunks + data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a full record, or a record's last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b''
            yield record


def test_wandb_offline_holds_the_store(tracked):
    cfg, store = tracked
    (run_file,) = glob.glob(str(Path(cfg.run_dir) / 'wandb' / 'wandb' / 'offline-run-*' / '*.wandb'))
    history, config = wandb_history(run_file), {}
    for r in wandb_records(run_file):
        if r.WhichOneof('record_type') == 'run':
            config |= {i.key: json.loads(i.value_json) for i in r.run.config.update}
    assert config['rollout']['n_samples'] == 2 and config['trackers']['wandb'] == 'wandb'
    for name in NAMES:
        got = {step: row[name] for step, row in history.items() if name in row}
        same(got, expected(store, name), name)
    tables = {step: row for step, row in history.items() if row.get('samples/_type') == 'table-file'}
    assert sorted(tables) == list(range(SAMPLES_EVERY, STEPS + 1, SAMPLES_EVERY))
    table = json.loads((Path(run_file).parent / 'files' / tables[2]['samples/path']).read_text())
    assert table['columns'] == list(SAMPLE_TABLE_COLUMNS)
    assert [r[1] for r in table['data']] == list(store.samples(2).rollout_id[:SAMPLES_ROWS])


def wandb_history(run_file: str) -> dict:
    "step -> what the offline run `run_file` logged at it"
    history = {}
    for r in wandb_records(run_file):
        kind = r.WhichOneof('record_type')
        if kind == 'history':
            items = {i.key or '/'.join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history.setdefault(items['_step'], {}).update(items)
    return history


def test_resumed_run_continues_the_tracked_runs(tmp_path):
    """A run interrupted after step 3 with its checkpoint at step 2 resumes to step 4: TensorBoard shows each step
    once (the resumed values), MLflow continues the same run and keeps both values of step 3, W&B continues the same
    run id in a second offline directory"""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = load_config(PARITY, [f'run_dir="{tmp_path / "run"}"', *TINY, 'loop.steps=3', 'train.checkpoint_every=2'])
    run_here(first)
    ids = json.loads((tmp_path / 'run' / 'trackers.json').read_text())
    ckpts = tmp_path / 'run' / 'checkpoints'
    at_2 = [
        p
        for p in ckpts.iterdir()
        if (p / 'state.json').exists() and json.loads((p / 'state.json').read_text())['step'] == 2
    ]
    (ckpts / 'latest').write_text(at_2[0].name)  # as if it had been killed after step 3, before its last checkpoint
    before = dict(mlflow_history(first, 'reward'))
    cfg = load_config(PARITY, [f'run_dir="{tmp_path / "run"}"', *TINY, 'loop.steps=4', 'train.checkpoint_every=2'])
    run_here(cfg, from_checkpoint=True)
    store = RunStore(cfg.run_dir)
    assert list(store.metrics().step) == [0, 1, 2, 3, 4]
    assert json.loads((tmp_path / 'run' / 'trackers.json').read_text()) == ids  # the same tracked runs

    acc = EventAccumulator(str(tmp_path / 'run' / 'tensorboard'), size_guidance={'scalars': 0})
    acc.Reload()
    same({e.step: e.value for e in acc.Scalars('reward')}, expected(store, 'reward'), 'reward')
    assert [e.step for e in acc.Scalars('reward')] == [1, 2, 3, 4]  # step 3 of the first start was purged

    points = mlflow_history(cfg, 'reward')
    assert [s for s, _ in points] == [1, 2, 3, 3, 4]
    assert sorted(v for s, v in points if s == 3) == sorted([before[3], expected(store, 'reward')[3]])

    runs = sorted(glob.glob(str(tmp_path / 'run' / 'wandb' / 'wandb' / 'offline-run-*' / '*.wandb')))
    assert len(runs) == 2 and all(Path(r).stem == f"run-{ids['wandb']}" for r in runs)
    # the resumed start's directory is the latest (a start within the same second as the first gets a '-1' suffix)
    (latest,) = glob.glob(str(tmp_path / 'run' / 'wandb' / 'wandb' / 'latest-run' / '*.wandb'))
    resumed = wandb_history(latest)
    same(
        {s: row['reward'] for s, row in resumed.items() if 'reward' in row},
        {3: expected(store, 'reward')[3], 4: expected(store, 'reward')[4]},
        'reward',
    )


def test_fresh_run_hides_an_earlier_runs_tensorboard_steps(tmp_path):
    "A fresh run in a directory an earlier run logged to shows its own steps in TensorBoard, not both runs' mixed"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = [f'run_dir="{tmp_path / "run"}"', *TINY[:5], 'trackers.tensorboard="tb"']
    run_here(load_config(PARITY, overrides + ['loop.steps=4']))
    cfg = load_config(PARITY, overrides + ['loop.steps=2'])
    run_here(cfg)
    acc = EventAccumulator(str(tmp_path / 'run' / 'tb'), size_guidance={'scalars': 0})
    acc.Reload()
    got = {e.step: e.value for e in acc.Scalars('reward')}
    same(got, expected(RunStore(cfg.run_dir), 'reward'), 'reward')


def test_stopped_run_flushes(tmp_path):
    "A run the pool stops (its train rollouts fail) still flushes every step it logged to the trackers"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from molt_nb.pool import RunStopped

    from test_loop import parity_with

    # train rollouts fail from the 13th on (evaluations go on): the pool stops the run
    recipe = parity_with(
        tmp_path, "if not evaluating and next(_trains) >= 12: raise ConnectionError('scorer service is down')"
    )
    cfg = load_config(
        recipe,
        [f'run_dir="{tmp_path / "run"}"', *TINY[:5], 'trackers.tensorboard="tb"', 'loop.steps=1000']
        + ['rollout.failure_window=8', 'loop.mode="async"', 'loop.max_staleness=8'],
    )
    orch = Orchestrator(cfg, Trainer(cfg))
    try:
        with pytest.raises(RunStopped, match='scorer service is down'):
            asyncio.run(orch.run())
        assert not orch.trackers.thread.is_alive()  # flushed and closed by the stop itself
    finally:
        orch.close()
    acc = EventAccumulator(str(tmp_path / 'run' / 'tb'), size_guidance={'scalars': 0})
    acc.Reload()
    store = RunStore(cfg.run_dir)
    assert orch.step >= 1
    same({e.step: e.value for e in acc.Scalars('reward')}, expected(store, 'reward'), 'reward')
    assert max(expected(store, 'reward')) == orch.step


# Unit level: a tracker that is stuck or raises never holds up, nor raises into, the loop's `log`


class Stuck:
    name = 'stuck'

    def __init__(self):
        self.release, self.entered = threading.Event(), threading.Event()

    def open(self, run):
        pass

    def log(self, step, values):
        self.entered.set()
        self.release.wait()

    table = log

    def close(self):
        self.closed = True


class Raising(Stuck):
    def log(self, step, values):
        raise OSError('disk full')


def test_stuck_tracker_never_blocks_log(tmp_path):
    stuck = Stuck()
    trackers = Trackers([stuck], queue_size=100, close_timeout_s=0.5)
    trackers.begin(TrackedRun('t', 'e', {}, tmp_path))
    trackers.log({'step': -1, 'reward': 0.5})
    assert stuck.entered.wait(5)  # the thread is stuck in the sink: the queue fills and stays full
    start = time.perf_counter()
    for step in range(1000):
        trackers.log({'step': step, 'reward': 0.5, 'train/loss': 1.0})
        trackers.samples(step, None)
    seconds = time.perf_counter() - start
    assert seconds < 0.5, seconds
    assert trackers.dropped == 1900, trackers.dropped  # 2000 items, 100 queued
    start = time.perf_counter()
    assert trackers.close() is False  # gave up on the stuck sink
    assert time.perf_counter() - start < 2
    stuck.release.set()  # unstuck, the thread takes no more of the queue: it closes the sink and ends
    trackers.thread.join(5)
    assert not trackers.thread.is_alive() and getattr(stuck, 'closed', False)


def test_raising_tracker_is_counted(tmp_path):
    trackers = Trackers([Raising()], close_timeout_s=5)
    trackers.begin(TrackedRun('t', 'e', {}, tmp_path))
    for step in range(50):
        trackers.log({'step': step, 'reward': 0.5})
    assert trackers.close() is True
    assert trackers.metrics() == {'trackers/dropped': 0.0, 'trackers/errors': 50.0}
    assert trackers.first_error == 'stuck log: OSError: disk full'
    trackers.log({'step': 50, 'reward': 0.5})  # after close: ignored, never raises


class Recording(Stuck):
    def __init__(self):
        self.logged = []

    def log(self, step, values):
        self.logged.append((step, values))


def test_nan_none_and_text_never_reach_a_tracker(tmp_path):
    "a row's NaN, None and non-numbers are left out, numbers arrive as floats, `step` is the step, not a metric"
    rec = Recording()
    trackers = Trackers([rec])
    trackers.begin(TrackedRun('t', 'e', {}, tmp_path))
    trackers.log({'step': 7, 'reward': 1, 'eval': float('nan'), 'kl': None, 'note': 'x', 'train/loss': 0.25})
    assert trackers.close() is True
    assert rec.logged == [(7, {'reward': 1.0, 'train/loss': 0.25})]
    assert type(rec.logged[0][1]['reward']) is float


def test_a_name_that_becomes_a_parent_mid_run_loses_nothing(tmp_path):
    """A reward swap adds `reward/env` to the rows from its step on, after `reward` was logged plainly: every sink
    keeps every later step of every metric (MLflow's file store stores a metric as a file, so `reward` can never
    become a folder: the new name is stored flat, `reward_env`), and the errors count stays 0"""
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from molt_nb.trackers import MLflowSink, TensorBoardSink, WandbSink

    rows = [dict(step=s, reward=s / 8, loss=1 / s) for s in (1, 2)]
    rows += [dict(step=s, reward=s / 8, loss=1 / s) | {'reward/env': s / 16} for s in (3, 4, 5)]
    uri = (tmp_path / 'mlruns').as_uri()
    trackers = Trackers([TensorBoardSink(tmp_path / 'tb'), WandbSink(tmp_path / 'wandb'), MLflowSink(uri)])
    trackers.begin(TrackedRun('swapped', 'swap-test', {}, tmp_path))
    for row in rows:
        trackers.log(row)
    assert trackers.close() is True
    assert (trackers.errors, trackers.first_error) == (0, None)
    want = {k: {r['step']: r[k] for r in rows if k in r} for k in ('reward', 'loss', 'reward/env')}

    acc = EventAccumulator(str(tmp_path / 'tb'), size_guidance={'scalars': 0})
    acc.Reload()
    for name, points in want.items():
        same({e.step: e.value for e in acc.Scalars(name)}, points, f"tensorboard {name}")

    client = MlflowClient(tracking_uri=uri)
    run_id = json.loads((tmp_path / 'trackers.json').read_text())['mlflow']
    for name, stored in (('reward', 'reward'), ('loss', 'loss'), ('reward/env', 'reward_env')):
        same({m.step: m.value for m in client.get_metric_history(run_id, stored)}, want[name], f"mlflow {name}")

    (run_file,) = glob.glob(str(tmp_path / 'wandb' / 'wandb' / 'offline-run-*' / '*.wandb'))
    history = wandb_history(run_file)
    for name, points in want.items():
        same({s: row[name] for s, row in history.items() if name in row}, points, f"wandb {name}")

    # a resumed start's sink knows only what the store holds: it keeps each name where the first start stored it
    resumed = Trackers([MLflowSink(uri)])
    resumed.begin(TrackedRun('swapped', 'swap-test', {}, tmp_path, step=5, resume=True))
    resumed.log({'reward/env': 0.5, 'step': 6, 'reward': 0.75})
    assert resumed.close() is True and resumed.errors == 0, resumed.first_error
    assert client.get_metric_history(run_id, 'reward')[-1].step == 6
    assert client.get_metric_history(run_id, 'reward_env')[-1].step == 6
