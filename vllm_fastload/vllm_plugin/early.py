"""Early reads while vLLM starts (the mechanism, engine-independent, is ``vllm_fastload.early``).

vLLM verifies its config (``VllmConfig.try_verify_and_update_config``) in the API server's or
``LLM(...)``'s process long before the workers load weights: ``start`` is called there
(``compat.on_config``) and reads the checkpoint into the page cache for the ranks of this node.
On a start that spans nodes (``--nnodes``, each node verifying its own config: the head's
``LLM``/API server and every ``--headless`` node) it reads this node's share: ``_node_layout``
reads off vLLM's config what the node's ranks hold, with vLLM's own layer partition
(``get_pp_indices``, which honours ``VLLM_PP_LAYER_PARTITION``) and expert map. So does each node
of a data-parallel start with expert parallelism (``--data-parallel-size`` over nodes,
``--data-parallel-start-rank`` on each headless one), where every data-parallel rank holds its
own experts: the node reads the experts of its data-parallel ranks, and what every rank holds.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_fastload.model import EarlyStart, NodeLayout, RankHolding, start_early_reads

logger = logging.getLogger("vllm_fastload.vllm_plugin")


def start(vllm_config: Any) -> None:
    """Read the checkpoint of ``vllm_config`` into the page cache, once per path in a process tree."""
    start_early_reads("vLLM", lambda: _settings(vllm_config))


def _settings(vllm_config: Any) -> EarlyStart:
    model_config, load_config = vllm_config.model_config, vllm_config.load_config
    parallel = vllm_config.parallel_config
    nodes = _nodes(parallel)
    if _experts_across_dp(vllm_config):
        nodes *= _dp_nodes(parallel)
    layout = None
    if nodes > 1:
        try:
            layout = _node_layout(vllm_config)
        except Exception as exc:  # a vLLM laid out differently: every file, as on one node
            logger.info("fastload: early reads cannot tell what this node's ranks hold (%s: %s)",
                        type(exc).__name__, exc)
    return EarlyStart(path=getattr(model_config, "model_weights", "") or model_config.model,
                      extra=getattr(load_config, "model_loader_extra_config", None) or {},
                      local_ranks=_local_ranks(vllm_config), revision=getattr(model_config, "revision", None),
                      download_dir=getattr(load_config, "download_dir", None), nodes=nodes, layout=layout)


def _local_ranks(vllm_config: Any) -> int:
    """How many ranks load on this node (each leaves its marks): the node's share of the
    tensor- and pipeline-parallel group, for each data-parallel engine the node runs."""
    parallel = vllm_config.parallel_config
    ranks = getattr(parallel, "local_world_size", None)
    if ranks is None:  # vLLM before 0.32
        ranks = max(int(parallel.world_size) // max(int(getattr(parallel, "nnodes", 1) or 1), 1), 1)
    engines = getattr(parallel, "data_parallel_size_local", 1)
    return int(ranks) * int(1 if engines is None else engines)


def _nodes(parallel: Any) -> int:
    """The nodes one model replica spans (``nnodes`` within a data-parallel rank)."""
    nodes = getattr(parallel, "nnodes_within_dp", None)
    if nodes is None:  # vLLM before 0.32
        nodes = getattr(parallel, "nnodes", 1)
    return max(int(nodes or 1), 1)


def _dp(parallel: Any) -> tuple[int, int, int]:
    """The data-parallel size, the first data-parallel rank this node runs, and how many it runs
    (``--data-parallel-start-rank`` and ``--data-parallel-size-local``; one where unset)."""
    size = max(int(getattr(parallel, "data_parallel_size", 1) or 1), 1)
    local = getattr(parallel, "data_parallel_size_local", None)
    local = size if local is None else int(local)
    return size, int(getattr(parallel, "data_parallel_rank", 0) or 0), max(local, 1)


def _dp_nodes(parallel: Any) -> int:
    """The nodes the data-parallel ranks are spread over (as many on each as on this one)."""
    size, _, local = _dp(parallel)
    return -(-size // local)


def _experts_across_dp(vllm_config: Any) -> bool:
    """An MoE whose experts vLLM spreads over the data-parallel ranks too (expert parallelism with
    ``--data-parallel-size`` > 1, the ranks of each replica on one node): each node holds the
    experts of its own data-parallel ranks."""
    parallel = vllm_config.parallel_config
    size, _, local = _dp(parallel)
    return (size > local and _nodes(parallel) == 1 and bool(getattr(parallel, "enable_expert_parallel", False))
            and int(vllm_config.model_config.get_num_experts() or 0) > 0)


def _node_layout(vllm_config: Any) -> NodeLayout:
    """What each rank of this node holds, as vLLM lays ranks out: within a replica, global ranks
    ``[local_world_size * node, ...)`` on this node, each ``pp_rank * (pcp * tp) + pcp_rank * tp +
    tp_rank`` (``distributed.parallel_state``); layers by vLLM's ``get_pp_indices``; experts by its
    ``determine_expert_map`` where expert parallelism is on, over ``dp * pcp * tp`` expert ranks,
    rank ``dp_rank * pcp * tp + pcp_rank * tp + tp_rank`` (``FusedMoEParallelConfig``); every
    expert where the placement is not vLLM's linear one. Where experts spread over data-parallel
    ranks on several nodes (``_experts_across_dp``), the node runs whole replicas: every rank of
    each of its data-parallel ranks."""
    from vllm.distributed.utils import get_pp_indices

    parallel, model_config = vllm_config.parallel_config, vllm_config.model_config
    tp, pp = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
    pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    layers = int(model_config.get_total_num_hidden_layers())
    experts = int(model_config.get_num_experts() or 0)
    dp_size, dp_first, dp_local = _dp(parallel)
    if _experts_across_dp(vllm_config):
        node, nodes = dp_first // dp_local, _dp_nodes(parallel)
        held_by = [(dp, rank) for dp in range(dp_first, min(dp_first + dp_local, dp_size))
                   for rank in range(tp * pp * pcp)]
    else:
        node, local, nodes = int(parallel.node_rank_within_dp), int(parallel.local_world_size), _nodes(parallel)
        held_by = [(0, rank) for rank in range(node * local, (node + 1) * local)]
    ep_size = dp_size * pcp * tp
    # (replicas over several nodes and data-parallel ranks too: which node runs which data-parallel
    # rank is not read here, so every expert, as without a placement)
    expert_parallel = (experts > 0 and bool(getattr(parallel, "enable_expert_parallel", False)) and ep_size > 1
                       and (dp_size == 1 or _experts_across_dp(vllm_config)))
    ranks = []
    for dp_rank, rank in held_by:
        tp_rank, pcp_rank, pp_rank = rank % tp, rank // tp % pcp, rank // (tp * pcp)
        first, last = get_pp_indices(layers, pp_rank, pp)
        ep_rank = dp_rank * pcp * tp + pcp_rank * tp + tp_rank
        held = _experts(parallel, experts, ep_size, ep_rank) if expert_parallel else None
        ranks.append(RankHolding(layers=range(first, last), embeddings=pp_rank == 0, head=pp_rank == pp - 1,
                                 tp_rank=tp_rank, tp_size=tp, experts=held, dp_rank=dp_rank,
                                 dp_size=dp_size if expert_parallel else 1))
    tied = bool(getattr(model_config.hf_text_config, "tie_word_embeddings", False))
    return NodeLayout(node=node, nodes=nodes, ranks=tuple(ranks), layers_total=layers,
                      experts_total=experts, tied_embeddings=tied, vocab_padding=_vocab_padding())


def _vocab_padding() -> int:
    """What vLLM pads a vocabulary to a multiple of before splitting it among tensor-parallel ranks."""
    from vllm.model_executor.layers import vocab_parallel_embedding

    return int(vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE)


def _experts(parallel: Any, experts: int, ep_size: int, ep_rank: int) -> frozenset[int] | None:
    """The experts expert-parallel rank ``ep_rank`` holds, by vLLM's own map; None (every expert)
    where the placement is not vLLM's linear one (load balancing moves experts at run time)."""
    if getattr(parallel, "enable_eplb", False) or getattr(parallel, "expert_placement_strategy", "linear") != "linear":
        return None
    try:
        from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map
    except ImportError:  # a vLLM that keeps it elsewhere: every expert
        return None
    _, expert_map, _ = determine_expert_map(ep_size, ep_rank, experts, "linear")
    if expert_map is None:
        return None
    return frozenset(int(i) for i in (expert_map >= 0).nonzero().flatten().tolist())
