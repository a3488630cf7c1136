"""Weight-sync time: Ray's object store vs a gloo broadcast, one sender to 1 and 2 receivers (issue 18).

A sender actor holds S MiB of weights (1 MiB bf16 tensors, one fp32 in eight, as routers beside experts) and
receiver actors take them, each in its own process, through `molt_nb.weight_sync`: the object-store arm packs the
buckets, puts each once and every receiver fetches and copies it out; the broadcast arm asks the sender for the
manifest, then the sender broadcasts the buckets over a standalone gloo group while the receivers receive. A sync's
time is the driver's wall time from the first call to the last receiver's return. Arms alternate within each
repetition (their order flips every repetition); medians are reported.

    .venv/bin/python bench/weight_sync.py [--reps 5] [--sizes 3 50 200] [--bucket-mb 32] [--append bench/RESULTS.md]
"""

import argparse, datetime, os, platform, statistics, tempfile, time
import ray
import torch
from molt_nb.controller import start_ray
from molt_nb.weight_sync import WeightReceiver, WeightSender, free_port, join_transport_group


def weights(mib: int) -> list:
    "`mib` MiB of (name, tensor): 1 MiB tensors, bf16 but every eighth fp32"
    dtypes = [torch.float32 if i % 8 == 7 else torch.bfloat16 for i in range(mib)]
    return [(f'w{i}', torch.randn(2**20 // d.itemsize, dtype=d)) for i, d in enumerate(dtypes)]


@ray.remote(num_cpus=0)
class Sender:
    def __init__(self, bucket_mb: float):
        self.bucket_mb, self.groups, self.items = bucket_mb, {}, []

    def join(self, port: int, world_size: int):
        self.groups[world_size] = join_transport_group('127.0.0.1', port, 0, world_size, timeout_s=120)

    def load(self, mib: int):
        self.items = weights(mib)

    def manifest(self, version: int):
        return WeightSender('inprocess', bucket_mb=self.bucket_mb).manifest(self.items, version)

    def send(self, kind: str, version: int, world_size: int = 0):
        sender = WeightSender(kind, self.groups.get(world_size), bucket_mb=self.bucket_mb)
        return sender.send(self.items, version)


@ray.remote(num_cpus=0)
class Receiver:
    def __init__(self):
        self.groups = {}

    def join(self, port: int, rank: int, world_size: int):
        self.groups[world_size] = join_transport_group('127.0.0.1', port, rank, world_size, timeout_s=120)

    def receive(self, kind: str, manifest, world_size: int = 0) -> int:
        got = WeightReceiver(kind, self.groups.get(world_size)).receive(manifest)
        return sum(t.numel() * t.element_size() for _, t in got)


def sync_once(arm: str, sender, receivers: list, version: int, mib: int) -> float:
    "Seconds for one sync of `arm` to every receiver"
    start, n = time.perf_counter(), len(receivers)
    if arm == 'object_store':
        manifest = ray.get(sender.send.remote('object_store', version))
        got = ray.get([r.receive.remote('object_store', manifest) for r in receivers])
        del manifest  # frees the buffers in the object store
    else:
        manifest = ray.get(sender.manifest.remote(version))
        sent = sender.send.remote('broadcast', version, 1 + n)
        got = ray.get([r.receive.remote('broadcast', manifest, 1 + n) for r in receivers])
        ray.get(sent)
    seconds = time.perf_counter() - start
    assert got == [mib * 2**20] * n, (arm, got)
    return seconds


def spread(times: list) -> str:
    "'median [min, max]' of sorted `times`"
    return f"{statistics.median(times):.0f} [{times[0]:.0f}, {times[-1]:.0f}]"


def main(reps: int, sizes: list, bucket_mb: float) -> list:
    start_ray(temp_dir=tempfile.mkdtemp(prefix='molt-bench-ray-'), num_cpus=2)
    sender, receivers = Sender.remote(bucket_mb), [Receiver.remote() for _ in range(2)]
    for n in (1, 2):  # one group per receiver count: the sender is rank 0 of both
        port = free_port()
        joins = [r.join.remote(port, rank, 1 + n) for rank, r in enumerate(receivers[:n], 1)]
        ray.get([sender.join.remote(port, 1 + n), *joins])
    rows, version = [], 0
    for mib in sizes:
        ray.get(sender.load.remote(mib))
        times = {(arm, n): [] for n in (1, 2) for arm in ('object_store', 'broadcast')}
        for rep in range(reps + 1):  # the first repetition warms up and is not counted
            for n in (1, 2):
                arms = ('object_store', 'broadcast') if rep % 2 else ('broadcast', 'object_store')
                for arm in arms:
                    version += 1
                    seconds = sync_once(arm, sender, receivers[:n], version, mib)
                    if rep:
                        times[arm, n].append(seconds)
        for n in (1, 2):
            store, bcast = (sorted(1e3 * t for t in times[a, n]) for a in ('object_store', 'broadcast'))
            ratio = statistics.median(b / s for b, s in zip(times['broadcast', n], times['object_store', n]))
            rows.append((mib, n, store, bcast, ratio))
            print(mib, n, statistics.median(store), statistics.median(bcast), ratio, flush=True)
    ray.shutdown()
    return rows


if __name__ == '__main__':
    ap = argparse.ArgumentParser()
    ap.add_argument('--reps', type=int, default=5)
    ap.add_argument('--sizes', type=int, nargs='+', default=[3, 50, 200])
    ap.add_argument('--bucket-mb', type=float, default=32)
    ap.add_argument('--append', help='append the table to this markdown file')
    args = ap.parse_args()
    rows = main(args.reps, args.sizes, args.bucket_mb)
    lines = [
        f"## weight sync: Ray object store vs gloo broadcast ({datetime.date.today()}, {platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, ray {ray.__version__})",
        '',
        f"`.venv/bin/python bench/weight_sync.py --reps {args.reps} --bucket-mb {args.bucket_mb:g}`: one sender actor, "
        f"receiver actors in their own processes, {args.reps} alternated repetitions: ms per sync, median [min, max]; "
        "the ratio is the median of the repetitions' ratios.",
        '',
        '| MiB | receivers | object store (ms) | gloo broadcast (ms) | broadcast / object store |',
        '|---:|---:|---:|---:|---:|',
    ]
    lines += [f"| {m} | {n} | {spread(s)} | {spread(b)} | **{r:.2f}** |" for m, n, s, b, r in rows]
    text = '\n'.join(lines) + '\n'
    print(text)
    if args.append:
        with open(args.append, 'a') as f:
            f.write('\n' + text)
