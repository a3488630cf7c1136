"""The GPU recipes (recipes/gsm8k, gsm8k_moe, gsm8k_1gpu) on CPU: each loads and validates without its weights, its
placement on the reference cluster (2 x 8) or on one GPU is what its comments say, a shape it does not fit is refused
with the numbers, the verifier scores right, wrong and malformed answers, and the agent module's tasks come from a
GSM8K-shaped JSONL (or, only when asked, from its synthetic set) and run one rollout on a tiny stand-in policy."""

import dataclasses, json, os, re, subprocess, sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from molt_nb import cli
from molt_nb.config import ModelConfig, is_hub_id, load_config
from molt_nb.recipe import RecipeError, check_recipe, run_sync

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / 'recipes'
GPU_RECIPES = {  # recipe: (model, the cluster it is written for, layout, trainer ranks, engines x GPUs)
    'gsm8k': ('Qwen/Qwen3-8B', (2, 8), 'split', 8, (8, 1)),
    'gsm8k_moe': ('Qwen/Qwen3-30B-A3B', (2, 8), 'split', 10, (3, 2)),
    'gsm8k_1gpu': ('Qwen/Qwen3-1.7B', (1, 1), 'colocated', 1, (1, 1)),
}


def agent():
    "The recipes' agent module, imported as a run imports it"
    from molt_nb.agents import load_module

    return load_module(RECIPES / 'gsm8k' / 'agent.py')


@pytest.mark.parametrize('name', GPU_RECIPES)
def test_each_gpu_recipe_loads_and_validates_without_its_weights(name, no_checkpoint, tmp_path):
    model, _, layout, ranks, (engines, width) = GPU_RECIPES[name]
    cfg = load_config(RECIPES / name, [f'run_dir="{tmp_path}"'])
    assert (cfg.model.path, is_hub_id(cfg.model.path)) == (model, True)
    assert (cfg.rollout.engine, cfg.rollout.dtype, cfg.cluster.device) == ('vllm', 'bfloat16', 'cuda')
    assert cfg.train.backend in ('automodel', 'fsdp2') and cfg.train.param_dtype == 'bfloat16'
    c = cfg.cluster
    assert (c.layout, c.trainer_ranks, c.engines, c.engine_gpus) == (layout, ranks, engines, width)
    assert cfg.loop.mode != 'partial'  # vLLM refuses it
    assert cfg.routing.replay if name == 'gsm8k_moe' else True
    assert set(cfg.task_options) == {'data'}  # a real run reads GSM8K; the synthetic set is never the default
    text = (RECIPES / name / 'recipe.toml').read_text()
    assert 'ESTIMATES, NOT MEASUREMENTS' in text and 'Other shapes' in text
    # vLLM and NeMo AutoModel cannot share an environment: each side starts from its venv in the image
    venvs = re.findall(r'python3\.12 -m venv (\S+)', (ROOT / 'cluster' / 'Dockerfile').read_text())
    assert (c.rollout_python, c.trainer_python) == tuple(f"{v}/bin/python" for v in venvs), venvs


def test_a_hub_id_is_refused_where_a_check_must_read_its_config(tmp_path):
    "The one check that needs the policy's config (speculative decoding with R3) says what to do without the cache"
    with pytest.raises(ValueError, match="not in this machine's Hugging Face cache"):
        load_config(
            RECIPES / 'gsm8k_moe',
            [
                f'run_dir="{tmp_path}"',
                'model.path="molt-nb-tests/Qwen3-uncached"',
                'rollout.vllm={speculative_config={method="ngram"}}',
            ],
        )


def planned(capsys, name: str, nodes: int, gpus: int, *overrides):
    "The plan `molt-nb plan` computes for a recipe on nodes x gpus, and what it printed"
    placed = cli.plan_command(
        cli._parse(['plan', str(RECIPES / name), '--nodes', str(nodes), '--gpus-per-node', str(gpus), *overrides])
    )
    return placed, capsys.readouterr().out


def test_the_dense_recipe_fills_one_node_with_trainers_and_the_other_with_engines(capsys, no_checkpoint):
    placed, out = planned(capsys, 'gsm8k', 2, 8)
    assert [(s.node, s.gpus) for s in placed.trainers] == [(0, (g,)) for g in range(8)]
    assert [(s.node, s.gpus) for s in placed.engines] == [(1, (g,)) for g in range(8)]
    assert 'node 0: 8 trainers (0-7) on GPUs 0-7' in out and 'node 1: 8 engines (0-7) on GPUs 0-7' in out
    print(out)


def test_the_moe_recipe_puts_three_tensor_parallel_engines_beside_two_trainer_ranks(capsys, no_checkpoint):
    "10 trainer ranks (8 would plan 80.7 GB a GPU: tests/test_memory_plan.py) fill node 0 and two GPUs of node 1"
    placed, out = planned(capsys, 'gsm8k_moe', 2, 8)
    assert [(s.node, s.gpus) for s in placed.trainers] == [(0, (g,)) for g in range(8)] + [(1, (0,)), (1, (1,))]
    assert [(s.node, s.gpus) for s in placed.engines] == [(1, (2 * e + 2, 2 * e + 3)) for e in range(3)]
    assert 'node 1: 2 trainers (8-9) on GPUs 0-1, 3 engines (0-2) on GPUs 2-7' in out
    print(out)


def test_the_one_gpu_recipe_shares_its_gpu(capsys, no_checkpoint):
    placed, out = planned(capsys, 'gsm8k_1gpu', 1, 1)
    assert [(s.role, s.node, s.gpus) for s in placed.slots] == [('trainer', 0, (0,)), ('engine', 0, (0,))]
    print(out)


@pytest.mark.parametrize(
    'name, nodes, gpus, says',
    [
        ('gsm8k', 1, 8, 'the plan needs 16 GPUs (8 trainer ranks x 1 + 8 engines x 1), the cluster has 8 (1 node x 8)'),
        (
            'gsm8k_moe',
            1,
            8,
            'the plan needs 16 GPUs (10 trainer ranks x 1 + 3 engines x 2), the cluster has 8 (1 node x 8)',
        ),
        ('gsm8k_moe', 8, 1, "engine_gpus=2, but the widest node has 1 GPUs"),
        ('gsm8k_1gpu', 1, 0, 'the widest node has 0 GPUs'),
    ],
)
def test_a_shape_the_recipe_does_not_fit_is_refused_with_the_numbers(name, nodes, gpus, says, no_checkpoint):
    with pytest.raises(SystemExit) as e:
        cli.plan_command(cli._parse(['plan', str(RECIPES / name), '--nodes', str(nodes), '--gpus-per-node', str(gpus)]))
    assert f"does not fit {nodes * gpus}" in str(e.value) and says in str(e.value), str(e.value)


def test_molt_nb_plan_from_a_terminal():
    "The installed command: exit 0 and the plan for 2 x 8, exit 1 and the reason for 1 x 8"
    run = lambda *a: subprocess.run(
        [Path(sys.executable).parent / 'molt-nb', 'plan', 'recipes/gsm8k', *a],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {'HF_HUB_OFFLINE': '1'},
    )
    ok, bad = run('--nodes', '2', '--gpus-per-node', '8'), run('--nodes', '1', '--gpus-per-node', '8')
    assert ok.returncode == 0 and 'node 1: 8 engines (0-7) on GPUs 0-7' in ok.stdout, ok.stderr
    assert bad.returncode == 1 and 'the plan needs 16 GPUs' in bad.stderr, (bad.stdout, bad.stderr)


# ------------------------------------------------------------------------------------------------ the verifier
@pytest.mark.parametrize(
    'text, answer, reward',
    [
        ('Each bag has 3, so 4 * 3 = 12 and 12 + 6 = 18.\n\\boxed{18}', '18', 1.0),  # right
        ('<think>6 + 4*3 = 18</think>\nThe answer is \\boxed{18}.', '18', 1.0),  # after thinking
        ('So the total is $1,234.00', '1234', 1.0),  # no box: the last number, commas and cents read exactly
        ('\\boxed{\\frac{7}{2}}', '3.5', 1.0),  # a LaTeX fraction is its value
        ('20 - 2 = 18', '18', 1.0),  # an operator's minus is not the answer's sign
        ('\\boxed{17}', '18', 0.0),  # wrong
        ('\\boxed{18} ... no wait, \\boxed{19}', '18', 0.0),  # the last box counts
        ('<think>it is 18', '18', 0.0),  # malformed: thinking never closed, no answer given
        ('I cannot tell.', '18', 0.0),  # malformed: no number
        ('\\boxed{}', '18', 0.0),  # malformed: an empty box
        ('the answer is -18', '18', 0.0),  # sign matters
    ],
)
def test_the_verifier_scores_the_final_number(text, answer, reward):
    assert agent().score(text, answer) == reward


def test_the_env_scores_a_truncated_turn_zero():
    env = agent().GSM8K()
    task = dict(question='q', answer='18')
    turn = lambda finish: SimpleNamespace(text='\\boxed{18}', finish_reason=finish, task=task, token_ids=[1])
    assert run_sync(env.step(turn('stop'))).reward == 1.0
    assert run_sync(env.step(turn('length'))).reward == 0.0
    prompt = run_sync(env.reset(task))
    assert prompt[0]['role'] == 'user' and '\\boxed{}' in prompt[0]['content']


# --------------------------------------------------------------------------------------------------- the data
def gsm8k_dir(root: Path) -> Path:
    "A GSM8K-shaped export: train.jsonl (3 rows) and test.jsonl (2 rows), answers ending '#### N'"
    root.mkdir(parents=True, exist_ok=True)
    rows = dict(
        train=[
            ('Tom has 3 bags of 4 apples. How many?', 'He has 3*4 = <<3*4=12>>12.\n#### 12'),
            ('Ann saves 1,000 dollars twice. Total?', '2*1000 = 2000\n#### 2,000'),
            ('What is 7 - 9?', '#### -2'),
        ],
        test=[('A pen costs 5. Two pens?', '2*5 = 10\n#### 10'), ('Half of 9?', '#### 4.5')],
    )
    for split, pairs in rows.items():
        (root / f'{split}.jsonl').write_text(''.join(json.dumps(dict(question=q, answer=a)) + '\n' for q, a in pairs))
    return root


def test_tasks_come_from_the_jsonl_export(tmp_path):
    data = gsm8k_dir(tmp_path / 'gsm8k')
    a = agent()
    train, test = a.tasks('train', data=str(data)), a.tasks('eval', data=str(data))
    assert [t['answer'] for t in train] == ['12', '2000', '-2'] and [t['answer'] for t in test] == ['10', '4.5']
    assert train[0]['question'] == 'Tom has 3 bags of 4 apples. How many?'
    with pytest.raises(FileNotFoundError, match='train.jsonl and test.jsonl'):
        a.tasks('train', data=str(tmp_path / 'absent'))
    (data / 'test.jsonl').write_text('{"question": "no answer"}\n')
    with pytest.raises(ValueError, match="line 1 has no 'question' and 'answer'"):
        a.tasks('eval', data=str(data))


def test_the_synthetic_set_is_only_used_when_asked_and_is_fixed():
    a = agent()
    for kw in (dict(), dict(data='/x', synthetic=True)):
        with pytest.raises(ValueError, match='give exactly one source of tasks'):
            a.tasks('train', **kw)
    first, again = a.tasks('train', synthetic=True), a.tasks('train', synthetic=True)
    assert first == again and len(first) == 64 and first != a.tasks('eval', synthetic=True)
    assert all(a.score(f"\\boxed{{{t['answer']}}}", t['answer']) == 1.0 for t in first)


def tiny(cfg, **task_options):
    """`cfg` with a tiny policy built in code (the CPU cannot load the hub model) and short turns; its context holds the
    recipe's max_context, as the checkpoint's does (the check refuses a runner longer than a code-built policy)"""
    model = ModelConfig(max_position=4096)
    rollout = dataclasses.replace(cfg.rollout, max_tokens=8, timeout_s=30)
    return dataclasses.replace(cfg, model=model, rollout=rollout, task_options=task_options)


@pytest.mark.parametrize('name', GPU_RECIPES)
def test_the_recipe_checks_on_a_tiny_policy_with_its_data(name, tmp_path):
    "The recipe contract and one train and one eval rollout, through the recipe's own runner and options"
    cfg = load_config(RECIPES / name, [f'run_dir="{tmp_path}"'])
    parts = check_recipe(tiny(cfg, data=str(gsm8k_dir(tmp_path / 'gsm8k'))))
    assert sorted(t['answer'] for t in parts.train_tasks) == ['-2', '12', '2000']
    assert parts.runner.max_context == cfg.agent_options['max_context']
    check_recipe(tiny(cfg, synthetic=True))


def test_the_recipe_check_names_data_that_is_not_there(tmp_path):
    "The recipe's placeholder data path, absent here, stops the check: a run never falls back to made-up tasks"
    cfg = load_config(RECIPES / 'gsm8k', [f'run_dir="{tmp_path}"'])
    with pytest.raises(RecipeError, match='task_options.data must be a directory'):
        check_recipe(tiny(cfg, **cfg.task_options))
