# Sourced by scripts/gpu-check.sh and scripts/gpu-vllm.sh: what both print of the GPU machine,
# where they put checkpoints, and the environment for the wheels they carry in.

fstype() { stat -f -c %T "$1" 2>/dev/null || echo "?"; }

gpu_machine() {
  echo "== machine ($(date -u +%FT%TZ))"
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
    --format=csv 2>&1 || echo "nvidia-smi: not available"
  echo "CPUs: $(nproc); $(free -g | awk '/^Mem:/{print "memory " $2 " GiB total, " $7 " GiB available"}')"
  echo "kernel $(uname -r); user $(id -un)"
  if [ -r /proc/driver/nvidia-fs/version ]; then
    echo "nvidia-fs (GDS kernel driver): $(head -3 /proc/driver/nvidia-fs/version | tr '\n' ' ')"
  else
    echo "nvidia-fs (GDS kernel driver): not loaded: kvikio and cuFile can only use POSIX compat paths"
  fi
  lsblk -d -o NAME,ROTA,SIZE,MODEL 2>/dev/null
}

# pick_local_dir NAME [WANTED]: WANTED if given, else the first of .fastload/NAME,
# /var/tmp/fastload-NAME and /tmp/fastload-NAME that is on a disk: a checkpoint on tmpfs would
# make 'cold' and 'disk' mean memory.
pick_local_dir() {
  local name=$1 want=${2:-}
  if [ -n "$want" ]; then mkdir -p "$want" 2>/dev/null; echo "$want"; return; fi
  local d
  for d in ".fastload/$name" "/var/tmp/fastload-$name" "/tmp/fastload-$name"; do
    mkdir -p "$d" 2>/dev/null || continue
    case "$(fstype "$d")" in tmpfs|ramfs) continue ;; esac
    echo "$d"; return
  done
  echo ".fastload/$name"
}
#
# gpu_libpath: native libraries the carried wheels dlopen by name. libkvikio finds libcufile
# through cuda-pathfinder (its directory goes on the library path as a fallback), and
# fastsafetensors dlopens the unversioned libcudart.so, which CUDA's pip wheels do not ship: it
# gets a link to the libcudart that torch itself loaded. Exports LD_LIBRARY_PATH and prints it.
gpu_libpath() {
  local libpath
  libpath=$(python3 - /tmp/fastload-libs <<'PYEOF' 2>/dev/null
import ctypes, glob, os, site, sys
out = []
roots = site.getsitepackages() + [p for p in sys.path if p.endswith("site-packages")] + ["/usr/local/cuda/lib64"]
for root in roots:
    hits = sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libcufile.so.0"))
                  + glob.glob(os.path.join(root, "nvidia", "cufile", "lib", "libcufile.so.0"))
                  + glob.glob(os.path.join(root, "libcufile.so.0")))
    if hits:
        out.append(os.path.dirname(hits[0]))
        break
try:
    ctypes.CDLL("libcudart.so")
except OSError:
    import torch  # noqa: F401  (loads its libcudart.so.N)
    links = sys.argv[1]
    with open("/proc/self/maps") as maps:
        found = [line.split()[-1] for line in maps if "/libcudart.so" in line]
    if found:
        os.makedirs(links, exist_ok=True)
        target = os.path.join(links, "libcudart.so")
        if os.path.lexists(target):
            os.unlink(target)
        os.symlink(found[0], target)
        out.append(links)
print(":".join(out))
PYEOF
)
  if [ -n "$libpath" ]; then
    export LD_LIBRARY_PATH=$libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    echo "library path for dlopen: $LD_LIBRARY_PATH"
  fi
}
