"""recipes/geo3k (Geometry3K on Qwen3-VL-8B, a GPU recipe) on CPU: it loads and validates without its weights, its
placement on the reference cluster is what its comments say, the verifier scores LaTeX answers right and hostile
ones zero without evaluating code, the tasks come from a Geometry3K-shaped parquet export (either layout) with
errors that say what to fix, the recipe check runs a train and an eval rollout on a tiny vision-language stand-in
with the policy's processor, and a scripted policy takes the multi-turn path: a tool call runs in the sandbox, its
output comes back as a tool message, the image stays in the context, the boxed answer is scored."""

import asyncio, dataclasses, io
from pathlib import Path

import pandas as pd
import pytest
import torch

from molt_nb import cli
from molt_nb.agents import load_module
from molt_nb.config import ModelConfig, load_config
from molt_nb.core import SamplingParams
from molt_nb.engine import Generation
from molt_nb.recipe import RecipeError, check_recipe, recipe_parts
from molt_nb.vision import draw_shapes, image_processor, vision_tokenizer

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / 'recipes' / 'geo3k'


def agent():
    return load_module(RECIPE / 'agent.py')


def test_the_recipe_loads_validates_and_fills_the_reference_cluster(no_checkpoint, capsys, tmp_path):
    cfg = load_config(RECIPE, [f'run_dir="{tmp_path}"'])
    assert (cfg.model.path, cfg.rollout.engine, cfg.train.backend, cfg.cluster.device) == (
        'Qwen/Qwen3-VL-8B-Instruct',
        'vllm',
        'fsdp2',  # AutoModel's backend builds causal LMs only
        'cuda',
    )
    assert set(cfg.task_options) == {'data'}  # a real run reads Geometry3K; the synthetic set is never the default
    assert cfg.rollout.vllm['limit_mm_per_prompt'] == {'image': 1, 'video': 0}
    placed = cli.plan_command(cli._parse(['plan', str(RECIPE), '--nodes', '2', '--gpus-per-node', '8']))
    assert [(s.node, s.gpus) for s in placed.trainers] == [(0, (g,)) for g in range(8)]
    assert [(s.node, s.gpus) for s in placed.engines] == [(1, (g,)) for g in range(8)]
    assert 'ESTIMATES, NOT MEASUREMENTS' in (RECIPE / 'recipe.toml').read_text()
    print(capsys.readouterr().out)


def test_automodel_refuses_a_vision_language_checkpoint(tmp_path):
    from molt_nb.automodel import build_automodel, refuse_vision

    (tmp_path / 'config.json').write_text('{"architectures": ["Qwen3VLForConditionalGeneration"], "vision_config": {}}')
    with pytest.raises(ValueError, match="use train.backend='fsdp2'"):
        refuse_vision(str(tmp_path))
    with pytest.raises(ValueError, match="use train.backend='fsdp2'"):  # before it imports NeMo or builds anything
        build_automodel(str(tmp_path), None, tp_size=1, ep_size=1, activation_checkpointing=False)
    (tmp_path / 'config.json').write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    refuse_vision(str(tmp_path))  # a causal LM passes


# ----------------------------------------------------------------------------------------------- the verifier
@pytest.mark.parametrize(
    'latex, value',
    [
        ('12', 12.0),
        ('12.4', 12.4),
        ('1,200', 1200.0),
        ('\\frac{40}{3}', 40 / 3),
        ('2\\sqrt{221}', 2 * 221**0.5),
        ('\\frac{5\\sqrt{3}}{2}', 5 * 3**0.5 / 2),
        ('\\dfrac{1}{\\sqrt{2}}', 2**-0.5),
        ('3\\pi', 3 * 3.141592653589793),
        ('45^\\circ', 45.0),
        ('45°', 45.0),
        ('-7', -7.0),
        ('2^{3}', 8.0),
        ('(-2)^{3}', -8.0),
        ('(' * 99 + '1' + ')' * 99, 1.0),  # deep, within the length cap
    ],
)
def test_latex_numbers_are_evaluated(latex, value):
    assert agent().latex_number(latex) == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize(
    'hostile',
    [
        "__import__('os').system('true')",
        '(-8)^{1/3}',  # Python's power would be complex
        '(-1)^{0.5}',
        '(1).real',
        'open(1)',
        '9**9**9**9',
        '2^{999}',
        'sqrt(-1)',
        '1/0',
        '(' * 300 + '1' + ')' * 300,
        'x+1',
        '',
    ],
)
def test_anything_but_arithmetic_is_no_number(hostile):
    assert agent().latex_number(hostile) is None


@pytest.mark.parametrize(
    'text, answer, reward',
    [
        ('so \\boxed{\\frac{40}{3}}', '\\frac{40}{3}', 1.0),
        ('\\boxed{13.3333}', '\\frac{40}{3}', 1.0),  # within 1e-4 relative
        ('\\boxed{13.3}', '\\frac{40}{3}', 0.0),
        ('\\boxed{29.7321}', '2\\sqrt{221}', 1.0),
        ('\\boxed{2 \\sqrt{221}}', '2\\sqrt{221}', 1.0),
        ('first \\boxed{3} then \\boxed{4}', '4', 1.0),  # the last box
        ('the answer is 4', '4', 0.0),  # no box
        ('<think>\\boxed{4}', '4', 0.0),  # thinking never closed
        ('<think>maybe \\boxed{3}</think>\\boxed{4}', '4', 1.0),
        ('\\boxed{A}', '4', 0.0),
        ('\\boxed{(-4)^{0.5}}', '2', 0.0),  # no complex numbers: scored 0, never an error
    ],
)
def test_the_verifier_scores_the_boxed_answer(text, answer, reward):
    assert agent().score(text, answer) == reward


# --------------------------------------------------------------------------------------------------- the data
def png(seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(draw_shapes([('triangle', (20, 20, 20), (2 + seed, 3), 30)], size=(70, 90))).save(buf, 'PNG')
    return buf.getvalue()


def geometry3k(root: Path, layout: str = 'flat') -> Path:
    "A Geometry3K-shaped export: the columns of hiyouga/geometry3k, each image a {'bytes', 'path'} struct"
    rows = dict(
        train=[('<image>Find x.', '12'), ('<image>Find the area.', '\\frac{40}{3}'), ('<image>Find y.', '2\\sqrt{3}')],
        test=[('<image>Find m \\angle 1.', '45'), ('<image>Find z.', '7.5')],
    )
    for split, pairs in rows.items():
        frame = pd.DataFrame(
            dict(
                images=[[dict(bytes=png(i), path=None)] for i in range(len(pairs))],
                problem=[p for p, _ in pairs],
                answer=[a for _, a in pairs],
            )
        )
        path = root / f'{split}.parquet' if layout == 'flat' else root / 'data' / f'{split}-00000-of-00001.parquet'
        path.parent.mkdir(parents=True, exist_ok=True)
        frame.to_parquet(path)
    return root


@pytest.mark.parametrize('layout', ['flat', 'repository'])
def test_tasks_come_from_the_parquet_export(layout, tmp_path):
    data = geometry3k(tmp_path / 'geo3k', layout)
    a = agent()
    train, test = a.tasks('train', data=str(data)), a.tasks('eval', data=str(data))
    assert [t['answer'] for t in train] == ['12', '\\frac{40}{3}', '2\\sqrt{3}'] and len(test) == 2
    assert a.image(train[1]).size == (90, 70) and train[1]['image'] == png(1)
    prompt = asyncio.run(a.Geo3K().reset(train[0]))
    assert prompt[0]['role'] == 'user' and prompt[0]['content'][0].size == (90, 70)
    assert '<image>' not in prompt[0]['content'][1] and 'Find x.' in prompt[0]['content'][1]


def test_bad_data_is_refused_with_what_to_do(tmp_path):
    a = agent()
    with pytest.raises(FileNotFoundError, match='hf download hiyouga/geometry3k'):
        a.tasks('train', data=str(tmp_path / 'absent'))
    for kw in (dict(), dict(data='/x', synthetic=True)):
        with pytest.raises(ValueError, match='give exactly one source of tasks'):
            a.tasks('train', **kw)
    pd.DataFrame(dict(problem=['q'], answer=['1'])).to_parquet(tmp_path / 'train.parquet')
    with pytest.raises(ValueError, match='expected images, problem and answer'):
        a.tasks('train', data=str(tmp_path))
    pd.DataFrame(dict(images=[[dict(bytes=None, path='x.png')]], problem=['q'], answer=['1'])).to_parquet(
        tmp_path / 'train.parquet'
    )
    with pytest.raises(ValueError, match='the image has no bytes'):
        a.tasks('train', data=str(tmp_path))
    pd.DataFrame(dict(images=[[dict(bytes=png(0), path=None)] * 2], problem=['q'], answer=['1'])).to_parquet(
        tmp_path / 'train.parquet'
    )
    with pytest.raises(ValueError, match='holds 2 images'):
        a.tasks('train', data=str(tmp_path))


def test_the_synthetic_set_is_only_used_when_asked_and_is_fixed():
    a = agent()
    first, again = a.tasks('train', synthetic=True), a.tasks('train', synthetic=True)
    assert first == again and len(first) == 32 and first != a.tasks('eval', synthetic=True)
    assert all(a.latex_number(t['answer']) is not None for t in first)


# ------------------------------------------------------------------------------------- the check and the tool
def tiny(cfg, **task_options):
    """`cfg` with a tiny vision-language policy built in code (the CPU cannot load the hub model) and short turns; its
    context holds the recipe's max_context, as the checkpoint's does (the check refuses a longer runner)"""
    model = ModelConfig(vision=True, max_position=8192)
    rollout = dataclasses.replace(cfg.rollout, max_tokens=8, timeout_s=60)
    return dataclasses.replace(cfg, model=model, rollout=rollout, task_options=task_options)


def test_the_recipe_checks_on_a_tiny_vision_policy_with_its_data(tmp_path):
    "The recipe contract and one train and one eval rollout, through the recipe's own runner, options and processor"
    cfg = load_config(RECIPE, [f'run_dir="{tmp_path}"'])
    parts = check_recipe(tiny(cfg, data=str(geometry3k(tmp_path / 'geo3k'))))
    assert sorted(t['answer'] for t in parts.train_tasks) == ['12', '2\\sqrt{3}', '\\frac{40}{3}']
    assert parts.runner.max_context == cfg.agent_options['max_context'] and parts.runner.processor is not None
    with pytest.raises(RecipeError, match='task_options.data must be a directory'):
        check_recipe(tiny(cfg, **cfg.task_options))  # the recipe's own path, absent here: never made-up tasks


class ScriptedPolicy:
    """An engine that says `replies` in turn (a tiny random policy never calls a tool): the recipe's multi-turn path
    with a real sandbox. It records each turn's prompt and images"""

    def __init__(self, tok, replies):
        self.tok, self.replies, self.seen = tok, list(replies), []

    async def generate(self, token_ids, sampling=None, session_id=None, images=None):
        self.seen.append((list(map(int, token_ids)), images))
        ids = self.tok.encode(self.replies.pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
        n = len(ids)
        return Generation(
            torch.tensor(ids),
            torch.zeros(n),
            torch.zeros(n, dtype=torch.int32),
            None,
            'stop',
            len(token_ids),
        )


def test_a_tool_call_runs_in_the_sandbox_and_its_output_comes_back(tmp_path):
    cfg = load_config(RECIPE, [f'run_dir="{tmp_path}"'])
    cfg = tiny(cfg, data=str(geometry3k(tmp_path / 'geo3k')))
    tok = vision_tokenizer()
    parts = recipe_parts(cfg, tok)
    task = next(t for t in parts.train_tasks if t['answer'] == '\\frac{40}{3}')
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(40/3, 6*7)"}}\n</tool_call>'
    policy = ScriptedPolicy(tok, [call, 'The area is \\boxed{13.33333}'])
    sp = SamplingParams(max_tokens=64, stop_token_ids=[tok.eos_token_id])
    traj = asyncio.run(parts.runner.run(policy, task, sp, 'r0', 'g0', 0))
    assert traj.reward == 1.0 and len(policy.seen) == 2
    (first, im1), (second, im2) = policy.seen
    img = tok.convert_tokens_to_ids('<|image_pad|>')
    assert im1 is not None and len(im1) == 1 and torch.equal(im1.pixel_values, im2.pixel_values)
    assert first.count(img) == second.count(img) == int(im1.tokens.sum())  # the image stays, once
    turn2 = tok.decode(second[len(first) :])
    assert '<tool_response>\n13.333333333333334 42' in turn2  # the sandbox's output, as a tool message
    seg = traj.segments[0]
    assert seg.images is not None and len(seg.images) == 1
    # the image processor is the policy's: the same pixels as processing the diagram directly
    direct = image_processor()(images=[agent().image(task)], return_tensors='pt')
    assert torch.equal(im1.pixel_values, direct['pixel_values'].float())


def test_the_tool_budget_ends_the_episode_and_a_bad_call_is_answered():
    a = agent()
    env, task = a.Geo3K(), dict(answer='4')

    def turn(text, index):
        from types import SimpleNamespace

        return SimpleNamespace(text=text, finish_reason='stop', index=index, task=task, token_ids=[1])

    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(2+2)"}}\n</tool_call>'
    out = asyncio.run(env.step(turn(call, 0)))
    assert not out.terminated and out.observation.strip() == '4' and out.reward == 0.0
    last = asyncio.run(env.step(turn(call, a.MAX_TOOL_TURNS)))  # past the budget: scored, no box -> 0
    assert last.terminated and last.reward == 0.0
    three = [line for line in asyncio.run(env.step(turn(call * 3, 0))).observation.splitlines() if line]
    assert three == ['4', '4', f'(1 more tool calls were not run: at most {a.MAX_CALLS} a turn)'], three
    odd = '<tool_call>\n{"name": "shell", "arguments": {"cmd": "ls"}}\n</tool_call>'
    assert 'unknown tool call' in asyncio.run(env.step(turn(odd, 0))).observation
    cut = turn('\\boxed{4}', 0)
    cut.finish_reason = 'length'  # cut off by max_tokens: no answer
    assert asyncio.run(env.step(cut)).reward == 0.0
    assert asyncio.run(env.step(turn('\\boxed{4}', 0))).reward == 1.0
