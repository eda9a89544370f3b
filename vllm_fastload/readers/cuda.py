"""``cuda``: threads ``pread`` into pinned staging buffers; copies to the GPU run async on a side stream.

Disk and PCIe overlap: while one slot's bytes travel to the device, other threads fill other
slots. A slot is returned to the ring only after its copy completed, so staging memory is bounded
by ``slots x slot size`` (a quarter of the memory budget).
"""

from __future__ import annotations

import queue
from collections.abc import Sequence

import torch

from vllm_fastload.config import FastloadConfig
from vllm_fastload.format import SafetensorsFile
from vllm_fastload.readers.base import Pending, ReadCall, Reader, RowsCall, pread_into


class CudaReader(Reader):
    name = "cuda"

    def __init__(self, config: FastloadConfig, device: torch.device) -> None:
        super().__init__(config, device)
        if device.type != "cuda":
            raise ValueError(f"the cuda backend needs a CUDA device, got {device}")
        # Staging gets at most a quarter of the budget (the rest is for device chunk buffers):
        # at least two slots, smaller than read_size if the budget is tight.
        staging = int(config.memory_budget) // 4
        self.slot_size = max(4096, min(int(config.read_size), staging // 2) // 4096 * 4096)
        slots = max(2, min(2 * config.threads, staging // self.slot_size))
        self._slots: queue.Queue = queue.Queue()
        for _ in range(slots):
            self._slots.put(torch.empty(self.slot_size, dtype=torch.uint8, pin_memory=True))
        self._nslots = slots
        self.stream = torch.cuda.Stream(device=device)

    @property
    def staging_bytes(self) -> int:
        return self._nslots * self.slot_size

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def submit(self, sf: SafetensorsFile, calls: Sequence[ReadCall | RowsCall]) -> Pending:
        pool = self.threads()
        futures = [pool.submit(self._stage_batch, sf, batch) for batch in self.batches(calls, self.slot_size)]
        return Pending(futures)

    def _stage_batch(self, sf: SafetensorsFile, batch: list[ReadCall]) -> None:
        slot = self._slots.get()
        try:
            _fill_slot(sf, slot, batch)
            with torch.cuda.stream(self.stream):
                used = 0
                for _, length, dest in batch:
                    dest.copy_(slot[used:used + length], non_blocking=True)
                    used += length
                done = torch.cuda.Event()
                done.record(self.stream)
            # Other threads keep reading into other slots meanwhile: disk and PCIe overlap.
            done.synchronize()
        finally:
            self._slots.put(slot)
            batch.clear()  # see host._read_batch: no view of the buffer outlives the task

    def close(self) -> None:
        super().close()
        self.stream.synchronize()


def _fill_slot(sf: SafetensorsFile, slot: torch.Tensor, batch: list[ReadCall]) -> None:
    """Read a batch's ranges packed into the pinned ``slot``: ``pread`` for a local file; for an
    object, one submission to its source (neighbouring ranges share a GET, requests run in parallel)."""
    views, used = [], 0
    for offset, length, _ in batch:
        views.append((offset, memoryview(slot[used:used + length].numpy())))
        used += length
    if sf.fd is None:
        sf.source.submit_ranges_into(views).result()
        return
    for offset, view in views:
        pread_into(sf.fd, sf.path, offset, view)
