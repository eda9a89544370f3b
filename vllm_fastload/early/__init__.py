"""Early reads: read the checkpoint into the page cache while the engine starts, not when a rank
asks for it.

An engine's start spends tens of seconds (imports, processes, distributed set-up, the model's
construction) before any rank loads weights; meanwhile the disk sits idle. The process that parses
the engine's arguments knows the checkpoint long before that, though not the per-rank plan. By job:

- ``decide``: whether and what to read, from the engine's start (``EarlyStart``), and the start of it;
- ``node_share``: on a start that spans nodes, the byte ranges one node's ranks hold;
- ``process``: the reading process, as the starting process sees it (started, relayed, ended);
- ``child``: the reading process itself, a bare interpreter (``python -I -S``) running standard
  library code only;
- ``marks``: how the ranks' loads tell the reading process that they began and ended.

The engine adapters reach it through ``vllm_fastload.model``. This package's own import is empty,
so that the reading process imports only the standard-library modules it runs.
"""
