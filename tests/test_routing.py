"""MoE routing replay in the real loop (local Ray): a tiny MoE sampled by a bf16 engine, trained in fp32."""

from pathlib import Path
import numpy as np
import pytest
from molt_nb.config import load_config
from molt_nb.controller import launch

ROOT = Path(__file__).resolve().parents[1]
MOE = [
    'model.num_experts=8',
    'model.dense_layers=[0]',
    'model.num_layers=3',
    'rollout.dtype="bfloat16"',
    'loop.steps=3',
    'loop.mode="sync"',
    'loop.eval_tasks=8',
    'loop.debug=true',
    'rollout.max_tokens=12',
]


def tokens_layers_slots(nested) -> np.ndarray:
    "A samples cell ([token][layer][slot], read back from Parquet as nested arrays) as one (T, layers, top_k) array"
    return np.array([np.stack(layers) for layers in nested])


def moe_run(tmp_path, replay: bool):
    cfg = load_config(
        ROOT / 'recipes' / 'parity',
        [
            *MOE,
            f'routing.replay={str(replay).lower()}',
            f'routing.compare={str(replay).lower()}',
            f'run_dir="{tmp_path / "run"}"',
        ],
    )
    run = launch(cfg, name=f"moe-replay-{replay}")
    try:
        run.wait(timeout=600)
        return run.metrics().iloc[1:], run.samples()
    finally:
        run.kill()


@pytest.mark.parametrize('replay', [True, False])
def test_moe_loop_routes(ray_local, tmp_path, replay):
    m, s = moe_run(tmp_path, replay)
    assert list(m.step) == [1, 2, 3]
    assert (
        m.identity_checked == m['train/tokens']
    ).all()  # ids, logprobs, versions and routes as the engine returned them
    assert (m['routing/replay'] == float(replay)).all()
    assert 'routing/agreement/L0' not in m  # layer 0 is dense: no column for it
    if replay:
        assert (m['routing/agreement'] == 1.0).all() and (m['routing/flip_frac'] == 0).all()
        assert m['routing/live_logp_gap_mean'].notna().all()  # compare: the same rows scored with live routing
    else:
        assert (m['routing/agreement'] == m['routing/natural_agreement']).all()
    assert (m['routing/natural_agreement'] > 0.9).all() and m['routing/logp_gap_mean'].notna().all()
    # samples carry the rollout's and the trainer's routes per token, layer 0 (dense) unknown on both sides
    for routes, train, text_tokens in zip(s.routes, s.train_routes, s.tokens):
        routes, train = tokens_layers_slots(routes), tokens_layers_slots(train)
        assert routes.shape == train.shape and routes.shape[0] > text_tokens and routes.shape[1:] == (3, 2)
        assert (routes[:, 0] == -1).all() and (train[:, 0] == -1).all()
        assert (routes[:-1, 1:] >= 0).all()  # every token but the last (never fed) was routed
        if replay:
            assert (train[:, 1:] >= 0).all() or (
                train == -1
            ).all()  # a trained row has the trainer's routes; a skipped row none
