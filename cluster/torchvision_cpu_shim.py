"""Lets PyPI's torchvision import beside the CPU build of torch in .venv-vllm (`make venv-vllm` installs it as a .pth).

PyPI's torchvision wheel is built for CUDA: its C ops (`torchvision/_C.so`) link CUDA libraries the CPU torch lacks,
so they do not load, and torchvision then fails at import while registering fake kernels for `nms` and `qnms`,
operators that only its C library defines. Declaring their schemas first lets the import finish without the C ops.
vLLM's vision-language models need only torchvision's Python transforms (resize and normalise on tensors), which
work without them. Never loaded by the main venv or on the cluster.
"""

import sys


def _declare():
    import torch

    for op in ('nms', 'qnms'):
        try:
            torch.library.define(f'torchvision::{op}', '(Tensor dets, Tensor scores, float iou_threshold) -> Tensor')
        except RuntimeError:  # already defined (a torchvision whose C ops load)
            pass


class _BeforeTorchvision:
    "Declares the schemas when torchvision is first imported (not at every start: importing torch takes seconds)"

    def find_spec(self, name, path=None, target=None):
        if name == 'torchvision':
            sys.meta_path.remove(self)
            _declare()
        return None  # the normal finders import it


sys.meta_path.insert(0, _BeforeTorchvision())
