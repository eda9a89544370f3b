"""A real network filesystem on one machine: a private ``sshd`` on loopback, mounted with ``sshfs``.

Why sshfs: it is the network filesystem a test or a benchmark can set up on one machine
without kernel modules (the kernels we run on have no NFS client, FUSE is there), from
Debian's own packages (``openssh-server``, ``sshfs``). Every read goes through FUSE, the SFTP
protocol and a TCP connection, so it has what makes network filesystems slow for vLLM's
default loader: per-request latency, small requests, a page cache the server side cannot warm.

Nothing outside a temporary directory is changed: the server runs with its own config, host
key and client key, listens on 127.0.0.1 only and is stopped (and the mount undone with
``fusermount -u``) when the context exits, on error too. The one exception: ``sshd`` run by
root insists on its privilege-separation directory (``/run/sshd``) and is given it if missing.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vllm_fastload.tools.processes import stop_process_group
from vllm_fastload.tools.servers import free_port

#: Binaries a mount needs, and the Debian package that has each.
BINARIES = {"sshd": "openssh-server", "ssh-keygen": "openssh-client", "ssh": "openssh-client",
            "sshfs": "sshfs", "fusermount": "fuse3"}
_SBIN = ("/usr/sbin", "/usr/local/sbin", "/sbin")


class NetfsUnavailable(RuntimeError):
    """The machine cannot mount sshfs (a binary or /dev/fuse missing): the message names what."""


def find_binary(name: str) -> str | None:
    """``name`` on PATH or in an sbin directory (``sshd`` is not on a normal user's PATH)."""
    found = shutil.which(name) or shutil.which(name, path=os.pathsep.join(_SBIN))
    if found is None and name == "fusermount":
        found = shutil.which("fusermount3")
    return found


def missing() -> list[str]:
    """What this machine lacks for an sshfs mount, each as 'what (how to get it)'; empty if nothing."""
    out = [f"{name} (apt-get install {pkg})" for name, pkg in BINARIES.items() if find_binary(name) is None]
    if not os.path.exists("/dev/fuse"):
        out.append("/dev/fuse (a FUSE-capable kernel/container: --device /dev/fuse --cap-add SYS_ADMIN)")
    return out


def _run(cmd: list[str], what: str, timeout: float = 60) -> None:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stdout.strip()}")


def is_mounted(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a mount point listed in ``/proc/mounts``."""
    target = os.path.realpath(path)
    with open("/proc/mounts") as f:
        return any(line.split()[1] == target for line in f if len(line.split()) > 1)


class SshServer:
    """``sshd`` on 127.0.0.1:<free port>, in the foreground of its own process group, with a
    throwaway host key and one authorised throwaway client key, all under ``workdir``."""

    def __init__(self, workdir: Path, startup_timeout_s: float = 20.0) -> None:
        self.dir = workdir
        self.port = free_port()
        self.user = os.environ.get("USER") or _username()
        self.client_key = workdir / "client_key"
        self._timeout = startup_timeout_s
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> SshServer:
        keygen = find_binary("ssh-keygen")
        sshd = find_binary("sshd")
        if keygen is None or sshd is None:
            raise NetfsUnavailable("cannot start sshd: missing " + ", ".join(missing()))
        host_key = self.dir / "host_key"
        for key in (host_key, self.client_key):
            _run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(key)], "ssh-keygen")
        authorized = self.dir / "authorized_keys"
        authorized.write_text(Path(f"{self.client_key}.pub").read_text())
        authorized.chmod(0o600)
        config = self.dir / "sshd_config"
        sftp = _sftp_server()
        config.write_text("\n".join([
            f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {host_key}",
            f"AuthorizedKeysFile {authorized}", f"PidFile {self.dir / 'sshd.pid'}",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PubkeyAuthentication yes",
            "PermitRootLogin prohibit-password", "StrictModes no", "UsePAM no", "UseDNS no",
            f"AllowUsers {self.user}", f"Subsystem sftp {sftp}", "LogLevel ERROR", ""]))
        if os.geteuid() == 0 and not os.path.isdir("/run/sshd"):
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd as root refuses to start without it
        self._log = (self.dir / "sshd.log").open("wb")
        # -D: foreground (we own the process), -e: log to stderr (our log file)
        self._proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(config)], stdout=self._log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                log = (self.dir / "sshd.log").read_text(errors="replace").strip()
                status, self._proc = self._proc.returncode, None
                raise RuntimeError(f"sshd exited at start-up with status {status}: {log or '(no output)'}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    if s.recv(4).startswith(b"SSH-"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.__exit__()
        raise RuntimeError(f"sshd did not answer on 127.0.0.1:{self.port} within {self._timeout} s")

    def __exit__(self, *exc: object) -> None:
        proc, self._proc = self._proc, None
        stop_process_group(proc)  # the server and any children it forked
        log = getattr(self, "_log", None)
        if log is not None:
            log.close()


def _sftp_server() -> str:
    for candidate in ("/usr/lib/openssh/sftp-server", "/usr/libexec/openssh/sftp-server", "/usr/libexec/sftp-server"):
        if os.path.exists(candidate):
            return candidate
    return "internal-sftp"


def _username() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def unmount(mountpoint: str | os.PathLike, attempts: int = 20) -> None:
    """``fusermount -u``, retried while the mount is busy (a reader still closing), lazily at last."""
    fusermount = find_binary("fusermount") or "fusermount"
    for _ in range(attempts):
        if not is_mounted(mountpoint):
            return
        if subprocess.run([fusermount, "-u", str(mountpoint)], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0:
            return
        time.sleep(0.25)
    _run([fusermount, "-u", "-z", str(mountpoint)], "lazy unmount")


@contextmanager
def sshfs_mount(directory: str | os.PathLike, options: tuple[str, ...] = (),
                workdir: str | os.PathLike | None = None) -> Iterator[Path]:
    """Yield a read-only sshfs mount of ``directory``, served by a private sshd on loopback.

    ``options`` are extra ``-o`` options for sshfs (e.g. ``max_conns=4``). The mount is undone
    and the server stopped when the context exits, whatever happened inside it.
    """
    lacking = missing()
    if lacking:
        raise NetfsUnavailable("cannot mount sshfs here: missing " + ", ".join(lacking))
    source = Path(directory).resolve()
    with tempfile.TemporaryDirectory(prefix="fastload-sshfs-", dir=workdir) as tmp:
        tmp_path = Path(tmp)
        mountpoint = tmp_path / "mnt"
        mountpoint.mkdir()
        with SshServer(tmp_path) as server:
            opts = ["ro", f"IdentityFile={server.client_key}", "StrictHostKeyChecking=no",
                    "UserKnownHostsFile=/dev/null", "BatchMode=yes", "LogLevel=ERROR", f"port={server.port}",
                    *options]
            cmd = [find_binary("sshfs") or "sshfs", f"{server.user}@127.0.0.1:{source}", str(mountpoint),
                   "-o", ",".join(opts)]
            _run(cmd, "sshfs mount")
            try:
                if not is_mounted(mountpoint):
                    raise RuntimeError(f"sshfs exited 0 but {mountpoint} is not in /proc/mounts")
                yield mountpoint
            finally:
                unmount(mountpoint)


def served_bytes(mountpoint: str | os.PathLike) -> int:
    """Bytes the server of an ``sshfs_mount`` has sent for it so far: the ``wchar`` (``/proc/PID/io``)
    of the SFTP server processes its private ``sshd`` runs, which write every reply (file data and
    SFTP headers) to the connection. Counted on the server side, so a client's page cache, read-ahead
    and retries all show as they would on a network."""
    config = str(Path(mountpoint).parent / "sshd_config")
    parents: dict[int, int] = {}
    servers: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()  # sshd rewrites it into one string
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        if config.encode() in cmdline:
            servers.append(int(entry))
    total = 0
    for pid in parents:
        ancestor = parents.get(pid)
        while ancestor and ancestor not in servers:
            ancestor = parents.get(ancestor)
        if not ancestor:
            continue
        try:
            if b"sftp-server" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            for line in Path(f"/proc/{pid}/io").read_text().splitlines():
                if line.startswith("wchar:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total
