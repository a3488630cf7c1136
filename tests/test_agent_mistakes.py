"""Mistakes in an agent module that used to pass silently, or surface far from their cause, end `molt-nb check` in
seconds with a message naming the Env method (issue 54)."""

import time
from pathlib import Path

import pytest

from molt_nb import cli

PARITY = Path(__file__).resolve().parents[1] / 'recipes' / 'parity'


def recipe_with(tmp_path, step: str, max_turns: int = 3) -> Path:
    "The parity recipe, multi-turn, whose Env.step is `step`"
    d = tmp_path / 'recipe'
    d.mkdir()
    (d / 'recipe.toml').write_text((PARITY / 'recipe.toml').read_text())
    src = (PARITY / 'agent.py').read_text()
    old = (
        "    async def step(self, turn):\n"
        "        return Result(reward=float(len(turn.token_ids) > 0 and int(turn.token_ids[0]) % 2 == 0))"
    )
    assert old in src and 'max_turns=1' in src
    src = src.replace(old, f"    async def step(self, turn):\n        {step}").replace(
        'max_turns=1', f'max_turns={max_turns}'
    )
    (d / 'agent.py').write_text('import numpy as np, torch\n' + src)
    return d


def check(recipe: Path) -> str:
    "What `molt-nb check` says: its error, or '' when the recipe passed"
    try:
        cli.main(['check', str(recipe)])
    except SystemExit as e:
        return str(e)
    return ''


@pytest.mark.parametrize(
    'step, message',
    [
        ("return Result(reward=0.0, terminated=False)", 'Parity.step returned terminated=False with no observation'),
        ("return Result(reward=0.0, observation=7, terminated=False)", 'Parity.step returned Result(observation=a int'),
    ],
)
def test_a_mistake_that_passed_silently_ends_the_check(tmp_path, step, message):
    start = time.monotonic()
    said = check(recipe_with(tmp_path, step))
    assert message in said and time.monotonic() - start < 30, said


@pytest.mark.parametrize('reward', ['np.float32(1.0)', 'torch.tensor(1.0)', '1', 'np.int64(1)'])
def test_any_real_scalar_is_a_reward(tmp_path, reward):
    assert check(recipe_with(tmp_path, f"return Result(reward={reward})")) == ''


def test_a_reward_that_is_not_a_number_names_the_field_and_step(tmp_path):
    said = check(recipe_with(tmp_path, "return Result(reward='1')"))
    assert "Result.reward must be a finite number, got '1'" in said and 'in step' in said, said


CHAIN = Path(__file__).resolve().parents[1] / 'recipes' / 'chain'


def test_max_turns_smaller_than_the_task_needs_ends_the_check():
    "The scripted demos play every chain through the run's runner: one cut off by max_turns names the field to raise"
    start = time.monotonic()
    said = check_with(CHAIN, 'agent_options={max_turns=2}')
    assert 'was cut off after 2 turn(s) by max_turns=2: raise it' in said and 'agent_options' in said, said
    assert time.monotonic() - start < 30
    assert check_with(CHAIN) == ''


def check_with(recipe: Path, *overrides: str) -> str:
    try:
        cli.main(['check', str(recipe), *overrides])
    except SystemExit as e:
        return str(e)
    return ''
