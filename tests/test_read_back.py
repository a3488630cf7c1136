"""Runs you can read back (issue 54): a multi-turn rollout's whole conversation rebuilt from the run directory alone,
held-out rollouts stored, held-out accuracy (the score) apart from the reward, truncated rollouts counted and warned.

Real short runs in this process (no Ray): the parity recipe's model and loop, with an Env of three turns that answers
each of the first two with the observation 'obs{index}' and records what it saw, by rollout id, in a folder."""

import asyncio, json, shutil
from pathlib import Path
import pytest
from molt_nb.chat import render
from molt_nb.config import load_config
from molt_nb.loop import Orchestrator, Trainer
from molt_nb.store import RunStore

ROOT = Path(__file__).resolve().parents[1]

AGENT = '''
import contextvars, json
from pathlib import Path
from molt_nb.agents import Env, StepEnvRunner
from molt_nb.core import Result

ROLLOUT = contextvars.ContextVar('rollout')  # the rollout the Env plays, set by `Recorded.run`


def tasks(split):
    return [dict(prompt=f"{n}:") for n in (range(1000) if split == 'train' else range(1000, 1100))]


class Talk(Env):
    "Three turns; the first two answered 'obs0', 'obs1'; scored 1 when the first token is even, rewarded 0.1 + score/2"

    def __init__(self, log, template, turns):
        self.log, self.template, self.turns, self.rid = Path(log), template, turns, ROLLOUT.get()

    async def reset(self, task):
        self.seen = dict(opening=task['prompt'] if not self.template else [dict(role='user', content=task['prompt'])])
        self.seen.update(turns=[], observations=[], messages=[])
        return self.seen['opening']

    async def step(self, turn):
        self.seen['turns'].append(turn.token_ids.tolist())
        self.seen['messages'].append(turn.messages)
        done = turn.index == self.turns - 1
        if not done:
            self.seen['observations'].append(f"obs{turn.index}")
        (self.log / f"{self.rid.replace('/', '_')}.json").write_text(json.dumps(self.seen))
        if not done:
            return Result(reward=0.0, observation=f"obs{turn.index}", terminated=False)
        score = float(self.seen['turns'][0][0] % 2 == 0)
        return Result(reward=0.1 + score / 2, score=score)


class Recorded:
    "The runner, telling the Env which rollout it plays"

    def __init__(self, runner):
        self.runner = runner

    async def run(self, engine, task, sampling, rollout_id, group_id, prompt_index=0):
        ROLLOUT.set(rollout_id)
        return await self.runner.run(engine, task, sampling, rollout_id, group_id, prompt_index)


def AgentRunner(tokenizer, log: str, template: bool = True, turns: int = 3, max_turns: int = 3):
    env = lambda: Talk(log, template, turns)
    return Recorded(StepEnvRunner(env, tokenizer, max_turns=max_turns, max_context=256, template=template))
'''


def run(tmp_path, name: str, *overrides, template=True, turns=3, max_turns=3) -> tuple:
    "Run a copy of the parity recipe with the `Talk` Env; (its run directory, its record folder, its orchestrator)"
    recipe, log = tmp_path / name, tmp_path / f"{name}_seen"
    log.mkdir()
    shutil.copytree(ROOT / 'recipes' / 'parity', recipe)
    (recipe / 'agent.py').write_text(AGENT)
    options = f'log="{log}"', f'template={str(template).lower()}', f'turns={turns}', f'max_turns={max_turns}'
    cfg = load_config(
        recipe,
        [
            *(f'agent_options.{o}' for o in options),
            'model.max_position=256',
            'loop.steps=2',
            'loop.eval_tasks=8',
            f'run_dir="{tmp_path / name / "run"}"',
            *overrides,
        ],
    )
    orch = Orchestrator(cfg, Trainer(cfg))
    try:
        asyncio.run(orch.run())
    finally:
        orch.close()
    return Path(cfg.run_dir), log, orch


def expected_spans(seen: dict, tokenizer, template: bool) -> list:
    "The (text, trained) spans of the conversation the Env saw: its opening, the model's turns, its observations"
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
    spans = [(render(tokenizer, seen['opening'], True) if template else seen['opening'], False)]
    for k, ids in enumerate(seen['turns']):
        spans.append((decode(ids), True))
        if k < len(seen['observations']):
            spans.append((glue(tokenizer, seen['observations'][k], decode(ids)) if template else f"obs{k}", False))
    return spans


def glue(tokenizer, observation: str, sampled: str) -> str:
    """What the chat template puts between a model's turn (`sampled`, with its stop token if it stopped) and the next,
    with `observation` the user's answer: read off a rendered conversation"""
    chat = [dict(role='user', content='x'), dict(role='assistant', content='A'), dict(role='user', content=observation)]
    full = render(tokenizer, chat, True)
    tail = full[full.index('A<|im_end|>') + len('A') :]
    return tail.removeprefix('<|im_end|>') if sampled.endswith('<|im_end|>') else tail


@pytest.mark.parametrize('template', [True, False])
def test_conversation_read_back(tmp_path, template):
    run_dir, log, orch = run(tmp_path, 'talk', template=template)
    store = RunStore(run_dir)  # a fresh reader: the run directory alone
    tokenizer = orch.tokenizer
    samples = store.samples()
    assert len(samples) == 2 * 16
    checked = 0
    for row in samples.itertuples():
        seen = json.loads((log / f"{row.rollout_id.replace('/', '_')}.json").read_text())
        assert len(seen['turns']) == 3  # every rollout is three turns long
        if len(row.segments) > 1:  # a turn the template could not extend (the model wrote a stop token): re-rendered
            continue
        spans = store.conversation(row.rollout_id, row.step)  # the run's own tokenizer, rebuilt from its config
        assert spans == expected_spans(seen, tokenizer, template), row.rollout_id
        assert [t for t, trained in spans if trained] == [tokenizer.decode(ids) for ids in seen['turns']]
        if template:  # the whole text is the conversation the Env saw, rendered by the chat template
            assert ''.join(t for t, _ in spans).startswith(render(tokenizer, seen['messages'][0][:-1], True))
            assert all(f"<|im_start|>user\nobs{k}<|im_end|>" in ''.join(t for t, _ in spans) for k in (0, 1))
        checked += 1
    assert checked >= 8, checked
    # the held-out rollouts: the first loop.eval_samples (8) of the start's and the last step's evaluation, read
    # back the same way (a held-out rollout's id recurs at every evaluation: the record is the last one's)
    held = store.samples(split='eval')
    assert held.step.tolist() == [0] * 8 + [2] * 8 and held.rollout_id.tolist()[:2] == ['eval0', 'eval1']
    read = 0
    for row in held[held.step == 2].itertuples():
        seen = json.loads((log / f"{row.rollout_id}.json").read_text())
        if len(row.segments) == 1:
            assert store.conversation(row.rollout_id, 2, split='eval') == expected_spans(seen, tokenizer, template)
            read += 1
    assert read >= 1, read
    # accuracy and reward apart: the Env scores 0 or 1 and rewards 0.1 + score / 2
    m = store.metrics()
    assert (held.score != held.reward).all() and (held.reward == 0.1 + held.score / 2).all()
    ev = m.dropna(subset=['eval'])
    assert ev.step.tolist() == [0, 2]
    assert ev['eval_reward'].round(6).tolist() == (0.1 + ev['eval'] / 2).round(6).tolist()
    assert (ev['eval'] != ev['eval_reward']).all()  # (eval = 0.2 would make them equal: not a multiple of 1/8)
    assert m.truncated.iloc[1:].tolist() == [0.0, 0.0] and store.warnings() == {}


def test_truncated_counted_and_warned(tmp_path):
    "An Env that would go on for three turns, under max_turns=2: every rollout is truncated, and the run warns once"
    run_dir, _, orch = run(tmp_path, 'cut', max_turns=2, template=False)
    store = RunStore(run_dir)
    m = store.metrics()
    assert m.truncated.iloc[1:].tolist() == [1.0, 1.0]
    assert store.samples().truncated.all() and store.samples(split='eval').truncated.all()
    warning = store.warnings()['truncated']
    assert warning.startswith("16 of the step's 16 rollouts were truncated (cut off before the Env ended the episode)")
    assert 'raise max_turns or max_context' in warning and 'rollout.max_tokens' in warning
    assert orch.warnings == store.warnings()


def test_an_episode_past_the_engines_context_is_truncated_not_failed(tmp_path):
    """The runner allows 256 tokens, the policy's context is 16: in a run (the engines behind a router) the episode
    stops where the engines' context ends, counted as truncated, instead of failing at the engine"""
    run_dir, _, orch = run(tmp_path, 'tight', 'model.max_position=16', template=False)
    store = RunStore(run_dir)
    assert orch.engine.max_model_len == 16
    assert store.failures() == {} and store.metrics().truncated.iloc[1:].tolist() == [1.0, 1.0]
    assert max(sum(map(len, s)) for s in store.samples().segments) <= 16
