"""One process of tests/test_transport.py's streaming-sync check: the trainer (rank 0) or an engine (ranks 1..N).

`python sync_worker.py DIR RANK PORT`: DIR/plan.json holds the run's config overrides and the group's size. The trainer
is the run's `Trainer`: for two versions it takes its one snapshot (the second reusing the first's buffers) and sends
it over a gloo weight group. Each engine is a `TorchEngine` behind the router's `Intake`, which loads each
bucket as it arrives. Every process measures its peak resident memory over the sync beyond what it held before
(VmHWM after resetting it, /proc/self/clear_refs), with glibc told to give freed buffers back at once
(MALLOC_MMAP_THRESHOLD_), and writes what it measured and what it holds to DIR/result_RANK.pt.
"""

import asyncio, json, os, sys
from pathlib import Path

import torch

from measure import storage_bytes


def rss_kib(field: str) -> int:
    "VmRSS or VmHWM of this process, in KiB"
    for line in Path('/proc/self/status').read_text().splitlines():
        if line.startswith(field + ':'):
            return int(line.split()[1])
    raise KeyError(field)


def mark() -> int:
    "Reset this process's resident high-water mark; the bytes resident now"
    Path('/proc/self/clear_refs').write_text('5')
    return rss_kib('VmRSS') * 1024


def peak_since(before: int) -> int:
    "The peak resident bytes since `mark()` beyond the `before` it returned"
    return rss_kib('VmHWM') * 1024 - before


def trainer(folder: Path, port: int, plan: dict, cfg) -> dict:
    from molt_nb.loop import Trainer

    t, out = Trainer(cfg), dict(send_peak=[], buffers=[])
    t.join_transport('127.0.0.1', port, plan['world_size'])
    for version in (1, 2):  # two steps: each takes the one snapshot (the second reusing its buffers), then sends it
        with torch.no_grad():
            for p in t.actor.model.parameters():
                p.add_(0.01)
        t.actor.version = version
        t.snapshot()
        out['buffers'].append([w.data_ptr() for _, w in t.weights])
        manifest = t.weight_manifest(version)
        torch.save(manifest, folder / 'tmp.pt')
        os.replace(folder / 'tmp.pt', folder / f'manifest_{version}.pt')
        before = mark()
        t.send_weights('broadcast', version)
        out['send_peak'].append(peak_since(before))
    out['held_bytes'] = storage_bytes([w for _, w in t.weights])
    out['model_bytes'] = sum(p.numel() * p.element_size() for p in t.actor.model.parameters())
    out['buckets'] = [b.nbytes for b in manifest.buckets]
    out['sent'] = {n: w.clone() for n, w in t.weights}
    t.transport.close()
    return out


def engine(folder: Path, rank: int, port: int, plan: dict, cfg) -> dict:
    from molt_nb.config import build_policy
    from molt_nb.engine import TorchEngine
    from molt_nb.router import Intake

    async def go():
        intake, out = Intake(TorchEngine(build_policy(cfg)[0], max_batch=4)), dict(take_peak=[])
        await intake.join('127.0.0.1', port, rank, plan['world_size'], 'gloo', 60)
        await intake.engine.pause()
        for version in (1, 2):
            while not (folder / f'manifest_{version}.pt').exists():
                await asyncio.sleep(0.01)
            manifest = torch.load(folder / f'manifest_{version}.pt', weights_only=False)
            before = mark()
            await intake.take(manifest, 'broadcast')
            out['take_peak'].append(peak_since(before))
        out['version'] = intake.engine.version
        out['loaded'] = {n: p.detach().clone() for n, p in intake.engine.model.named_parameters()}
        intake.group.close()
        intake.engine.close()
        return out

    return asyncio.run(go())


if __name__ == '__main__':
    folder, rank, port = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    plan = json.loads((folder / 'plan.json').read_text())
    torch.set_num_threads(1)
    from molt_nb.config import load_config

    cfg = load_config(plan['recipe'], plan['overrides'])
    result = trainer(folder, port, plan, cfg) if rank == 0 else engine(folder, rank, port, plan, cfg)
    torch.save(result, folder / f'result_{rank}.pt')
    os._exit(
        0
    )  # the result is on disk: leave without C++ static destructors, where gloo's threads can still be joinable
