"""vLLM's post-processing, one decoder layer at a time, while later layers are still being read.

vLLM runs ``process_weights_after_loading`` over the whole model after ``load_weights`` returns:
for each module with a quantization method, a step that turns the loaded weights into the
kernels' format (on vLLM-CPU even unquantized linears are repacked; on GPUs GPTQ/AWQ go to
Marlin layouts, FP8 MoE weights are shuffled). Here that same step runs for each module of a
decoder layer as soon as the read has written every parameter of the module, so it overlaps the
reads of the layers after it. vLLM's own pass then skips exactly those modules, once: each
module is post-processed exactly once, by vLLM's code, in the order vLLM would within the
module. Embeddings, the LM head, the final norm, attention's own post-load step and the model's
hook stay in vLLM's pass (they come after the layers, and tied embeddings are re-tied there first).
"""

from __future__ import annotations

import time
from typing import Any

from torch import nn

from vllm_fastload.vllm_plugin import compat

#: Set on a quantization method whose next ``process_weights_after_loading`` call must skip the
#: modules listed (already post-processed here).
_DONE = "_fastload_post_processed"


class LayerPostProcessor:
    """A ``rank.ParameterListener`` that post-processes each module whose parameters are complete."""

    def __init__(self, model: nn.Module, target_device: Any) -> None:
        self.target_device = target_device
        self.modules: dict[str, nn.Module] = {}
        self.owner: dict[str, str] = {}  # parameter (or buffer) name -> module name
        self.waiting: dict[str, set[str]] = {}  # module -> its parameters not complete yet
        for name, module in model.named_modules():
            method = compat.quant_method(module)
            if method is None or not hasattr(method, "__dict__"):
                continue
            own = [f"{name}.{n}" for n, _ in module.named_parameters(recurse=False)]
            if own:
                self.modules[name] = module
                self.waiting[name] = set(own)
                self.owner.update(dict.fromkeys(own, name))
        self.processed = 0
        self.seconds = 0.0
        #: Parameters a post-processing step added (e.g. vLLM-CPU's int8 ``azp_adj``): not the
        #: checkpoint's to provide, so vLLM's completeness check must not ask for them (the default
        #: loader's check runs before post-processing and never sees them).
        self.added: set[str] = set()

    def expect(self, written: set[str]) -> None:
        # A module's buffers written from the checkpoint must be complete too.
        for name, module in self.modules.items():
            for n, _ in module.named_buffers(recurse=False):
                full = f"{name}.{n}"
                if full in written:
                    self.waiting[name].add(full)
                    self.owner[full] = name

    def ready(self, layer: int | None, names: list[str]) -> None:
        complete = []
        for param in names:
            module = self.owner.get(param)
            if module is None or module not in self.waiting:
                continue
            waiting = self.waiting[module]
            waiting.discard(param)
            if not waiting:
                del self.waiting[module]
                complete.append(module)
        if layer is None:
            return  # embeddings and final groups: left to vLLM's pass (see the module docstring)
        start = time.perf_counter()
        for name in complete:
            self._process(name, self.modules[name])
        self.seconds += time.perf_counter() - start

    def _process(self, name: str, module: nn.Module) -> None:
        before = {n for n, _ in module.named_parameters(recurse=False)}
        method = compat.post_process_module(module, self.target_device)
        self.processed += 1
        self.added.update(f"{name}.{n}" for n, _ in module.named_parameters(recurse=False) if n not in before)
        if method is not None:
            _skip_next(method, module)


def _skip_next(method: Any, module: nn.Module) -> None:
    """Make ``method.process_weights_after_loading`` skip ``module`` the next time it is called
    with it (vLLM's pass after ``load_weights``), and behave as before after that (a later weight
    reload post-processes again). An attribute on this one method object, removed once every
    module it skips has come by."""
    done: list[nn.Module] | None = method.__dict__.get(_DONE)
    if done is None:
        original = method.process_weights_after_loading
        own = "process_weights_after_loading" in method.__dict__  # someone's wrapper: put it back after
        done = []

        def process_weights_after_loading(layer: nn.Module) -> None:
            for i, m in enumerate(done):
                if m is layer:
                    del done[i]
                    if not done:
                        if own:
                            method.process_weights_after_loading = original
                        else:
                            del method.process_weights_after_loading
                        delattr(method, _DONE)
                    return None
            return original(layer)

        method.process_weights_after_loading = process_weights_after_loading
        setattr(method, _DONE, done)
    done.append(module)
