"""A test-only fault for ``vllm-fastload verify``: with ``VERIFY_FAULT_RANK=r`` in the environment
(and this directory on ``PYTHONPATH``), rank r's plan reads one sliced parameter region one row
too early. Every check fastload makes still passes (the bytes lie inside the tensor, the plan reads
no more than the rank keeps), so only a comparison with the default loader can tell."""

import os

if os.environ.get("VERIFY_FAULT_RANK"):
    from vllm_fastload.model import rank as _rank

    _plan_reads = _rank.plan_reads

    def _faulty_plan_reads(probe, infos, strided_min_skip):
        import dataclasses

        import torch.distributed as dist

        reads = _plan_reads(probe, infos, strided_min_skip)
        if dist.is_initialized() and dist.get_rank() == int(os.environ["VERIFY_FAULT_RANK"]):
            targets = dict(reads.targets)
            for req in sorted(targets, key=lambda r: r.key or r.name):
                if req.dim == 0 and req.start > 0:
                    targets[dataclasses.replace(req, start=req.start - 1)] = targets.pop(req)
                    print(f"VERIFY_FAULT: {req.name} read from row {req.start - 1} on this rank", flush=True)
                    break
            reads = dataclasses.replace(reads, targets=targets)
        return reads

    _rank.plan_reads = _faulty_plan_reads
