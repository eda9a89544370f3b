"""Reads from a source without a descriptor (an object store): handed to the source itself.

Its own module so that a reader needs one import and one early return for objects.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_fastload.format import SafetensorsFile
from vllm_fastload.readers.base import Call, Pending, Reader
from vllm_fastload.sources.base import RangeInto
from vllm_fastload.tensors import host_bytes


def submit_to_source(sf: SafetensorsFile, calls: Sequence[Call]) -> Pending:
    """Hand ``calls`` to the file's source, which has no descriptor to ``preadv``.

    Rows become one range per row (their gaps are the store's to coalesce: ranges closer than its
    ``coalesce_gap`` share a request); the destinations must be host memory.
    """
    ranges = [RangeInto(call.offset, host_bytes(call.dest)) for call in Reader.plain_calls(calls)]
    return Pending([sf.source.submit_ranges_into(ranges)])
