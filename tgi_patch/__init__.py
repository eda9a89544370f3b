"""tgi_patch: vllm-fastload inside Hugging Face TGI (text-generation-inference v2.4.1..v3.3.7).

``FastWeights`` is a drop-in for TGI's ``Weights``; ``apply()`` / ``revert()`` install it in a
running TGI; ``FASTLOAD_TGI=1`` does that in every shard through ``fastload_tgi.pth``.

Names are loaded lazily: the ``.pth`` line imports ``tgi_patch.hook`` in every interpreter
start-up, which must not pull in torch.
"""

from __future__ import annotations

__all__ = ["FastWeights", "apply", "is_applied", "revert"]


def __getattr__(name: str) -> object:
    if name == "FastWeights":
        from tgi_patch.weights import FastWeights

        return FastWeights
    if name in ("apply", "revert", "is_applied"):
        from tgi_patch import activate

        return getattr(activate, name)
    raise AttributeError(f"module 'tgi_patch' has no attribute {name!r}")
