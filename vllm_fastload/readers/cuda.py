"""``cuda``: threads ``pread`` into pinned staging slots; copies to the GPU run async, a stream per thread.

The staging itself (slots, streams, rows packed into one copy) is ``staging.PinnedStaging``;
this backend sends every read through it, from local files and object stores alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_fastload.config import FastloadConfig
from vllm_fastload.format import SafetensorsFile
from vllm_fastload.readers.base import Pending, ReadCall, Reader, RowsCall
from vllm_fastload.readers.staging import PinnedStaging


class CudaReader(Reader):
    name = "cuda"
    reads_rows = True

    def __init__(self, config: FastloadConfig, device: torch.device) -> None:
        super().__init__(config, device)
        if device.type != "cuda":
            raise ValueError(f"the cuda backend needs a CUDA device, got {device}")
        self.staging = PinnedStaging(config, device)

    @property
    def staging_bytes(self) -> int:
        return self.staging.staging_bytes

    @property
    def direct_read_ahead(self) -> int:
        return self.staging.read_ahead

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def submit(self, sf: SafetensorsFile, calls: Sequence[ReadCall | RowsCall]) -> Pending:
        return Pending(self.staging.start(self, sf, calls))

    def close(self) -> None:
        super().close()
        self.staging.close()
