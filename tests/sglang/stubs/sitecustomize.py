"""Test-only start-up code for every Python process of the SGLang tests (on ``PYTHONPATH`` there).

Why: the only torchvision on the package registries is a CUDA build whose ``_meta_registrations``
registers fake kernels for operators its CUDA library would define; with CPU torch the import fails
("operator torchvision::nms does not exist"), and transformers imports torchvision as SGLang starts.
An empty module in its place lets torchvision import; nothing SGLang's loading does uses those
operators. See tests/sglang/stubs/sgl_kernel for the other stub.
"""

import sys
import types

sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
