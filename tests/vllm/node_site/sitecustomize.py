"""Put on the PYTHONPATH of the tests' two-node starts (``multinode.py``): with
FASTLOAD_DEV_TEST_DIGESTS set, every vLLM process of the start, once it has loaded its plugins,
wraps ``BaseModelLoader.load_model`` so that each rank writes the digests of its parameters and
buffers, after vLLM's post-processing, to ``$FASTLOAD_DEV_TEST_DIGESTS/rank<N>.json``: how the
tests see the weights of a start whose head is the OpenAI server (no ``apply_model``)."""

import os

if os.environ.get("FASTLOAD_DEV_TEST_DIGESTS"):
    import vllm.plugins as _plugins

    _load_general_plugins = _plugins.load_general_plugins

    def load_general_plugins() -> None:
        _load_general_plugins()
        from hooks import write_digests_after_load

        write_digests_after_load(os.environ["FASTLOAD_DEV_TEST_DIGESTS"])

    _plugins.load_general_plugins = load_general_plugins
