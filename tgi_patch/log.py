"""One log line that reaches TGI's launcher output. Imports nothing heavy (the .pth hook uses it).

The launcher (``text-generation-launcher``) runs each shard with ``--json-output`` and shows
only the stdout lines that parse as loguru's serialized records; stderr is shown only when
a shard fails. So under ``--json-output`` we print such a record to stdout (the launcher
logs it as ``INFO text_generation_launcher: fastload-tgi: ...``); anywhere else, a plain
line on stderr. Loguru itself is not used: TGI configures it to drop records from modules
outside ``text_generation_server``, and at import time it is not configured yet.
"""

from __future__ import annotations

import json
import sys


def emit(message: str, level: str = "INFO") -> None:
    if "--json-output" in sys.argv:
        record = {"text": message + "\n", "record": {"level": {"name": level}, "message": message,
                                                      "name": "tgi_patch"}}
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()
    else:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
