"""Helpers around the loader, not part of it: the demo, random test/benchmark checkpoints, a vLLM server.

The package root holds only the loading pipeline (format -> plan -> read -> deliver) and its
public API; what the demo, the tests and the benchmarks need to set themselves up lives here:

- ``checkpoints``: small random Hugging Face checkpoints (config.json + safetensors), since the
  machines we test on have no internet (``vllm-fastload make-checkpoint``);
- ``servers``, ``vllm_server``, ``sglang_server``: start an engine's HTTP server in a subprocess,
  wait until it is ready, talk to it, stop it with what it started (``processes``);
- ``demo``: the main job behind ``vllm-fastload demo`` and ``scripts/demo.sh``;
- ``verify``, ``sglang_ranks`` and ``digests``: ``vllm-fastload verify``'s rank processes (vLLM's,
  SGLang's) and the per-parameter digests they compare.

Nothing here is imported by the pipeline or by the vLLM/SGLang/TGI adapters.
"""
