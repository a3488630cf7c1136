"""The cluster smoke: four checks a user runs on their cluster after the launcher, before a long run.

a. `logprobs`: the engine's logprobs at step 0 against the trainer's recompute of the same tokens: k3 KL (Schulman's
   estimator of KL(engine || trainer), the mean of exp(r) - 1 - r with r = logp_trainer - logp_engine), |dlogp| mean
   and p99 over the sampled tokens.
b. `weight_sync`: one training step, its weights synced to the engine over the run's own transport (NCCL broadcast
   on GPUs, `Router.sync_weights`), then greedy turns from that engine against those of a fresh engine started from
   the trainer's saved weights: every token identical. vLLM batches differently in the two engines, so the engines
   run with VLLM_BATCH_INVARIANT=1 (vLLM's batch-invariant kernels; compute capability >= 9.0, an H100 qualifies).
c. `throughput`: the same prompts and sampling through the project's path (the Router in front of `VLLMEngine`,
   which runs `AsyncLLM` in this process) against `AsyncLLM.generate` called directly: tokens/s ratio.
d. `r3`: on a MoE policy, the experts vLLM routed each token to, replayed in the trainer's forward: the trainer's
   `routing/agreement` (the share of replayed top-k choices the forward used).

The checks take their engine, trainer and engine factory as arguments (`Rig`), built by `build_rig` from the run's
own pieces, the loop's `Trainer` and a `Router` over `EngineActor`s (vLLM when `rollout.engine = "vllm"`), with the
weight sync of `cluster.transport`: `ray_rig` (the default) starts them as Ray actors placed by the run's own
placement (`cluster.layout`: the trainer on its GPUs, engine 0 on others, the fresh engine of check b on others
still), `local_rig` (`--local`) in this process. The tests run both on CPU (tests/test_cluster_smoke.py), the local
one over the CI's stand-in for vLLM with each piece broken to see its check fail. The report is JSON (each figure,
its goal, passed or not); the exit status is 1 if a check failed or raised.

    # on the cluster, after cluster/slurm/ray-cluster.sh (or as its command), 2 x 8 GPUs:
    python cluster/smoke.py --dense Qwen/Qwen3-0.6B --moe random --report smoke.json \
        --weights /shared/smoke cluster.layout=\"split\" cluster.engine_gpus=1

The smoke's trainer is one rank in fp32 (the loop's `Trainer`), so each model must fit one GPU with its gradients and
AdamW state (16 bytes a parameter): the memory plan is checked before anything starts (`molt_nb.memory`), and Qwen3-8B
or Qwen3-30B-A3B are refused (152 and 514 GB planned for the trainer). `--moe random` builds a 0.6B Qwen3-MoE with
Qwen3's vocabulary and head shapes and random weights (32 experts, top 4) and saves it under `--weights`: routing
replay needs a MoE, not a trained one.

NOT RUN ON A GPU YET. The goals of check a are first guesses (reference/gpu-cluster.md, 3.4), to be recorded and
tightened on the first run; `--weights` must be a directory every node sees (the trainer writes, an engine reads).
"""

import argparse, asyncio, dataclasses, json, math, os, sys, tempfile, time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu_smoke import FULL, check, clean, gap, prompts_for, rollout_batch  # noqa: E402
from molt_nb.core import SamplingParams  # noqa: E402

GOALS = dict(  # name: (bound, how it is compared)
    k3_kl=(1e-3, '<'),  # a guess: bf16 kernels of two stacks on the same weights
    dlogp_mean=(0.01, '<'),  # a guess, consistent with Molt's geo IS band [0.99, 1.01]
    dlogp_p99=(0.1, '<'),
    greedy_identical=(1.0, '=='),  # the share of prompts whose greedy turns match token for token
    throughput_ratio=(0.9, '>='),  # the project's path over raw AsyncLLM
    r3_agreement=(1.0, '=='),  # the trainer's forward used the replayed experts
    r3_dlogp_mean=(0.01, '<'),  # and, replaying them, scores the engine's tokens as the engine did (routes aligned)
)


def figure(name: str, value: float) -> dict:
    "A figure against its goal in `GOALS`"
    bound, op = GOALS[name]
    ok = dict(zip(('<', '>=', '=='), (value < bound, value >= bound, value == bound)))[op]
    return check(name, ok and math.isfinite(value), value, f"{op} {bound:g}")


@dataclasses.dataclass
class Rig:
    "What the checks run on; every member is a seam (an actor call on a cluster, a local call in the tests)"

    engine: Any  # the project's rollout path: `generate(ids, sampling)` (a Router over the engines)
    vocab_size: int
    recompute: Callable  # async recompute(batch) -> (B, T) the trainer's logprobs of the batch's tokens
    train_step: Callable  # async train_step(batch) -> {'version', 'metrics'}: one optimizer step of the trainer
    sync: Callable  # async sync(version): the trainer's weights of `version` into `engine` (Router.sync_weights)
    save: Callable  # async save() -> a checkpoint directory of the trainer's current weights
    fresh: Callable  # async fresh(path) -> an engine started on that checkpoint (closed by `close_engine`)
    raw_generate: Callable  # async raw_generate(ids, sampling) -> tokens sampled, through AsyncLLM alone
    close_engine: Callable = lambda engine: None
    moe: 'Rig | None' = None  # a rig on a MoE policy with routing replay, for check d
    parts: dict = dataclasses.field(default_factory=dict)  # what it was built of (trainer, router), for inspection


async def sample(engine, prompts: list, sampling: SamplingParams) -> list:
    return await asyncio.gather(*[engine.generate(p.tolist(), sampling) for p in prompts])


# ----------------------------------------------------------------------------------------------- the four checks
async def check_logprobs(rig: Rig, prompts: list, new: int) -> dict:
    "a. The engine's logprobs at step 0 against the trainer's recompute"
    gens = await sample(rig.engine, prompts, SamplingParams(temperature=1.0, max_tokens=new))
    batch = rollout_batch(prompts, gens, rig.vocab_size)
    trainer = (await rig.recompute(batch)).double().cpu()
    mask = batch.action_mask.bool()
    r = (trainer - batch.logprobs.double())[mask]
    d = gap(trainer, batch.logprobs, batch.action_mask)
    k3 = float((torch.exp(r) - 1 - r).mean())
    checks = [figure('k3_kl', k3), figure('dlogp_mean', d['mean']), figure('dlogp_p99', d['p99'])]
    return dict(tokens=d['tokens'], dlogp_max=d['max'], checks=checks, batch=batch)


async def check_weight_sync(rig: Rig, batch, prompts: list, new: int) -> dict:
    "b. Greedy turns after a weight sync against a fresh engine on the saved weights"
    version = (await rig.train_step(batch))['version']
    await rig.sync(version)
    path = await rig.save()
    greedy = SamplingParams(temperature=0.0, max_tokens=new)
    synced = await sample(rig.engine, prompts, greedy)
    fresh = await rig.fresh(path)
    try:
        theirs = await sample(fresh, prompts, greedy)
    finally:
        rig.close_engine(fresh)
    same = [a.token_ids.tolist() == b.token_ids.tolist() for a, b in zip(synced, theirs)]
    first = next((i for i, s in enumerate(same) if not s), None)
    return dict(
        version=version,
        prompts=len(same),
        first_differing_prompt=first,
        checks=[figure('greedy_identical', sum(same) / len(same))],
    )


async def tokens_per_s(generate, prompts: list, sampling: SamplingParams, reps: int) -> float:
    "The median tokens/s of `reps` timed runs of every prompt at once through `generate` (after one warm-up)"
    rates = []
    for rep in range(reps + 1):
        start = time.perf_counter()
        counts = await asyncio.gather(*[generate(p.tolist(), sampling) for p in prompts])
        if rep:
            rates.append(sum(counts) / (time.perf_counter() - start))
    return sorted(rates)[len(rates) // 2]


async def check_throughput(rig: Rig, prompts: list, new: int, reps: int) -> dict:
    "c. The project's path (Router -> VLLMEngine) against AsyncLLM alone, the same prompts and sampling"
    sp = SamplingParams(temperature=1.0, max_tokens=new)

    async def ours(ids, sampling):
        return len((await rig.engine.generate(ids, sampling)).token_ids)

    raw = await tokens_per_s(rig.raw_generate, prompts, sp, reps)
    project = await tokens_per_s(ours, prompts, sp, reps)
    return dict(raw_tok_s=raw, project_tok_s=project, checks=[figure('throughput_ratio', project / raw)])


async def check_r3(rig: Rig, prompts: list, new: int) -> dict:
    "d. The engine's routes replayed in the trainer's forward choose the same experts"
    if rig.moe is None:
        return dict(skipped='no MoE policy given (--moe)', checks=[])
    moe = rig.moe
    gens = await sample(moe.engine, prompts, SamplingParams(temperature=1.0, max_tokens=new))
    batch = rollout_batch(prompts, gens, moe.vocab_size)
    known = int((batch.routes >= 0).sum()) if batch.routes is not None else 0
    if not known:
        return dict(error='the engine returned no routes: is routing.replay on, and the policy a MoE?', checks=[])
    # replay that works mechanically agrees with any routes; routes on the wrong tokens or layers show in the logprobs
    replayed = gap((await moe.recompute(batch)).double().cpu(), batch.logprobs, batch.action_mask)
    metrics = (await moe.train_step(batch))['metrics']
    value = metrics.get('routing/agreement', float('nan'))
    checks = [figure('r3_agreement', value), figure('r3_dlogp_mean', replayed['mean'])]
    return dict(routes=known, replayed_dlogp=replayed, metrics=metrics, checks=checks)


# --------------------------------------------------------------------------------------------------- the report
async def run_checks(rig: Rig, rows: int = 8, prompt_len: int = 16, new: int = 16, reps: int = 2) -> dict:
    "Every check in turn (one that raises is recorded and fails), the report"
    prompts = prompts_for(rows, prompt_len, min(rig.vocab_size, 1000), seed=0)
    report, batch = dict(sections={}), None

    async def section(name, coro):
        start = time.perf_counter()
        try:
            out = await coro
        except Exception as e:
            out = dict(error=f"{type(e).__name__}: {e}", checks=[])
        out['seconds'] = time.perf_counter() - start
        out['passed'] = 'error' not in out and all(c['passed'] for c in out['checks'])
        report['sections'][name] = out
        return out

    batch = (await section('logprobs', check_logprobs(rig, prompts, new))).pop('batch', None)
    if batch is None:
        report['sections']['weight_sync'] = dict(error='no step-0 batch (check a raised)', checks=[], passed=False)
    else:
        await section('weight_sync', check_weight_sync(rig, batch, prompts, new))
    await section('throughput', check_throughput(rig, prompts, new, reps))
    r3 = await section('r3', check_r3(rig, prompts, new))
    if 'skipped' in r3:
        r3['passed'] = None
    s = report['sections']
    report['failed'] = [n for n, r in s.items() if r['passed'] is False]
    report['passed'] = not report['failed']
    return clean(report)


def write_report(report: dict, path: Path) -> int:
    "Write the report as JSON, print one line a figure; the exit status (1 when a check failed)"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    for name, r in report['sections'].items():
        status = 'skipped' if r['passed'] is None else 'ok' if r['passed'] else 'FAILED'
        figures = ', '.join(f"{c['name']} = {c['value']:.4g} (goal {c['bound']})" for c in r.get('checks', []))
        print(f"{name}: {status} {figures} {r.get('error', r.get('skipped', ''))}".rstrip())
    print(f"report: {path}")
    return 0 if report['passed'] else 1


# ------------------------------------------------------------------------------------------------------ the rig
from molt_nb.loop import Trainer  # noqa: E402
from molt_nb.router import EngineActor, Router, call  # noqa: E402


class SmokeTrainer(Trainer):
    "The loop's Trainer, and what the smoke asks of it besides: a recompute, and its weights saved as a checkpoint"

    def logprobs(self, batch):
        return self.actor.logprobs(batch)

    def save_checkpoint(self, root: str) -> str:
        "Its current full weights as a Hugging Face checkpoint at `root` (a tied head left out)"
        from molt_nb.config import build_policy
        from molt_nb.models import save_policy

        model, tok = build_policy(self.cfg)
        missing, unexpected = model.load_state_dict(dict(self.actor.full_weights()), strict=False)
        tied = {'lm_head.weight'} if model.config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise ValueError(f"the trainer's weights do not fit its policy: missing {missing}, unexpected {unexpected}")
        save_policy(model, tok, root)
        return root


class SmokeEngine(EngineActor):
    "An engine of the run, and beside it the raw path check c compares it with: AsyncLLM (or the inner engine) alone"

    async def raw_generate(self, token_ids: list, sampling: SamplingParams) -> int:
        "Tokens sampled for `token_ids` by vLLM's AsyncLLM, with vLLM's own SamplingParams: no router, versions, routes"
        if not hasattr(self.engine, 'llm'):  # the torch engine: its own generate, without the actor's wrapping
            return len((await self.engine.generate(token_ids, sampling)).token_ids)
        from molt_nb.vllm_engine import import_vllm, sampling_kwargs

        vllm = import_vllm()
        self.raw_requests = getattr(self, 'raw_requests', 0) + 1
        kind = vllm.sampling_params.RequestOutputKind.FINAL_ONLY
        params = vllm.SamplingParams(**sampling_kwargs(sampling, None, kind))
        final = None
        async for out in self.engine.llm.generate(
            {'prompt_token_ids': token_ids}, params, request_id=f"raw-{self.raw_requests}"
        ):
            final = out
        return len(final.outputs[0].token_ids)


def build_rig(cfg, start: Callable, root: Path, moe: 'Rig | None' = None) -> Rig:
    """A rig of the run's own pieces: `start(role, index, cls, cfg)` makes the trainer (role 'trainer') and engine
    `index` (0: the router's, 1: the fresh one of check b) as objects in this process or as Ray actors; every call goes
    through `molt_nb.router.call`, as the loop's do"""
    from molt_nb.config import policy_tokenizer

    trainer = start('trainer', 0, SmokeTrainer, cfg)
    vocab = policy_tokenizer(cfg)[1]
    backend = 'nccl' if cfg.cluster.device == 'cuda' else 'gloo'
    router = Router(lambda i, incarnation: start('engine', 0, SmokeEngine, cfg), 1, vocab, backend=backend)
    kind = cfg.cluster.weight_transport if cfg.cluster.transport != 'auto' else 'broadcast'
    local = not hasattr(trainer.train_step, 'remote')

    def in_trainer(name, *args):  # in this process, a thread: a broadcast's sender blocks until the engines receive
        return asyncio.to_thread(getattr(trainer, name), *args) if local else call(trainer, name, *args)

    async def train_step(batch):
        out = await in_trainer('train_step', batch)
        await in_trainer('snapshot')  # what a sync sends, as the loop takes it after each step
        return dict(version=out.version, metrics=out.metrics)

    async def save():  # a new directory each time (under `root`, on the trainer's node)
        return await in_trainer('save_checkpoint', str(root / f"weights-{time.time_ns()}"))

    async def fresh(path):
        moved = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(path)))
        return Router(lambda i, incarnation: start('engine', 1, SmokeEngine, moved), 1, vocab, backend=backend)

    return Rig(
        engine=router,
        vocab_size=vocab,
        recompute=lambda batch: in_trainer('logprobs', batch),
        train_step=train_step,
        sync=lambda version: router.sync_weights(in_trainer, kind, version),
        save=save,
        fresh=fresh,
        raw_generate=lambda ids, sampling: call(router.engines[0], 'raw_generate', ids, sampling),
        close_engine=lambda r: r.close(),
        moe=moe,
        parts=dict(trainer=trainer, router=router),
    )


def local_rig(cfg, moe_cfg=None, root: str | None = None) -> Rig:
    "A rig of the run's pieces in this process (the tests' rig: one process, so one device)"
    root = Path(root or tempfile.mkdtemp(prefix='molt-smoke-'))

    def start(role, index, cls, cfg_):
        return cls(cfg_) if role == 'trainer' else cls(cfg_, 100 + index)

    moe = None if moe_cfg is None else local_rig(moe_cfg, root=str(root / 'moe'))
    return build_rig(cfg, start, root, moe)


def ray_rig(cfg, moe_cfg=None, root: str | None = None, name: str = 'molt-smoke') -> Rig:
    """A rig of Ray actors placed as `cfg.cluster` says (the run's own placement): the trainer on its GPUs, engine 0
    on others, and the fresh engine of check b on others still. `root` is where the trainer saves the checkpoint the
    fresh engine loads: a filesystem both nodes see"""
    import ray
    from molt_nb.placement import Placement, cluster_shape, plan
    from molt_nb.steering import actor_options

    c, shape = cfg.cluster, cluster_shape()
    placement = Placement(plan(shape, c.layout, 2, 1, c.engine_gpus, c.device), shape, name)

    def start(role, index, cls, cfg_):
        options = actor_options(c, placement, role, index)
        # vLLM reads it when an engine starts: an actor has Ray's environment, not this driver's
        invariant = dict(VLLM_BATCH_INVARIANT=os.environ.get('VLLM_BATCH_INVARIANT', '1'))
        options['runtime_env'] = options.get('runtime_env', {}) | dict(env_vars=invariant)
        return ray.remote(cls).options(**options).remote(*((cfg_,) if role == 'trainer' else (cfg_, 100 + index)))

    root = Path(root or Path.home() / '.molt-nb' / 'smoke')
    moe = None if moe_cfg is None else ray_rig(moe_cfg, root=str(root / 'moe'), name=f"{name}-moe")
    rig = build_rig(cfg, start, root, moe)
    rig.parts['placement'] = placement
    return rig


def close_rig(rig: Rig):
    "Stop the rig's engines, its trainer if an actor, and free its placement"
    for r in (rig, rig.moe) if rig.moe else (rig,):
        r.parts['router'].close()
        if hasattr(r.parts['trainer'].train_step, 'remote'):
            import ray

            ray.kill(r.parts['trainer'])
        if 'placement' in r.parts:
            r.parts['placement'].remove()


MOE_SHAPE = FULL.moe | dict(tie_embeddings=False)  # `--moe random`: bench/gpu_smoke.py's MoE, its head untied


def random_moe(root: Path) -> str:
    "A Qwen3-MoE of `MOE_SHAPE` with random weights (seed 0) saved as a checkpoint under `root`; its directory"
    from molt_nb.models import TinyConfig, build_model, build_tokenizer, save_policy

    path = Path(root) / 'random-moe'
    if not (path / 'config.json').exists():
        tok = build_tokenizer()
        save_policy(build_model(TinyConfig(**MOE_SHAPE), tok), tok, path)
    return str(path)


def smoke_config(model: str, device: str, overrides: list = (), tokens: int = 256):
    """The run config the smoke builds its pieces from: a vLLM engine and a one-rank trainer on `model`, rows of at most
    `tokens` tokens (what the memory plan counts activations for)"""
    from molt_nb.config import load_config

    fields = [
        f'model.path="{model}"',
        f'agent_options={{max_context={tokens}}}',
        'rollout.engine="vllm"',
        'rollout.dtype="bfloat16"',
        f'cluster.device="{device}"',
    ]
    fields += ['cluster.transport="broadcast"', 'loop.mode="sync"', 'rollout.n_samples=4', 'rollout.groups_per_step=2']
    return load_config(ROOT / 'recipes' / 'parity', fields + list(overrides))


def fits(*configs):
    "Exit naming the role and component of a smoke config whose memory plan does not fit its GPUs (nothing started)"
    from molt_nb.memory import MemoryPlanError, check_memory

    for cfg in filter(None, configs):
        try:
            check_memory(cfg)
        except MemoryPlanError as e:
            sys.exit(f"cluster/smoke.py: {cfg.model.path} does not fit the smoke's one-rank fp32 trainer:\n{e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--dense', required=True, help='a dense policy: hub id or checkpoint directory')
    ap.add_argument('--moe', help="a MoE policy for check d (skipped without it); 'random': one built here")
    ap.add_argument('--device', default='cuda')
    ap.add_argument('--report', required=True, help='where the JSON report goes')
    ap.add_argument('--rows', type=int, default=32)
    ap.add_argument('--new', type=int, default=128, help='tokens sampled per prompt')
    ap.add_argument('--reps', type=int, default=3)
    ap.add_argument('--local', action='store_true', help='every piece in this process (one GPU: no NCCL check b)')
    ap.add_argument('--weights', help='where the trainer saves the weights check b loads (shared by the nodes)')
    ap.add_argument('overrides', nargs='*', help='section.field=value for the smoke run config, e.g. its [cluster]')
    args = ap.parse_args(argv)
    os.environ.setdefault('VLLM_BATCH_INVARIANT', '1')  # read by vLLM when it starts (before any engine here)
    if args.moe == 'random':
        args.moe = random_moe(Path(args.weights or tempfile.mkdtemp(prefix='molt-smoke-')))
    tokens = 32 + args.new  # each row: a prompt of at most 32 tokens and the sampled ones
    dense = smoke_config(args.dense, args.device, args.overrides, tokens)
    moe = smoke_config(args.moe, args.device, args.overrides, tokens) if args.moe else None
    fits(dense, moe)
    if args.local:
        rig = local_rig(dense, moe, root=args.weights)
    else:
        from molt_nb.controller import connect

        connect()  # the cluster RAY_ADDRESS names (the launcher's command), with its token
        rig = ray_rig(dense, moe, root=args.weights)
    try:
        report = asyncio.run(run_checks(rig, rows=args.rows, prompt_len=32, new=args.new, reps=args.reps))
    finally:
        close_rig(rig)
    report['config'] = dict(dense=args.dense, moe=args.moe, device=args.device, rows=args.rows, new=args.new)
    return write_report(report, Path(args.report))


if __name__ == '__main__':
    sys.exit(main())
