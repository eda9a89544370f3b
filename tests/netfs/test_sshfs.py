"""sshfs for real: the mount helper, the filesystem detection and fastload reading through FUSE."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import vllm_fastload
from vllm_fastload import machine, policy
from vllm_fastload.bench import netfs
from vllm_fastload.readers import pagecache
from vllm_fastload.tp_rules import rank_requests

from .conftest import require_sshfs


def _expected(local: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(local.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_mount_serves_the_files_and_is_undone(local_checkpoint: Path, monkeypatch) -> None:
    require_sshfs()
    ports = []
    real = netfs.SshServer.__enter__

    def spy(self):
        ports.append(self.port)
        return real(self)

    monkeypatch.setattr(netfs.SshServer, "__enter__", spy)
    with netfs.sshfs_mount(local_checkpoint) as mnt:
        assert netfs.is_mounted(mnt)
        assert machine.filesystem_type(mnt / "model.safetensors.index.json") == "fuse.sshfs"
        assert sorted(p.name for p in mnt.iterdir()) == sorted(p.name for p in local_checkpoint.iterdir())
        for path in local_checkpoint.glob("*.safetensors"):
            assert (mnt / path.name).read_bytes() == path.read_bytes()
        assert _port_open(ports[0])
    assert not netfs.is_mounted(mnt)
    assert not mnt.exists()  # the temporary directory is gone with the mount point in it
    assert not _port_open(ports[0])  # sshd stopped


def test_mount_is_undone_when_the_body_fails(local_checkpoint: Path) -> None:
    require_sshfs()
    with pytest.raises(ZeroDivisionError), netfs.sshfs_mount(local_checkpoint) as mnt:
        assert netfs.is_mounted(mnt)
        _ = 1 / 0
    assert not netfs.is_mounted(mnt)


def test_mount_of_a_missing_directory_fails_clearly(tmp_path: Path) -> None:
    require_sshfs()
    with pytest.raises(RuntimeError, match="sshfs mount failed"), netfs.sshfs_mount(tmp_path / "nowhere"):
        pass


@pytest.mark.parametrize("direct_io", ["auto", "always", "never"])
def test_fastload_reads_through_sshfs_bit_exactly(mounted: Path, local_checkpoint: Path, direct_io: str) -> None:
    """Every tensor equals safetensors on the local files, with O_DIRECT on FUSE and without."""
    expected = _expected(local_checkpoint)
    with vllm_fastload.open(mounted, config={"progress": False, "direct_io": direct_io}) as ckpt:
        got = dict(ckpt.iter_tensors())
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("strided_min_skip", [None, 0], ids=["network-default", "row-by-row"])
def test_tp2_slices_through_sshfs_bit_exactly(mounted: Path, local_checkpoint: Path, rank: int,
                                              strided_min_skip: int | None) -> None:
    """Each rank's slices equal the local slices: column slices as enclosing rows (the network
    default) and row by row through FUSE's page cache."""
    config = {"progress": False}
    mine = config if strided_min_skip is None else {**config, "strided_min_skip": strided_min_skip}
    with vllm_fastload.open(local_checkpoint, config=config) as local, \
            vllm_fastload.open(mounted, config=mine) as remote:
        requests = rank_requests(remote.tensors, 2, rank)
        assert any(r.dim == 1 for r in requests)  # the row-parallel case is exercised
        dests = {}
        for r in requests:
            ref = local.get_slice(r.name, r.dim, r.start, r.length) if r.dim is not None else local.get_tensor(r.name)
            dests[r] = torch.empty_like(ref)
        remote.read_into(dests)
        for r, dest in dests.items():
            ref = local.get_slice(r.name, r.dim, r.start, r.length) if r.dim is not None else local.get_tensor(r.name)
            assert torch.equal(dest, ref), r.result_key


def test_network_defaults_apply_only_to_unset_fields(mounted: Path, local_checkpoint: Path) -> None:
    assert machine.is_network("fuse.sshfs") and machine.is_network("nfs4") and not machine.is_network("ext4")
    with vllm_fastload.open(mounted, config={"progress": False}) as ckpt:
        for field, value in policy.NETWORK_DEFAULTS.items():
            assert getattr(ckpt.config, field) == value
    mine = {"progress": False, **{field: 12345 for field in policy.NETWORK_DEFAULTS}}
    with vllm_fastload.open(mounted, config=mine) as ckpt:
        for field in policy.NETWORK_DEFAULTS:
            assert getattr(ckpt.config, field) == 12345  # an explicit setting wins
    with vllm_fastload.open(local_checkpoint, config={"progress": False}) as ckpt:
        assert not machine.is_network(machine.filesystem_type(local_checkpoint))
        for field in policy.NETWORK_DEFAULTS:
            assert not ckpt.config.is_set(field)


def test_early_reads_on_local_disks_by_default_and_on_network_filesystems_when_asked(
        mounted: Path, local_checkpoint: Path, monkeypatch) -> None:
    """What the vLLM plugin reads while vLLM starts (``early.files_to_read``), decided on a real
    sshfs mount and on the local disk it serves: by default ('auto') the local disk only,
    'always' (or true) both, 'never' (or false) neither."""
    from vllm_fastload.early.decide import files_to_read

    served = sorted(p.name for p in local_checkpoint.glob("*.safetensors"))
    assert len(served) == 2

    def names(where: Path, extra: dict) -> list[str]:
        return [Path(f).name for f in files_to_read(str(where), extra)]

    assert names(local_checkpoint, {}) == served
    assert names(mounted, {}) == []
    for where in (mounted, local_checkpoint):
        assert names(where, {"early_reads": "always"}) == names(where, {"early_reads": True}) == served
        assert names(where, {"early_reads": "never"}) == names(where, {"early_reads": False}) == []
    monkeypatch.setenv("FASTLOAD_EARLY_READS", "true")
    assert names(mounted, {}) == served
    assert names(mounted, {"early_reads": "auto"}) == []  # the extra config wins
    assert files_to_read(str(mounted / "no-such-dir"), {}) == []
    assert files_to_read("s3://bucket/model", {}) == []


def test_no_row_exchange_by_default_on_a_network_filesystem(mounted: Path, local_checkpoint: Path) -> None:
    """What a vLLM rank offers its tensor-parallel group (``rank._Sharing.offer``) for a checkpoint
    on a real sshfs mount, cold: by default nothing (the client's page cache shares already);
    ``always`` and ``never`` are obeyed. (A local disk: tests/vllm/test_sharing.py.)"""
    from vllm_fastload.bench.cache import evict
    from vllm_fastload.config import FastloadConfig
    from vllm_fastload.model.rank import _Sharing
    from vllm_fastload.plan import TensorRequest

    def offer(**settings) -> bool:
        config = FastloadConfig(progress=False, **settings)
        with vllm_fastload.open(mounted, config=config) as ckpt:
            evict(sorted(str(p) for p in local_checkpoint.glob("*.safetensors")))  # the server's pages
            infos = {name: ckpt.info(name) for name in ckpt.keys()}
            name = "model.layers.0.self_attn.o_proj.weight"
            sharing = _Sharing(None)
            sharing.decide(ckpt)
            return sharing.offer({TensorRequest(name, dim=1, start=0, length=infos[name].shape[1] // 2): None})

    assert offer() is False
    assert offer(row_exchange="always") is True
    assert offer(row_exchange="never") is False


#: A reader that reads a file to its end, then exits.
_READ_TO_END = "import sys\nf = open(sys.argv[1], 'rb')\nwhile f.read(1 << 20):\n    pass"


@pytest.mark.parametrize(("options", "kept"), [((), False), (("auto_cache",), True), (("kernel_cache",), True)],
                         ids=["defaults", "auto_cache", "kernel_cache"])
def test_early_reads_survive_a_ranks_open_on_sshfs_only_with_a_cache_option(
        local_checkpoint: Path, options: tuple[str, ...], kept: bool) -> None:
    """What docs/network-filesystems.md says of early reads on sshfs: with its defaults, FUSE drops a
    file's page cache whenever a process opens it, so what one process read (early reads) is gone
    when the next (a rank) opens the file; ``-o auto_cache`` (kept while the file is unchanged) or
    ``-o kernel_cache`` keeps it."""
    require_sshfs()
    with netfs.sshfs_mount(local_checkpoint, options) as mount:
        path = next(mount.glob("*.safetensors"))
        subprocess.run([sys.executable, "-c", _READ_TO_END, str(path)], check=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            share = pagecache.cached_share(fd, 0, os.fstat(fd).st_size, samples=64)
        finally:
            os.close(fd)
    assert share == (1.0 if kept else 0.0), share
