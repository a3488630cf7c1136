"""molt_nb's calls into vLLM, NeMo AutoModel and Ray, checked against cluster/pinned_api.json: what the pinned wheels
define, read from their source by cluster/pinned_api.py. No network, no wheel: the JSON and molt_nb's sources only.

A failure names file:line and the missing name or keyword. A new call site that is right against the pinned wheel
needs `.venv/bin/python cluster/pinned_api.py write` (network, once); one whose object the walker cannot type needs
an entry in that script's tables (DECLARED, RETURNS, KWARGS), so every call into the GPU libraries is declared.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location('pinned_api', ROOT / 'cluster' / 'pinned_api.py')
api = sys.modules['pinned_api'] = importlib.util.module_from_spec(spec)  # its dataclasses look their module up
spec.loader.exec_module(api)

DOC = json.loads(api.API_JSON.read_text())
SYMBOLS = DOC['symbols']


def problems_of(source: str, path: str = 'synthetic.py') -> list:
    "Every problem the walker and the checker find in `source`, as 'file:line: message' lines"
    refs, problems = api.walk_source(path, source, api.json_kind_of(SYMBOLS))
    return [f"{f}:{line}: {m}" for f, line, m in problems + api.check_refs(refs, SYMBOLS)]


def test_molt_nb_matches_the_pinned_apis():
    refs, problems = api.walk_project(api.json_kind_of(SYMBOLS))
    problems += api.check_refs(refs, SYMBOLS)
    assert not problems, "molt_nb's calls into the GPU libraries do not match cluster/pinned_api.json:\n" + (
        api.format_problems(problems)
    )
    assert len(refs) > 200  # the walker still sees molt_nb's call sites (a broken walker finds nothing wrong)


def test_json_is_for_the_pinned_versions():
    assert DOC['pins'] == api.pins(), (
        "cluster/constraints-gpu-*.txt pin other versions than cluster/pinned_api.json was read from: run "
        "`.venv/bin/python cluster/pinned_api.py write` and review what moved"
    )


def test_json_facts_are_the_scripts():
    "A fact changed in the script must be proven again against the wheel (`write`), not only edited"
    assert [{k: v for k, v in f.items() if k != 'found'} for f in DOC['facts']] == api.FACTS
    assert all('found' in f or f.get('absent') for f in DOC['facts'])


def test_a_bogus_keyword_fails():
    src = "import vllm\ndef f(a): return vllm.AsyncEngineArgs(**dict(model=a, bogus_kwarg=1))"
    (problem,) = problems_of(src)
    assert 'synthetic.py:2' in problem and 'bogus_kwarg' in problem and 'model' not in problem.split('keyword')[1]


def test_a_wrong_keyword_of_a_declared_attribute_fails():
    src = "class VLLMEngine:\n    async def m(self):\n        await self.llm.collective_rpc('x', timeout=1, argz=())\n"
    (problem,) = problems_of(src)
    assert 'synthetic.py:3' in problem and 'AsyncLLM.collective_rpc' in problem and 'argz' in problem


def test_a_sampling_param_that_vllm_lacks_fails():
    src = "import vllm\nparams = vllm.SamplingParams(temperature=1.0, top_k=-1, logprob=0)"
    (problem,) = problems_of(src)
    assert 'logprob' in problem and 'SamplingParams' in problem


def test_a_missing_name_fails():
    (problem,) = problems_of("from vllm.v1.engine.async_llm import AsyncLLM\nAsyncLLM.pause(mode='keep')")
    assert 'AsyncLLM.pause is not in cluster/pinned_api.json' in problem


def test_too_many_positionals_fail():
    (problem,) = problems_of("import ray\nray.get_actor('run', 'molt', 'extra')")
    assert 'ray.get_actor takes 2 positional arguments, 3 given' in problem


def test_ray_options_are_checked_against_rays_option_table():
    src = "import ray\nclass A: pass\nray.remote(A).options(num_gpus=1, max_concurency=2).remote()"
    (problem,) = problems_of(src)
    assert 'max_concurency' in problem and 'ActorClass.options' in problem


def test_an_unclassified_reference_fails():
    "An attribute of a call's result whose type no table declares is refused, not skipped"
    (problem,) = problems_of("import ray\nray.get_actor('run').ping.remote()")
    assert 'cannot classify `.ping` on what ray.get_actor returns' in problem


def test_an_unknown_keyword_dict_fails():
    (problem,) = problems_of("import vllm\ndef f(kw): return vllm.SamplingParams(**kw)", 'molt_nb/x.py')
    assert 'cannot classify the keywords of `**kw`' in problem


def test_keyword_dict_sources_must_match_their_callee():
    src = "import vllm\ndef sampling_kwargs(): return dict(n=1)\nvllm.AsyncEngineArgs(**sampling_kwargs())"
    assert any('built for vllm.SamplingParams are passed to vllm.AsyncEngineArgs' in p for p in problems_of(src))


@pytest.mark.parametrize(
    'name, keyword',
    [
        ('vllm.AsyncEngineArgs', 'enable_return_routed_experts'),
        ('vllm.AsyncEngineArgs', 'logprobs_mode'),
        ('vllm.v1.engine.async_llm.AsyncLLM.pause_generation', 'clear_cache'),
        ('ray.util.placement_group.placement_group', 'bundle_label_selector'),
    ],
)
def test_json_holds_what_the_review_read(name, keyword):
    "Spot checks of the JSON against docs/reference/gpu-review.md (read from the same wheels by hand)"
    assert keyword in SYMBOLS[name]['params']
