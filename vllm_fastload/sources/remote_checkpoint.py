"""A checkpoint in an object store: which objects it is made of, and their safetensors headers.

The rules are a local directory's (``checkpoint``): one ``.safetensors`` object, the objects an
index names, or every ``*.safetensors`` below a prefix; HTTP servers, which cannot list, by name.
Each header arrives in one GET that also pins its object (``object_store.Store.open_with_prefix``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vllm_fastload.errors import MissingFileError
from vllm_fastload.format import INDEX_NAME, SafetensorsFile, header_length, parse_file, parse_weight_map
from vllm_fastload.frozen import FrozenMap
from vllm_fastload.sizes import ceil_div
from vllm_fastload.sources.object_store import Store
from vllm_fastload.sources.uri import ObjectURI


def read_safetensors_header(store: Store, key: str) -> SafetensorsFile:
    """Open ``key`` and parse its header: one GET of ``header_prefetch`` bytes, a second only if the
    header is longer. The object is pinned by the first response's size and ETag."""
    return store.run(_read_header(store, key), uri=store.uri_of(key), rounds=3)


async def _read_header(store: Store, key: str) -> SafetensorsFile:
    source, head = await store.open_with_prefix(key, int(store.config.header_prefetch))
    n = header_length(source.uri, head, source.size)
    raw = bytes(head[8:8 + n])
    if len(raw) < n:
        rest, _ = await store.get_range(key, 8 + len(raw), 8 + n, pinned=source.info)
        raw += bytes(rest)
    return parse_file(source, raw)


def read_safetensors_headers(store: Store, keys: Sequence[str]) -> list[SafetensorsFile]:
    """Headers of many objects, requested concurrently (a 100-shard checkpoint opens in ~one round trip)."""

    async def all_headers() -> list[SafetensorsFile]:
        results = await asyncio.gather(*(_read_header(store, k) for k in keys), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return [r for r in results if not isinstance(r, BaseException)]

    rounds = 3 * ceil_div(len(keys), store.in_flight)
    return store.run(all_headers(), uri=store.root.uri, rounds=max(rounds, 1))


@dataclass(frozen=True)
class RemoteLayout:
    """What ``discover`` found: the shards to open and, if there is one, the index's weight map."""

    root: ObjectURI
    keys: tuple[str, ...]
    index_key: str | None = None
    weight_map: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        if self.weight_map is not None:
            object.__setattr__(self, "weight_map", FrozenMap(self.weight_map))


def discover(store: Store, root: ObjectURI) -> RemoteLayout:
    """The objects of the checkpoint at ``root``, by the same rules as a local directory.

    ``.../x.safetensors`` is one object; a prefix with ``model.safetensors.index.json`` (or
    exactly one ``*.safetensors.index.json``) is the files its weight map names; otherwise every
    ``*.safetensors`` directly below the prefix. HTTP servers cannot list: there the index (or
    ``model.safetensors``) is fetched by name.
    """
    return store.run(_discover(store, root), uri=root.uri, rounds=3)


async def _discover(store: Store, root: ObjectURI) -> RemoteLayout:
    if root.key.endswith(".safetensors"):
        return RemoteLayout(root, (root.key,))
    if root.family == "http":
        return await _discover_unlisted(store, root)
    # The usual index is asked for together with the listing: one round trip fewer to open.
    listing, usual = await asyncio.gather(store.list_dir(root.key + "/" if root.key else ""),
                                          _from_index(store, root, INDEX_NAME), return_exceptions=True)
    if isinstance(listing, BaseException):
        raise listing
    names = {o.key.rsplit("/", 1)[-1]: o for o in listing}
    index = INDEX_NAME if INDEX_NAME in names else None
    if index is None:
        indexes = sorted(n for n in names if n.endswith(".safetensors.index.json"))
        index = indexes[0] if len(indexes) == 1 else None
    if index is not None:
        # The answer for the usual index counts only if the listing has it (then its error too).
        layout = await _from_index(store, root, index) if index != INDEX_NAME else usual
        if isinstance(layout, BaseException):
            raise layout
        _check_listed(store, root, index, layout, {o.key for o in listing})
        return layout
    shards = sorted(n for n in names if n.endswith(".safetensors"))
    if not shards:
        raise MissingFileError("no *.safetensors objects below this prefix", file=root.uri)
    return RemoteLayout(root, tuple(root.child(n).key for n in shards))


def _check_listed(store: Store, root: ObjectURI, index: str, layout: RemoteLayout, listed: set[str]) -> None:
    """Every object the index names is in the listing (only direct children are listed; an
    object further down is checked when it is opened)."""
    for key in layout.keys:
        if key not in listed and "/" not in key.removeprefix(root.child("").key):
            example = next(t for t, f in (layout.weight_map or {}).items() if root.child(f).key == key)
            raise MissingFileError(f"index {index} maps tensors to this object but it does not exist",
                                   file=store.uri_of(key), tensor=example)


async def _from_index(store: Store, root: ObjectURI, index: str) -> RemoteLayout:
    key = root.child(index).key
    weight_map = parse_weight_map(store.uri_of(key), await store.get_all(key))
    files = list(dict.fromkeys(weight_map.values()))
    return RemoteLayout(root, tuple(root.child(f).key for f in files), key, weight_map)


async def _discover_unlisted(store: Store, root: ObjectURI) -> RemoteLayout:
    try:
        return await _from_index(store, root, INDEX_NAME)
    except MissingFileError:
        pass
    single = root.child("model.safetensors")
    try:
        await store.head(single.key)
    except MissingFileError:
        raise MissingFileError(f"neither {INDEX_NAME} nor model.safetensors below this URL (an HTTP server "
                               "cannot be listed: name a .safetensors object or provide an index)",
                               file=root.uri) from None
    return RemoteLayout(root, (single.key,))
