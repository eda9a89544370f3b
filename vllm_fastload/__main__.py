import sys

from vllm_fastload.cli import main

sys.exit(main())
