"""Three redirections that let NVIDIA AutoModel 0.7.0 build on a CPU over gloo (TEST ONLY; `make test-automodel`).

Each points AutoModel's own device lookup at the CPU and changes nothing else; without any one of them the build or the
first forward fails (checked by leaving each out):
- P1 `nemo_automodel/_transformers/auto_model.py:770` (and :498, :886, :1255, :1259, `model_init.py:1033`) call
  `torch.cuda.current_device()`, which raises on a CPU build of torch: it returns 0 (the device is only named there).
- P2 `auto_model.py:498` hands that index to `apply_model_infrastructure` as the device to initialise and load the
  weights on (`checkpointing.py:2399` `torch.empty_like(t, device=device)`): it gets the CPU.
- P3 Qwen3-MoE's `initialize_weights` (`components/models/qwen3_moe/model.py:356`) defaults its buffers' device to
  CUDA, so the rotary embedding's first forward fails (`gpt_oss/rope_utils.py:91`): it defaults to the CPU.
"""

import functools

import torch

CPU = torch.device('cpu')


def apply():
    "Apply P1-P3 in this process (call after joining the process group, before building)"
    from nemo_automodel._transformers import auto_model
    from nemo_automodel.components.models.qwen3_moe import model as qwen3_moe

    torch.cuda.current_device = lambda: 0  # P1
    build = auto_model.apply_model_infrastructure

    @functools.wraps(build)
    def on_cpu(*a, **kw):  # P2
        return build(*a, **(kw | dict(device=CPU)))

    auto_model.apply_model_infrastructure = on_cpu
    init = qwen3_moe.Qwen3MoeForCausalLM.initialize_weights

    @functools.wraps(init)
    def buffers_on_cpu(self, buffer_device=None, *a, **kw):  # P3
        return init(self, buffer_device or CPU, *a, **kw)

    qwen3_moe.Qwen3MoeForCausalLM.initialize_weights = buffers_on_cpu
