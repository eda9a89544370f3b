"""Loading one rank of a model, for any engine whose layers slice with their own weight loaders.

What the engine adapters (``vllm_plugin``, ``sglang_plugin``) share, knowing neither engine:

- ``probe``: run the model's ``load_weights`` on placeholders and record every write, so the
  engine's own code says which bytes of which checkpoint tensor land where on this rank;
- ``geometry`` and ``reads``: from those writes to the fewest bytes to read, and back;
- ``rank``: open, probe, plan, read (layer events, progress bar, row exchange at TP>1), replay,
  or read everything whole through ``load_weights`` where the probe cannot describe the model;
- ``report``: what a rank's load did (``LoadReport``), which every adapter logs and keeps;
- ``early``: read the checkpoint into the page cache while the engine starts; ``node_share``: on a
  start that spans nodes, the byte ranges one node's ranks hold, which is what it reads early.

What differs between engines (the model's construction, the distributed groups, the completeness
check, the default loader to fall back to) is passed in by the adapter.
"""
