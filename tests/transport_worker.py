"""One rank of the transport test's gloo group, in its own process (run by tests/test_transport.py).

`python transport_worker.py DIR RANK PORT`: rank 0 sends every round of DIR/plan.json, ranks 1..N receive them.
Rank 0 also holds a default process group first, as the trainer's rank 0 holds FSDP's, to show the weight group
is separate from it. A receiver's `mode` per round mutates how it unpacks, to prove the test can fail:
'shuffle' reads the tensors of each bucket in reverse order, 'fp16' views bf16 bytes as fp16.
"""

import json, os, sys, time
import torch
import torch.distributed as dist
from molt_nb import weight_sync as ws

EXACT_UNPACK = ws.unpack


def shuffled_unpack(bucket, flat):
    "Reads the bucket as if its tensors had been laid out in reverse order (the wrong split)"
    out, offset = [], 0
    for s in reversed(bucket.tensors):
        out.append((s.name, flat[offset : offset + s.nbytes].view(ws.dtype_of(s.dtype)).view(s.shape)))
        offset = -(-(offset + s.nbytes) // ws.ALIGN) * ws.ALIGN
    return out


def fp16_unpack(bucket, flat):
    "Views every bf16 tensor's bytes as fp16 (the wrong dtype view)"
    return [(n, t.view(torch.float16) if t.dtype == torch.bfloat16 else t) for n, t in EXACT_UNPACK(bucket, flat)]


UNPACKS = {'exact': EXACT_UNPACK, 'shuffle': shuffled_unpack, 'fp16': fp16_unpack}


def wait_for(path, timeout=120):
    "Wait for the file the sender publishes (the orchestrator's hand-off of the manifest)"
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.01)
    return torch.load(path, weights_only=False)


def send(folder, group, plan):
    dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)  # the trainer's own group
    items = torch.load(f'{folder}/items.pt')
    sender = ws.WeightSender('broadcast', group, bucket_mb=plan['bucket_mb'])
    for r in plan['rounds']:
        sent = [(n, t) for n, t in items if n != r.get('drop')]
        torch.save(sender.manifest(sent, r['version']), f'{folder}/tmp.pt')
        os.replace(f'{folder}/tmp.pt', f'{folder}/manifest_{r["version"]}.pt')
        sender.send(sent, r['version'])
    one = torch.ones(1)
    dist.all_reduce(one)  # the default group still works beside the weight group
    dist.destroy_process_group()
    return {'default_group_sum': one.item()}


def receive(folder, group, plan):
    receiver, names, out = ws.WeightReceiver('broadcast', group), plan['names'], {}
    for r in plan['rounds']:
        manifest = wait_for(f'{folder}/manifest_{r["version"]}.pt')
        ws.unpack = UNPACKS[r['modes'][group.rank - 1]]
        try:
            got = receiver.receive(manifest, names, where=f'engine {group.rank}')
            out[r['version']] = {n: t.clone() for n, t in got}  # views of one buffer: torch.save needs copies
        except ValueError as e:
            out[r['version']] = str(e)
        ws.unpack = EXACT_UNPACK
    return out


if __name__ == '__main__':
    folder, rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    plan = json.load(open(f'{folder}/plan.json'))
    group = ws.join_transport_group('127.0.0.1', port, rank, plan['world_size'], timeout_s=60)
    result = (send if rank == 0 else receive)(folder, group, plan)
    torch.save(result, f'{folder}/result_{rank}.pt')
    group.close()
    # the result is on disk: leave without running C++ static destructors, where gloo's threads can still be joinable
    # ('terminate called without an active exception', one receiver in two clean-clone runs, even after close())
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)
