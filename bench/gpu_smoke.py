"""The GPU smoke: what only a CUDA device can tell about the engine, routing replay, weight sync and the trainer.

Six independent sections, on random-weight models of real shapes built in code (Qwen3-1.7B's, and a small Qwen3-MoE
with Qwen3's vocabulary: 0.6B); each writes its figures as JSON lines to OUT/gpu_smoke.jsonl, the one report (one
failing section is recorded and the others still run), then a summary is printed:

1. `logprobs`: TorchEngine on the device samples at temperature 1, PolicyActor.logprobs on the device recomputes;
   |dlogp| max and mean, fp32 engine against the fp32 trainer (asserted < 1e-3: same weights, same dtype, only the
   kernels' summation order differs, ~1e-6 on CPU), and a bf16 engine against the fp32 and a bf16 trainer (recorded).
2. `routing`: a tiny Qwen3-MoE; the engine's captured routes replayed in the trainer's forward, through
   `train_step` (the loop's `routing/agreement`) and one direct forward (`route_agreement`): exactly 1.0.
3. `weight_sync.*`: bitwise round trips of a MoE-shaped set (bf16 experts, fp32 routers, odd sizes, NaN/inf/-0):
   in process (pack/unpack on the device), to a spawned child through torch.multiprocessing (CUDA IPC handles on a
   GPU, shared memory on CPU), and between two spawned processes over a gloo transport group (the project's
   copy-to-host path, then gloo handed CUDA buffers directly) and over NCCL (one GPU: refused, recorded).
4. `fsdp`: a PolicyActor in a world-1 FSDP2 group (`join_group`, NCCL on a GPU, gloo on CPU) against a plain one,
   same weights and batch, two steps (logprobs in chunks, as the trainer scores): updated weights within 1e-6 of the
   largest weight (asserted), bitwise equality recorded, with a second plain actor as the run-to-run control; the arms
   run one after another (three fp32 trainers of 1.7B would not fit one GPU).
5. `throughput`: the same prompts through TorchEngine and transformers' batched `generate` (sampled, logprobs
   returned by both): tokens/s and their ratio (recorded).
6. `memory` (CUDA only): the memory plan's trainer rank (`molt_nb.memory`) against what CUDA allocates for the same
   config: parameters, gradients and optimizer state within 5%, a step's peak at most the plan's, the snapshot gathered
   one tensor at a time into host memory; then the streamed transfer into a second model copy (a bf16 TorchEngine)
   within the plan's two buckets, every tensor bitwise.

Exit status: 0 all checks passed; 1 an exactness check failed; 2 a section raised (no check failed); 3 the watchdog
stopped the script (--deadline). Sections that need CUDA record {"section": ..., "skipped": reason} without it.

Here (CPU, the test suite runs this): PYTHONPATH=. .venv/bin/python bench/gpu_smoke.py --device cpu --quick --out DIR

On a lent H100 or H200 (python3 there has torch, transformers, pandas and pytest but no fastcore, which is pure Python,
so it is carried from this venv), with `carry: [".venv/lib/python3.11/site-packages/fastcore"]` and timeout_s 540 (the
watchdog stops the script at --deadline 450 s, inside the 8 minutes it is sized for; nothing has measured a full run at
these shapes yet):

    mkdir -p /tmp/pp && cp -r .venv/lib/python3.11/site-packages/fastcore /tmp/pp/ && \
    PYTHONUNBUFFERED=1 PYTHONPATH=.:/tmp/pp python3 bench/gpu_smoke.py --out $OUT

Read the `environment` record first: `model_forward_takes_cache` false (transformers before it renamed
`past_key_values` to `cache`, such as 5.17) means TorchEngine's prefill cache is dropped and section `logprobs` fails
for that reason, not for a CUDA one.

It imports no ray, vllm or nbval: molt_nb.engine, actor, chat, config, core, memory, models, router, routing and
weight_sync import none at import time (ray only inside the object-store transport and placement functions, never
called here); nor molt_nb.loop, whose run store needs pyarrow.
"""

import argparse, asyncio, copy, dataclasses, functools, hashlib, inspect, json, math, os, platform, statistics, sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

from molt_nb.weight_sync import WeightReceiver, WeightSender, free_port, join_transport_group

LOGP_BOUND = 1e-3  # fp32 engine vs fp32 trainer, max |dlogp|
FSDP_RTOL = 1e-6  # world-1 FSDP2 vs plain: max |dw| over the largest |w|
MODEL_CACHE_KWARG = 'cache'  # the keyword TorchEngine hands its KV cache to the model's forward under (see environment)


@dataclasses.dataclass(frozen=True)
class Sizes:
    "How big each section runs"

    dense: dict  # TinyConfig fields of the dense policy (sections 1, 4, 5)
    moe: dict  # TinyConfig fields of the MoE policy (sections 2, 4)
    rows: int  # rollouts per batch (groups of 4) in sections 1, 2 and 4
    prompt: int  # longest prompt; prompts are prompt // 2 .. prompt tokens long
    new: int  # tokens sampled per rollout
    bench_rows: int  # prompts in the throughput section
    bench_new: int  # new tokens per prompt there
    reps: int  # timed repetitions per side there (after one warm-up)
    sync: dict  # shape of the weight-sync set: hidden, experts, inter, layers, vocab; bucket_mb
    child_s: float  # seconds a spawned process may take before it is killed


QUICK = Sizes(
    dense=dict(),
    moe=dict(num_experts=8, experts_per_token=2, num_layers=3, dense_layers=(0,)),
    rows=8,
    prompt=8,
    new=12,
    bench_rows=8,
    bench_new=16,
    reps=1,
    sync=dict(hidden=32, experts=4, inter=16, layers=2, vocab=64, bucket_mb=0.005),
    child_s=90,
)
FULL = Sizes(
    dense=dict(  # Qwen3-1.7B's shapes (its config.json), random weights: 1.72B parameters
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        tie_embeddings=True,
    ),
    moe=dict(  # a small Qwen3-MoE with Qwen3's vocabulary and head shapes: 32 experts, top 4, 8 layers (0.6B)
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=128,
        num_experts=32,
        experts_per_token=4,
        moe_intermediate_size=512,
        dense_layers=(0,),
    ),
    rows=32,
    prompt=32,
    new=64,
    bench_rows=64,
    bench_new=128,
    reps=3,
    sync=dict(hidden=1024, experts=16, inter=512, layers=2, vocab=8192, bucket_mb=16),
    child_s=120,
)


# ---------------------------------------------------------------------------------------------------------- records
class Recorder:
    "Appends one JSON line per record to `path` (flushed at once: a killed run keeps what it wrote)"

    def __init__(self, path: Path):
        self.path, self.records, self.current = path, [], 'startup'
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open('w')

    def write(self, record: dict):
        record = clean(record)
        self.records.append(record)
        self.file.write(json.dumps(record) + '\n')
        self.file.flush()


def clean(x):
    "`x` as strict JSON: floats that are not finite become strings, tensors and tuples lists"
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    if isinstance(x, torch.Tensor):
        return clean(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def check(name: str, passed: bool, value=None, bound=None) -> dict:
    "One asserted figure: the section fails when `passed` is False"
    return dict(name=name, passed=bool(passed), value=value, bound=bound)


# ---------------------------------------------------------------------------------------------------------- helpers
def sync_device(device: torch.device):
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def free_memory():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build(fields: dict):
    "A Qwen3 or Qwen3-MoE of these shapes (fp32, on the CPU, seed 0), built once: callers copy it before they change it"
    return _build(tuple(sorted(fields.items())))


@functools.cache
def _build(fields: tuple):
    from molt_nb.models import TinyConfig, build_model, build_tokenizer

    return build_model(TinyConfig(**dict(fields)), build_tokenizer())


def prompts_for(rows: int, longest: int, vocab: int, seed: int) -> list:
    "`rows` prompts of random ids, longest // 2 .. longest tokens (so batches are ragged)"
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, longest // 2), longest + 1, (rows,), generator=g)
    return [torch.randint(0, vocab, (int(n),), generator=g) for n in lengths]


def sample(model, device, prompts: list, new: int, dtype=None, seed: int = 0) -> list:
    "Generations of `prompts` from a TorchEngine on `device` (temperature 1, exactly `new` tokens each)"
    from molt_nb.core import SamplingParams
    from molt_nb.engine import TorchEngine

    engine = TorchEngine(copy.deepcopy(model), dtype=dtype, seed=seed, device=device)
    sp = SamplingParams(temperature=1.0, max_tokens=new)

    async def go():
        return await asyncio.gather(*[engine.generate(p, sp) for p in prompts])

    try:
        return asyncio.run(go())
    finally:
        engine.close()


def rollout_batch(prompts: list, gens: list, vocab: int):
    "The collated batch of one-segment rollouts in groups of 4 (rewards 1, 0, 1, 0: every group has advantages)"
    from molt_nb.chat import absorb
    from molt_nb.core import Segment, Trajectory, collate

    trs = [
        Trajectory(f"r{i}", f"g{i // 4}", i // 4, [absorb(Segment.prompt(p), g)], reward=float(i % 2 == 0))
        for i, (p, g) in enumerate(zip(prompts, gens))
    ]
    return collate(trs, vocab_size=vocab)


def actor_for(model, device, **kw):
    from molt_nb.actor import PolicyActor
    from molt_nb.config import AlgoConfig, OptimConfig

    return PolicyActor(model, AlgoConfig(), OptimConfig(grad_clip=1.0), device=device, **kw)


def gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict:
    "max, mean and p99 of |a - b| over `mask`"
    d = (a.double() - b.double()).abs()[mask.bool()]
    return dict(max=float(d.max()), mean=float(d.mean()), p99=float(torch.quantile(d, 0.99)), tokens=int(d.numel()))


# ---------------------------------------------------------------------------------------------- 1. engine logprobs
def section_logprobs(device, sizes: Sizes) -> dict:
    model = build(sizes.dense)
    V = model.config.vocab_size
    prompts = prompts_for(sizes.rows, sizes.prompt, V, seed=1)
    out, checks = dict(model=describe(model), rows=sizes.rows, new_tokens=sizes.new), []
    t0 = time.perf_counter()
    fp32_trainer = actor_for(copy.deepcopy(model), device)
    bf16_trainer = actor_for(copy.deepcopy(model).to(torch.bfloat16), device)
    for engine_dtype in (torch.float32, torch.bfloat16):
        gens = sample(model, device, prompts, sizes.new, dtype=engine_dtype, seed=2)
        assert all(len(g) == sizes.new for g in gens), [len(g) for g in gens]
        batch = rollout_batch(prompts, gens, V)
        name = str(engine_dtype).removeprefix('torch.')
        out[f"engine_{name}_vs_trainer_float32"] = g32 = gap(
            fp32_trainer.logprobs(batch), batch.logprobs, batch.action_mask
        )
        if engine_dtype == torch.float32:
            checks.append(
                check(
                    'fp32 engine vs fp32 trainer: max |dlogp|', g32['max'] < LOGP_BOUND, g32['max'], f"< {LOGP_BOUND}"
                )
            )
        else:
            out['engine_bfloat16_vs_trainer_bfloat16'] = gap(
                bf16_trainer.logprobs(batch), batch.logprobs, batch.action_mask
            )
    out['seconds'] = time.perf_counter() - t0
    return out | dict(checks=checks)


def describe(model) -> dict:
    c = model.config
    d = dict(
        type=type(model).__name__,
        params=sum(p.numel() for p in model.parameters()),
        layers=c.num_hidden_layers,
        hidden=c.hidden_size,
        vocab=c.vocab_size,
    )
    if getattr(c, 'num_experts', 0):
        d |= dict(experts=c.num_experts, top_k=c.num_experts_per_tok, dense_layers=list(c.mlp_only_layers))
    return d


# --------------------------------------------------------------------------------------------------- 2. routing R3
def section_routing(device, sizes: Sizes) -> dict:
    from molt_nb.routing import RoutingConfig, route_agreement

    model = build(sizes.moe)
    V, L, k = model.config.vocab_size, model.config.num_hidden_layers, model.config.num_experts_per_tok
    prompts = prompts_for(sizes.rows, sizes.prompt, V, seed=3)
    out, checks = dict(model=describe(model), rows=sizes.rows, new_tokens=sizes.new), []
    t0 = time.perf_counter()
    for engine_dtype in (torch.bfloat16, torch.float32):
        name = f"engine_{str(engine_dtype).removeprefix('torch.')}"
        gens = sample(model, device, prompts, sizes.new, dtype=engine_dtype, seed=4)
        shapes_ok = all(tuple(g.routes.shape) == (g.prompt_len + len(g), L, k) for g in gens)
        dense_unknown = all(bool((g.routes[:, list(model.config.mlp_only_layers)] == -1).all()) for g in gens)
        checks.append(check(f"{name}: routes (P+N, layers, top_k), -1 on dense layers", shapes_ok and dense_unknown))
        batch = rollout_batch(prompts, gens, V)
        actor = actor_for(copy.deepcopy(model), device, routing=RoutingConfig(replay=True, compare=True))
        # the direct measure: one forward of the whole batch with its routes replayed
        with torch.no_grad(), actor.router.replaying(batch.routes.to(device), batch.attention_mask.to(device)):
            actor.model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device))
        natural, used = actor.router.last(tuple(batch.input_ids.shape))
        direct = route_agreement(batch.routes, used, batch.attention_mask)
        natural = route_agreement(batch.routes, natural, batch.attention_mask)
        # the loop's measure: a train step's routing/ metrics (replayed, and the same rows with live routing)
        m = actor.train_step(batch).metrics
        step = {key.removeprefix('routing/'): v for key, v in m.items() if key.startswith('routing/')}
        out[name] = dict(
            direct_agreement=direct.get('agreement'),
            direct_tokens=direct['tokens'],
            natural_agreement=natural.get('agreement'),
            natural_flip_frac=natural.get('flip_frac'),
            step=step,
        )
        checks.append(
            check(
                f"{name}: replayed agreement (direct forward) == 1.0",
                direct.get('agreement') == 1.0 and direct['tokens'] > 0,
                direct.get('agreement'),
                '== 1.0',
            )
        )
        checks.append(
            check(
                f"{name}: train_step routing/agreement == 1.0",
                m.get('routing/agreement') == 1.0,
                m.get('routing/agreement'),
                '== 1.0',
            )
        )
        del actor
        free_memory()
    out['seconds'] = time.perf_counter() - t0
    return out | dict(checks=checks)


# --------------------------------------------------------------------------------------------------- 3. weight sync
def sync_set(spec: dict, device) -> list:
    """(name, tensor) of a MoE-shaped model on `device`, the same in every process: bf16 experts and attention, fp32
    routers, odd sizes (alignment), and NaN, inf, -0.0 and a subnormal (only a bitwise copy keeps them all)"""
    g = torch.Generator().manual_seed(0)
    H, E, inter, V = spec['hidden'], spec['experts'], spec['inter'], spec['vocab']
    bf, f32 = torch.bfloat16, torch.float32
    shapes = [('model.embed_tokens.weight', (V, H), bf)]
    for i in range(spec['layers']):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.self_attn.q_proj.weight", (H, H), bf),
            (f"{p}.self_attn.q_norm.weight", (7,), bf),  # odd sizes: the next tensor starts unaligned
            (f"{p}.mlp.gate.weight", (E, H), f32),
            (f"{p}.mlp.experts.gate_up_proj", (E, 2 * inter, H), bf),
            (f"{p}.mlp.experts.down_proj", (E, H, inter), bf),
            (f"{p}.input_layernorm.weight", (3,), torch.float16),
        ]
    items = [(n, torch.randn(s, generator=g).to(dt)) for n, s, dt in shapes]
    special = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 1e-45, 1.0], dtype=f32)
    items += [('special.float32', special), ('special.bfloat16', special.to(bf))]
    return [(n, t.to(device)) for n, t in items]


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    "Same dtype, shape and bytes (NaN payloads and -0.0 included)"
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = lambda t: t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return torch.equal(view(a), view(b))


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def compare_items(sent: list, got: list, device_type: str) -> dict:
    "How `got` (name, tensor) matches `sent`: names in order, dtypes, device, bytes"
    names_ok = [n for n, _ in got] == [n for n, _ in sent]
    got = dict(got)
    mismatched = [n for n, t in sent if n not in got or not bitwise(t, got[n])]
    wrong_device = [n for n, t in got.items() if t.device.type != device_type]
    return dict(
        names_in_order=names_ok,
        tensors=len(sent),
        mismatched=mismatched[:5],
        wrong_device=wrong_device[:5],
        dtypes=sorted({str(t.dtype).removeprefix('torch.') for _, t in sent}),
        exact=names_ok and not mismatched and not wrong_device,
    )


def section_sync_inprocess(device, sizes: Sizes) -> dict:
    "The in-process transport, a bucket at a time: the sender's tensors themselves, onto the receiver's device"
    items = sync_set(sizes.sync, device)
    sender = WeightSender('inprocess', bucket_mb=sizes.sync['bucket_mb'])
    t0 = time.perf_counter()
    m = sender.send(items, version=3)
    parts = list(WeightReceiver('inprocess', device=device).buckets(m, target_names=[n for n, _ in items]))
    got = [nt for part in parts for nt in part]
    sync_device(device)
    seconds = time.perf_counter() - t0
    limit = sizes.sync['bucket_mb'] * 2**20
    alone = [b.tensors[0].name for b in m.buckets if len(b.tensors) == 1 and b.nbytes > limit]
    r = compare_items(items, got, device.type)
    on_device = all(t.device.type == device.type for bucket in m.payload for _, t in bucket)
    checks = [
        check('in-process round trip bitwise (dtypes, names, device)', r['exact'], r['mismatched'] or None),
        check('buffers stay on the device', on_device),
        check('several buckets, an oversized tensor alone', len(m.buckets) > 1 and bool(alone), len(m.buckets)),
        check('one bucket per step of the receiver', [len(p) for p in parts] == [len(b.tensors) for b in m.buckets]),
    ]
    return dict(r, nbytes=m.nbytes, buckets=len(m.buckets), alone=alone, seconds=seconds, checks=checks)


def ipc_child(inbox, outbox):
    "Receive the buckets through torch.multiprocessing, unpack, digest every tensor, copy each bucket into an echo"
    try:
        from molt_nb.weight_sync import unpack

        manifest, flats, echoes = inbox.get(timeout=120)
        found = {}
        for b, flat, echo in zip(manifest.buckets, flats, echoes):
            for name, t in unpack(b, flat):
                found[name] = (str(t.device), str(t.dtype).removeprefix('torch.'), digest(t))
            echo.copy_(flat)  # written into the parent's memory (shared: CUDA IPC or CPU shared memory)
        if flats and flats[0].is_cuda:
            torch.cuda.synchronize()
        outbox.put(dict(ok=True, found=found, devices=sorted({str(f.device) for f in flats})))
    except BaseException as e:
        outbox.put(dict(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:]))


def section_sync_ipc(device, sizes: Sizes) -> dict:
    from molt_nb.weight_sync import pack

    items = sync_set(sizes.sync, device)
    m = WeightSender('inprocess', bucket_mb=sizes.sync['bucket_mb']).manifest(items, 3)
    tensors = dict(items)
    flats = [pack(b, tensors) for b in m.buckets]
    echoes = [
        torch.full_like(f, 0xAB) for f in flats
    ]  # the child copies each bucket here (CPU: moved to shared memory)
    ctx = mp.get_context('spawn')
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=ipc_child, args=(inbox, outbox), daemon=True)
    t0 = time.perf_counter()
    child.start()
    try:
        inbox.put((m, flats, echoes))
        reply = outbox.get(timeout=sizes.child_s)
        child.join(timeout=30)
    finally:
        if child.is_alive():
            child.kill()
    seconds = time.perf_counter() - t0
    if not reply['ok']:
        raise RuntimeError(f"the IPC child failed: {reply['error']}\n{reply['trace']}")
    sync_device(device)
    want = {n: (str(t.device), str(t.dtype).removeprefix('torch.'), digest(t)) for n, t in items}
    found = reply['found']
    mismatched = [n for n in want if n not in found or found[n][1:] != want[n][1:]]
    wrong_device = [n for n, f in found.items() if torch.device(f[0]).type != device.type]
    echo_ok = all(bitwise(e, f) for e, f in zip(echoes, flats))
    mechanism = 'CUDA IPC handles' if device.type == 'cuda' else 'CPU shared memory (no CUDA)'
    checks = [
        check('child unpacked every tensor bitwise (sha256), dtypes kept', not mismatched, mismatched[:5] or None),
        check("child's tensors live on the device", not wrong_device, wrong_device[:5] or None),
        check("child's writes into the parent's buffers arrive bitwise", echo_ok),
    ]
    return dict(
        mechanism=mechanism,
        child_devices=reply['devices'],
        tensors=len(want),
        nbytes=m.nbytes,
        seconds_with_spawn=seconds,
        checks=checks,
    )


def transport_rank(rank, port, backend, device_name, spec, direct, timeout_s, box, outbox):
    """One rank of a 2-process transport group: rank 0 sends the sync set with `WeightSender('broadcast')`, rank 1
    receives with `WeightReceiver` and compares bitwise with its own copy. `direct`: the group's buffers are on the
    device (CUDA buffers handed to gloo)"""
    r = dict(rank=rank, backend=backend, direct=direct)
    try:
        torch.set_num_threads(1)
        device = torch.device(device_name)
        if device.type == 'cuda':
            torch.cuda.set_device(0)
        items = sync_set(spec, device)
        t0 = time.perf_counter()
        group = join_transport_group('127.0.0.1', port, rank, 2, backend=backend, timeout_s=timeout_s)
        if direct:
            group = dataclasses.replace(group, device=device)
        r['group_device'] = str(group.device)
        if rank == 0:
            sender = WeightSender('broadcast', group, bucket_mb=spec['bucket_mb'])
            box.put(sender.manifest(items, 5))
            m = sender.send(items, 5)
            r |= dict(ok=True, nbytes=m.nbytes, buckets=len(m.buckets))
        else:
            m = box.get(timeout=timeout_s)
            got = WeightReceiver('broadcast', group).receive(m, target_names=[n for n, _ in items])
            landed = sorted({str(t.device) for _, t in got})
            got = [(n, t.to(device)) for n, t in got]  # the engine's load: onto its device
            sync_device(device)
            r |= compare_items(items, got, device.type) | dict(ok=True, landed_on=landed)
        r['seconds'] = time.perf_counter() - t0
    except BaseException as e:
        r |= dict(ok=False, error=f"{type(e).__name__}: {str(e)[:600]}")
    outbox.put(r)


def run_pair(backend: str, device, sizes: Sizes, direct: bool = False, may_fail: bool = False) -> dict:
    """Both ranks of a transport group in spawned processes, killed past their deadline (`may_fail`: a short one, for
    a pairing that may be refused and hang rather than raise)"""
    ctx = mp.get_context('spawn')
    box, outbox, port = ctx.Queue(), ctx.Queue(), free_port()
    timeout_s, limit = (30, 75) if may_fail else (60, sizes.child_s)
    args = (port, backend, str(device), sizes.sync, direct, timeout_s, box, outbox)
    procs = [ctx.Process(target=transport_rank, args=(r, *args)) for r in range(2)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + limit
    while len(results) < 2 and time.monotonic() < deadline:
        try:
            res = outbox.get(timeout=1)
            results[res['rank']] = res
            if not res['ok']:  # its peer would wait out the group's timeout for nothing: give it 5 s to report
                deadline = min(deadline, time.monotonic() + 5)
        except Exception:
            if all(not p.is_alive() for p in procs) and outbox.empty():
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    missing = lambda r: dict(rank=r, ok=False, error=f"no report: killed or died (exit code {procs[r].exitcode})")
    return dict(
        ranks=[results.get(r) or missing(r) for r in range(2)],
        seconds_with_spawn=time.perf_counter() - t0,
    )


def section_sync_gloo(device, sizes: Sizes) -> dict:
    "The project's gloo path: CUDA tensors packed on the device, broadcast through host buffers, loaded back"
    res = run_pair('gloo', device, sizes)
    sender, receiver = res['ranks']
    ok = sender.get('ok') and receiver.get('ok')
    checks = [
        check('gloo round trip ran on both ranks', ok, None if ok else [sender.get('error'), receiver.get('error')]),
        check(
            'gloo round trip bitwise (dtypes, names, device)',
            ok and receiver.get('exact'),
            receiver.get('mismatched') or None,
        ),
    ]
    return res | dict(checks=checks)


def section_sync_gloo_cuda(device, sizes: Sizes) -> dict:
    "gloo handed CUDA buffers directly (no copy to the host in our code): recorded, whether gloo takes them or not"
    res = run_pair('gloo', device, sizes, direct=True, may_fail=True)
    sender, receiver = res['ranks']
    ok = bool(sender.get('ok') and receiver.get('ok'))
    res['outcome'] = 'ok' if ok else 'refused'
    res['reason'] = None if ok else sender.get('error') or receiver.get('error')
    checks = [check('gloo on CUDA buffers, when it runs, is bitwise', receiver.get('exact'))] if ok else []
    return res | dict(checks=checks)


def section_sync_nccl(device, sizes: Sizes) -> dict:
    "NCCL between two processes: on one GPU both ranks sit on device 0, which NCCL refuses; recorded, not failed"
    res = run_pair('nccl', device, sizes, may_fail=True)
    sender, receiver = res['ranks']
    ok = bool(sender.get('ok') and receiver.get('ok'))
    res['gpus'] = torch.cuda.device_count()
    res['outcome'] = 'ok' if ok else 'refused'
    res['reason'] = None if ok else sender.get('error') or receiver.get('error')
    checks = [check('nccl round trip, when it runs, is bitwise', receiver.get('exact'))] if ok else []
    return res | dict(checks=checks)


# --------------------------------------------------------------------------------------------------- 4. FSDP2 world 1
def section_fsdp(device, sizes: Sizes) -> dict:
    from molt_nb.actor import join_group, leave_group

    backend = 'nccl' if device.type == 'cuda' else 'gloo'
    if device.type == 'cuda':
        torch.cuda.set_device(device)
    out, checks, t0 = dict(backend=backend, world_size=1), [], time.perf_counter()
    dp = join_group(0, 1, port=free_port(), backend=backend, timeout_s=120)
    try:
        for kind, fields in (('dense', sizes.dense), ('moe', sizes.moe)):
            model = build(fields)
            V = model.config.vocab_size
            prompts = prompts_for(sizes.rows, sizes.prompt, V, seed=5)
            batch = rollout_batch(prompts, sample(model, device, prompts, sizes.new, seed=6), V)
            steps, weights, sharded = {}, {}, None
            for name in ('plain', 'control', 'fsdp'):  # one at a time: three fp32 trainers of 1.7B would not fit
                a = actor_for(
                    copy.deepcopy(model), device, micro_batch_rows=4, **(dict(dp=dp) if name == 'fsdp' else {})
                )
                steps[name] = [a.train_step(batch) for _ in range(2)]
                weights[name] = [(n, t.detach().cpu()) for n, t in a.full_weights()]
                sharded = type(a.model.model.layers[0]).__name__ if name == 'fsdp' else sharded
                del a
                free_memory()
            r = dict(model=describe(model), sharded=sharded)
            for other in ('fsdp', 'control'):
                r[f"{other}_vs_plain"] = weight_diff(weights['plain'], weights[other]) | step_diff(
                    steps['plain'], steps[other], batch
                )
            f = r['fsdp_vs_plain']
            checks.append(
                check(
                    f"{kind}: FSDP2 world-1 weights after 2 steps within {FSDP_RTOL:g} of max |w|",
                    f['names_equal'] and f['relative'] <= FSDP_RTOL,
                    f['relative'],
                    f"<= {FSDP_RTOL:g}",
                )
            )
            out[kind] = r
            del steps, weights
            free_memory()
    finally:
        leave_group()
    out['seconds'] = time.perf_counter() - t0
    return out | dict(checks=checks)


def weight_diff(a: list, b: list) -> dict:
    "How two (name, tensor) lists differ: names, max |dw|, that over max |w|, bitwise"
    names_equal = [n for n, _ in a] == [n for n, _ in b]
    b = dict(b)
    diffs = {n: float((t.double() - b[n].double()).abs().max()) for n, t in a if n in b}
    scale = max(float(t.abs().max()) for _, t in a)
    worst = max(diffs, key=diffs.get)
    return dict(
        names_equal=names_equal,
        max_abs=diffs[worst],
        worst=worst if diffs[worst] > 0 else None,
        max_weight=scale,
        relative=diffs[worst] / scale,
        bitwise=names_equal and all(bitwise(t, b[n]) for n, t in a),
        tensors_differing=sum(d > 0 for d in diffs.values()),
        tensors=len(diffs),
    )


def step_diff(a: list, b: list, batch) -> dict:
    "How two runs' step reports differ: loss and grad norm per step, trainer logprobs over the action tokens"
    return dict(
        loss=[abs(x.metrics['loss'] - y.metrics['loss']) for x, y in zip(a, b)],
        grad_norm=[abs(x.metrics['grad_norm'] - y.metrics['grad_norm']) for x, y in zip(a, b)],
        logprobs_max=[float((x.logprobs - y.logprobs).abs()[batch.action_mask].max()) for x, y in zip(a, b)],
    )


# ------------------------------------------------------------------------------------------------- 5. throughput
def hf_generate(model, prompts: torch.Tensor, new: int):
    "transformers' batched generate, sampled at temperature 1 with logprobs from its scores (as the engine returns)"
    with torch.inference_mode():
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=True,
            max_new_tokens=new,
            min_new_tokens=new,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
        )
        tokens = out.sequences[:, prompts.shape[1] :]
        logprobs = torch.stack(out.scores, 1).float().log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    sync_device(prompts.device)
    assert tokens.shape == (len(prompts), new), tokens.shape
    return tokens, logprobs.cpu()


def section_throughput(device, sizes: Sizes) -> dict:
    from molt_nb.core import SamplingParams
    from molt_nb.engine import TorchEngine

    dtype = torch.bfloat16 if device.type == 'cuda' else torch.float32
    model = build(sizes.dense)
    B, P, N = sizes.bench_rows, sizes.prompt, sizes.bench_new
    prompts = torch.randint(0, model.config.vocab_size, (B, P), generator=torch.Generator().manual_seed(7))
    ref = copy.deepcopy(model).to(device=device, dtype=dtype).eval()
    engine = TorchEngine(copy.deepcopy(model), dtype=dtype, seed=0, device=device)
    sp = SamplingParams(temperature=1.0, max_tokens=N)
    loop = asyncio.new_event_loop()

    def run_engine():
        async def go():
            return await asyncio.gather(*[engine.generate(p, sp) for p in prompts])

        gens = loop.run_until_complete(go())
        assert all(len(g) == N for g in gens)

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    try:
        on_device = prompts.to(device)
        timed(lambda: hf_generate(ref, on_device, N))  # warm-ups: kernels, allocator, the engine's buffers
        timed(run_engine)
        t_hf, t_eng = [], []
        for _ in range(sizes.reps):
            t_hf.append(timed(lambda: hf_generate(ref, on_device, N)))
            t_eng.append(timed(run_engine))
    finally:
        engine.close()
        loop.close()
    hf_tok_s, eng_tok_s = B * N / statistics.median(t_hf), B * N / statistics.median(t_eng)
    return dict(
        model=describe(model),
        dtype=str(dtype).removeprefix('torch.'),
        prompts=B,
        prompt_tokens=P,
        new_tokens=N,
        reps=sizes.reps,
        generate_s=t_hf,
        engine_s=t_eng,
        generate_tok_s=hf_tok_s,
        engine_tok_s=eng_tok_s,
        engine_over_generate=eng_tok_s / hf_tok_s,
        checks=[],
    )


# ------------------------------------------------------------------------------------------- 6. memory against the plan
PLAN_EXACT = 0.05  # the plan's exact components (parameters, gradients, optimizer) against what CUDA allocated


def smoke_config(fields: dict, rows: int, tokens: int, device: str):
    "The smoke trainer's run config: the dense model in one process on `device`, engines in bf16 (recipes/parity)"
    from molt_nb.config import load_config

    shape = [f"model.{k}={json.dumps(v)}" for k, v in fields.items()]  # TOML reads JSON's numbers, lists, booleans
    overrides = shape + [
        f'cluster.device="{device}"',
        'rollout.dtype="bfloat16"',
        f'train.micro_batch_rows={rows}',
        f'agent_options={{max_context={tokens}}}',
        f'model.max_position={tokens}',
        'run_dir="/tmp/molt-gpu-smoke"',
    ]
    return load_config(Path(__file__).resolve().parents[1] / 'recipes' / 'parity', overrides)


def synthetic_batch(rows: int, tokens: int, vocab: int):
    "`rows` rows of `tokens` random ids, the second half of each trained (version 0, rewards 1, 0, 1, 0, ...)"
    from molt_nb.core import Batch

    g = torch.Generator().manual_seed(8)
    act = torch.zeros(rows, tokens - 1, dtype=torch.bool)
    act[:, tokens // 2 :] = True
    return Batch(
        input_ids=torch.randint(0, vocab, (rows, tokens), generator=g),
        attention_mask=torch.ones(rows, tokens, dtype=torch.bool),
        action_mask=act,
        logprobs=torch.full((rows, tokens - 1), -12.0) * act,
        versions=torch.zeros(rows, tokens - 1, dtype=torch.int32),
        rewards=(torch.arange(rows) % 2).float(),
        scores=(torch.arange(rows) % 2).float(),
        prompt_index=torch.arange(rows) // 4,
        segment_index=torch.zeros(rows, dtype=torch.long),
        truncated=torch.zeros(rows, dtype=torch.bool),
        rollout_ids=[f"r{i}" for i in range(rows)],
        group_ids=[f"g{i // 4}" for i in range(rows)],
    )


def allocated() -> int:
    "Bytes CUDA's allocator holds for live tensors now"
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def reset_peak():
    torch.cuda.reset_peak_memory_stats()


def peak() -> int:
    "The most bytes live tensors held since `reset_peak`"
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def near(measured: int, planned: int) -> bool:
    return abs(measured - planned) <= PLAN_EXACT * planned


def section_memory(device, sizes: Sizes) -> dict:
    """The plan's trainer rank (`molt_nb.memory.trainer_components`, one process) against what CUDA allocates for the
    same config: its parameters, gradients and optimizer state within 5%, a step's peak below the planned peak, the
    snapshot's gather; then the streamed transfer from the host snapshot into a second model copy (a bf16 TorchEngine on
    the GPU) within the plan's two buckets, every tensor bitwise. The trainer is the run's (`PolicyActor` with the
    run's chunk size, `host_copy`, `WeightSender`), not `molt_nb.loop.Trainer`, whose imports (pyarrow, cloudpickle)
    the GPU machine lacks"""
    from molt_nb import memory
    from molt_nb.config import build_policy
    from molt_nb.weight_sync import host_copy

    rows, tokens = 4, 4 * sizes.prompt
    cfg = smoke_config(sizes.dense, rows, tokens, device.type)
    plan = memory.trainer_components(cfg)
    reset_peak()
    base = allocated()
    actor = actor_for(build_policy(cfg)[0], device, micro_batch_rows=rows, logprob_chunk=cfg.train.logprob_chunk)
    batch = synthetic_batch(rows, tokens, cfg.model.vocab_size)
    got = dict(parameters=allocated() - base)
    adv = actor.advantages(batch)
    actor._accumulate(batch, adv, actor.live_rows(batch, adv))
    got['gradients'] = allocated() - base - got['parameters']
    actor.opt.zero_grad(set_to_none=True)
    reset_peak()
    actor.train_step(batch)
    got['step_peak'] = peak() - base
    got['optimizer'] = allocated() - base - got['parameters']
    planned_peak = sum(v for k, v in plan.items() if k not in ('runtime', 'transfer'))  # runtime: outside torch's
    reset_peak()
    before = allocated()
    snapshot = host_copy(actor.iter_weights(getattr(torch, cfg.rollout.dtype)))
    got['snapshot_gather'], held = peak() - before, sum(t.nbytes for _, t in snapshot)
    checks = [check(f"{k} within 5% of the plan's", near(got[k], plan[k]), got[k], plan[k]) for k in TRAINED]
    checks += [
        check("a step's peak at most the plan's", got['step_peak'] <= planned_peak, got['step_peak'], planned_peak),
        check(
            'the snapshot holds no GPU memory and gathers at most its plan',
            allocated() <= before and got['snapshot_gather'] <= plan['snapshot_gather'],
            got['snapshot_gather'],
            plan['snapshot_gather'],
        ),
        check("one host snapshot of the model in the engines' dtype", held == memory.snapshot_bytes(cfg), held),
    ]
    return dict(plan=plan, measured=got) | intake(snapshot, cfg, device, memory.transfer_bytes(cfg), checks)


TRAINED = ('parameters', 'gradients', 'optimizer')


def intake(snapshot: list, cfg, device, planned: int, checks: list) -> dict:
    "`snapshot` streamed into a bf16 TorchEngine on the device (the engine paused), measured against `planned`"
    from molt_nb.config import build_policy
    from molt_nb.engine import TorchEngine
    from molt_nb.router import Intake

    async def go():
        engine = TorchEngine(build_policy(cfg)[0], dtype=torch.bfloat16, device=device)
        try:
            await engine.pause()
            manifest = WeightSender('inprocess', bucket_mb=cfg.cluster.bucket_mb).send(snapshot, 1)
            reset_peak()
            before = allocated()
            await Intake(engine).take(manifest, 'inprocess')
            held = peak() - before
            loaded = dict(engine.model.named_parameters())
            same = all(bitwise(t.to(device), loaded[n].detach()) for n, t in snapshot)
            return held, same, len(manifest.buckets)
        finally:
            engine.close()

    held, same, buckets = asyncio.run(go())
    checks += [
        check("the transfer into a second copy held at most two buckets (the plan's)", held <= planned, held, planned),
        check("every tensor of the second copy is the snapshot's, bitwise", same),
    ]
    return dict(transfer_peak=held, buckets=buckets, checks=checks)


# --------------------------------------------------------------------------------------------------------- driver
SECTIONS = [  # (name, function, needs CUDA)
    ('logprobs', section_logprobs, False),
    ('routing', section_routing, False),
    ('weight_sync.inprocess', section_sync_inprocess, False),
    ('weight_sync.ipc', section_sync_ipc, False),
    ('weight_sync.gloo', section_sync_gloo, False),
    ('weight_sync.gloo_cuda_buffers', section_sync_gloo_cuda, True),
    ('weight_sync.nccl', section_sync_nccl, True),
    ('fsdp', section_fsdp, False),
    ('throughput', section_throughput, False),
    ('memory', section_memory, True),
]


def environment(device) -> dict:
    import transformers
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Model

    env = dict(
        section='environment',
        device=str(device),
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        # TorchEngine's prefill passes its KV cache as `cache=`, the name transformers' models take since they renamed
        # `past_key_values`; where they do not, the cache is silently dropped and every logprob after the first token
        # of a rollout is wrong (transformers 5.17: section logprobs fails by ~0.2)
        model_forward_takes_cache=MODEL_CACHE_KWARG in inspect.signature(Qwen3Model.forward).parameters,
        cuda_available=torch.cuda.is_available(),
        cpus=os.cpu_count(),
    )
    if torch.cuda.is_available():
        env |= dict(
            cuda=torch.version.cuda,
            gpus=torch.cuda.device_count(),
            gpu=torch.cuda.get_device_name(0),
            capability=list(torch.cuda.get_device_capability(0)),
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
        )
    return env


def watchdog(rec: Recorder, seconds: float):
    "Stop the whole script past `seconds` (a hung collective must not eat the device lease), recording where"

    def fire():
        rec.write(dict(section='watchdog', error=f"the script ran past {seconds:.0f} s, in section {rec.current!r}"))
        print(f"gpu_smoke: watchdog fired in {rec.current!r} after {seconds:.0f} s", file=sys.stderr, flush=True)
        os._exit(3)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()
    return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu', help="'cuda' or 'cpu'")
    ap.add_argument('--out', default=os.environ.get('OUT', '.'), help='directory for gpu_smoke.jsonl (default $OUT)')
    ap.add_argument('--quick', action='store_true', help='tiny sizes (the CPU test)')
    ap.add_argument('--only', nargs='*', help='run only these sections (names as in the JSON lines)')
    ap.add_argument('--deadline', type=float, default=450, help='seconds before the watchdog stops the script')
    args = ap.parse_args(argv)
    start = time.perf_counter()
    rec = Recorder(Path(args.out) / 'gpu_smoke.jsonl')
    timer = watchdog(rec, args.deadline)
    try:
        return run_sections(args, rec, start)
    finally:
        timer.cancel()
        rec.file.close()


def run_sections(args, rec: Recorder, start: float) -> int:
    "Every section in turn, each record written as it ends; then the summary; the exit status"
    sizes, device = QUICK if args.quick else FULL, torch.device(args.device)
    rec.write(environment(device) | dict(quick=args.quick))
    torch.manual_seed(0)
    for name, fn, needs_cuda in SECTIONS:
        if args.only and name not in args.only:
            continue
        rec.current = name
        if device.type == 'cuda' and not torch.cuda.is_available():
            rec.write(dict(section=name, skipped='CUDA is not available (torch.cuda.is_available() is False)'))
            continue
        if needs_cuda and device.type != 'cuda':
            why = 'needs CUDA: ' + (
                '--device cpu' if torch.cuda.is_available() else 'torch.cuda.is_available() is False'
            )
            rec.write(dict(section=name, skipped=why))
            continue
        t0 = time.perf_counter()
        try:
            r = fn(device, sizes)
            r['passed'] = all(c['passed'] for c in r['checks'])
            rec.write(dict(section=name) | r | dict(wall_s=time.perf_counter() - t0))
        except Exception as e:
            rec.write(
                dict(
                    section=name,
                    error=f"{type(e).__name__}: {e}",
                    trace=traceback.format_exc()[-3000:],
                    wall_s=time.perf_counter() - t0,
                )
            )
        free_memory()
    rec.current = 'summary'
    done = [r for r in rec.records if r['section'] not in ('environment',)]
    failed = [f"{r['section']}: {c['name']}" for r in done for c in r.get('checks', []) if not c['passed']]
    errors = [r['section'] for r in done if 'error' in r]
    summary = dict(
        section='summary',
        passed=[r['section'] for r in done if r.get('passed')],
        failed_checks=failed,
        errors=errors,
        skipped=[r['section'] for r in done if 'skipped' in r],
        # the lent GPU machine has none of these: a module that pulls one in at import breaks the run there
        absent_there_but_imported=[m for m in ('ray', 'vllm', 'nbval') if m in sys.modules],
        seconds=time.perf_counter() - start,
    )
    rec.write(summary)
    print_summary(rec.records)
    print(f"wrote {rec.path}")
    return 1 if failed else 2 if errors else 0


def print_summary(records: list):
    "One line per section: its status, its checks, its headline figures"
    for r in records:
        s = r['section']
        if s == 'environment':
            print(
                f"environment: {r['device']}, torch {r['torch']}, transformers {r['transformers']}, "
                f"python {r['python']}" + (f", {r['gpu']} (CUDA {r['cuda']})" if 'gpu' in r else '')
            )
            if not r['model_forward_takes_cache']:
                print(
                    f"  WARNING: this transformers' Qwen3Model.forward has no {MODEL_CACHE_KWARG!r} argument: "
                    "TorchEngine's prefill cache is dropped, so its logprobs after the first token are wrong"
                )
        elif s == 'summary':
            print(
                f"summary: {len(r['passed'])} passed, {len(r['failed_checks'])} failed checks, {len(r['errors'])} "
                f"errors, {len(r['skipped'])} skipped, {r['seconds']:.1f} s"
            )
            for f in r['failed_checks']:
                print(f"  FAILED {f}")
        elif 'skipped' in r:
            print(f"{s}: skipped ({r['skipped']})")
        elif 'error' in r:
            print(f"{s}: ERROR {r['error']}")
        else:
            status = 'ok' if r.get('passed') else 'FAILED'
            figures = ', '.join(
                f"{c['name']} = {c['value']}" if c['value'] is not None else c['name'] for c in r['checks']
            )
            extra = ''
            if 'outcome' in r:
                extra = f" outcome {r['outcome']}" + (f": {r['reason'][:200]}" if r.get('reason') else '')
            if s == 'throughput':
                extra = (
                    f" generate {r['generate_tok_s']:,.0f} tok/s, engine {r['engine_tok_s']:,.0f} tok/s, "
                    f"ratio {r['engine_over_generate']:.2f}"
                )
            if s == 'logprobs':
                extra = ' bf16 engine vs fp32 trainer max {:.3g} mean {:.3g}'.format(
                    r['engine_bfloat16_vs_trainer_float32']['max'], r['engine_bfloat16_vs_trainer_float32']['mean']
                )
            print(f"{s}: {status} ({r.get('wall_s', 0):.1f} s) {figures}{extra}")


if __name__ == '__main__':
    sys.exit(main())
