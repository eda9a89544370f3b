"""``cuda``: threads ``pread`` into pinned staging slots; copies to the GPU run async, a stream per thread.

The staging itself (slots, streams, rows packed into one copy) is ``staging.PinnedStaging``;
this backend sends every read through it, from local files and object stores alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_fastload.format import SafetensorsFile
from vllm_fastload.readers.base import Call, Pending
from vllm_fastload.readers.staging import StagedReader


class CudaReader(StagedReader):
    name = "cuda"

    def submit(self, sf: SafetensorsFile, calls: Sequence[Call]) -> Pending:
        return Pending(self.staging.start(self, sf, calls))
