"""FastloadConfig validation and sources, and layer-readiness events."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest
import torch

import vllm_fastload
from vllm_fastload import ConfigError, FastloadConfig, LayerEvent, TensorRequest
from vllm_fastload.config import default_threads
from vllm_fastload.config.env import SWITCHES
from vllm_fastload.config.remote import RemoteConfig

from ._util import open_ckpt, random_tensor, save

MiB = 1 << 20


# -- FastloadConfig ---------------------------------------------------------------------------------


def test_defaults():
    c = FastloadConfig()
    assert c.backend == "auto"
    assert c.threads == default_threads()
    assert c.read_size == 8 * MiB
    assert c.aggregate_size == 64 * MiB
    assert c.memory_budget == 1 << 30
    assert c.strided_min_skip is None
    assert c.on_layer_ready == ()
    assert c.progress is True and c.log_layers is False
    assert c.check_file_changes is True and c.hugepages is False
    assert FastloadConfig.build(None) == c == FastloadConfig.build({})


def test_build_from_dict_and_passthrough():
    c = FastloadConfig.build({"backend": "host", "threads": 3, "read_size": "64KiB", "aggregate_size": "1MiB",
                              "memory_budget": "8MiB", "strided_min_skip": "4KiB", "progress": False})
    assert (c.backend, c.threads, c.read_size, c.aggregate_size, c.memory_budget, c.strided_min_skip) == (
        "host", 3, 64 << 10, MiB, 8 * MiB, 4096)
    assert FastloadConfig.build(c) is c
    with pytest.raises(Exception):  # noqa: B017  (pydantic's frozen-instance error)
        c.threads = 4


@pytest.mark.parametrize(("text", "value"), [("64MiB", 64 * MiB), ("64 MiB", 64 * MiB), ("1GiB", 1 << 30),
                                             ("8MB", 8_000_000), ("4096", 4096), (123456, 123456)])
def test_byte_size_strings(text, value: int):
    assert FastloadConfig.build({"strided_min_skip": text}).strided_min_skip == value
    c = FastloadConfig.build({"read_size": text, "aggregate_size": text, "memory_budget": "2GiB"})
    assert c.read_size == c.aggregate_size == value


@pytest.mark.parametrize(("values", "field"), [
    ({"thread": 4}, "thread"),
    ({"threads": 4, "memroy_budget": "1GiB"}, "memroy_budget"),
    ({"threads": 0}, "threads"),
    ({"threads": -2}, "threads"),
    ({"threads": 1000}, "threads"),
    ({"threads": "many"}, "threads"),
    ({"read_size": "abc"}, "read_size"),
    ({"read_size": 100}, "read_size"),
    ({"backend": "gpu"}, "backend"),
    ({"progress": "perhaps"}, "progress"),
    ({"aggregate_size": "600MiB"}, "aggregate_size"),          # > memory_budget / 2 (default 1 GiB)
    ({"aggregate_size": "1MiB", "memory_budget": "1.5MiB"}, "memory_budget"),
    ({"read_size": "2MiB", "aggregate_size": "1MiB"}, "read_size"),
    ({"on_layer_ready": "no_colon_here"}, "on_layer_ready"),
    ({"on_layer_ready": ["mod:"]}, "on_layer_ready"),
    ({"strided_min_skip": "lots"}, "strided_min_skip"),
    ({"cpus": []}, "cpus"),
    ({"cpus": [-1]}, "cpus"),
    ({"cpus": [100000]}, "cpus"),
    ({"early_reads": "sometimes"}, "early_reads"),
])
def test_bad_values_name_the_field(values: dict, field: str):
    with pytest.raises(ConfigError) as info:
        FastloadConfig.build(values)
    assert field in str(info.value)
    assert isinstance(info.value, ValueError)


def test_bad_config_at_open(tmp_path: Path):
    path = save(tmp_path / "m.safetensors", {"a": torch.ones(1)})
    with pytest.raises(ConfigError, match="threads"):
        vllm_fastload.open(path, config={"threads": 0})
    with pytest.raises(ConfigError, match="unknown_knob"):
        vllm_fastload.open(path, config={"unknown_knob": 1})


def test_from_env():
    env = {"FASTLOAD_THREADS": "4", "FASTLOAD_READ_SIZE": "64KiB", "FASTLOAD_AGGREGATE_SIZE": "1MiB",
           "FASTLOAD_MEMORY_BUDGET": "16MiB", "FASTLOAD_PROGRESS": "false", "FASTLOAD_BACKEND": "host",
           "FASTLOAD_STRIDED_MIN_SKIP": "null", "FASTLOAD_CHECK_FILE_CHANGES": "0",
           "FASTLOAD_ON_LAYER_READY": "a.b:c, d:e", "FASTLOAD_TGI": "1", "PATH": "/bin", "XFASTLOAD_FOO": "1"}
    c = FastloadConfig.from_env(env)
    assert (c.threads, c.read_size, c.aggregate_size, c.memory_budget) == (4, 64 << 10, MiB, 16 * MiB)
    assert c.progress is False and c.backend == "host" and c.strided_min_skip is None
    assert c.check_file_changes is False
    assert c.on_layer_ready == ("a.b:c", "d:e")
    assert FastloadConfig.from_env(env, threads=2).threads == 2      # overrides win


def test_early_reads_take_a_mode_or_a_switch():
    assert FastloadConfig.build({}).early_reads == "auto"
    assert FastloadConfig.build({"early_reads": True}).early_reads == "always"
    assert FastloadConfig.build({"early_reads": False}).early_reads == "never"
    assert FastloadConfig.from_env({"FASTLOAD_EARLY_READS": "true"}).early_reads == "always"
    assert FastloadConfig.from_env({"FASTLOAD_EARLY_READS": "never"}).early_reads == "never"
    # any spelling of a switch means on or off
    for on in (1, "1", "yes", "on", "True"):
        assert FastloadConfig.build({"early_reads": on}).early_reads == "always", on
    for off in (0, "0", "no", "off", "False"):
        assert FastloadConfig.build({"early_reads": off}).early_reads == "never", off


def test_from_env_unknown_variable():
    with pytest.raises(ConfigError) as info:
        FastloadConfig.from_env({"FASTLOAD_FOO": "1"})
    message = str(info.value)
    assert "unknown environment variable FASTLOAD_FOO" in message
    for field in FastloadConfig.model_fields:               # the error lists every name fastload reads
        assert f"FASTLOAD_{field.upper()}" in message
    assert "FASTLOAD_TGI" not in message                     # switches are not config


def test_env_switches_and_other_variables_are_not_config():
    switches = {name: "1" for name in SWITCHES}
    assert set(switches) == {"FASTLOAD_TGI"}
    # The scripts', tests' and benchmarks' own variables, whatever they are called under FASTLOAD_DEV_.
    switches.update({"FASTLOAD_DEV_VENV_BASE": "/x", "FASTLOAD_DEV_BENCH_DIR": "/y", "FASTLOAD_DEV_ANYTHING": "1"})
    # Only the capitalised prefix is ours (as before); the field part of the name is case-blind.
    env = {**switches, "fastload_threds": "1", "XFASTLOAD_FOO": "1", "FASTLOAD_Threads": "3"}
    assert FastloadConfig.from_env(env).threads == 3


@pytest.mark.parametrize("name", ["FASTLOAD_THREDS", "FASTLOAD_REMOTE_TIMEOUT_S", "FASTLOAD_THREADS__MAX",
                                  "FASTLOAD_", "FASTLOAD_REMOTE__STORE_OPTIONS__A__B"])
def test_unknown_variable_stops_every_reading_of_the_environment(name: str, monkeypatch):
    monkeypatch.setenv(name, "1")
    for make in (FastloadConfig.from_env, FastloadConfig):
        with pytest.raises(ConfigError, match=f"unknown environment variable {name} "):
            make()
    assert FastloadConfig.build({"threads": 2}).threads == 2    # an explicit config does not read it


def test_unknown_nested_variable_lists_the_nested_names():
    with pytest.raises(ConfigError) as info:
        FastloadConfig.from_env({"FASTLOAD_REMOTE__TIMEOUT": "10"})
    message = str(info.value)
    assert "FASTLOAD_REMOTE__TIMEOUT " in message
    for field in RemoteConfig.model_fields:
        assert f"FASTLOAD_REMOTE__{field.upper()}" in message


def test_environment_under_explicit_arguments(tmp_path: Path, monkeypatch):
    """Arguments win over the environment; a config given whole (a dict or object) does not read it."""
    monkeypatch.setenv("FASTLOAD_THREADS", "3")
    monkeypatch.setenv("FASTLOAD_PROGRESS", "false")
    for make in (FastloadConfig, FastloadConfig.from_env):
        c = make(threads=5)
        assert (c.threads, c.progress) == (5, False)
        assert make().threads == 3
    assert FastloadConfig.from_env({"FASTLOAD_THREADS": "7"}, threads=6).threads == 6
    assert FastloadConfig.from_env({"FASTLOAD_THREADS": "7"}).threads == 7   # the given mapping, not os.environ
    explicit = FastloadConfig.build({"threads": 5})
    assert (explicit.threads, explicit.progress) == (5, True)
    path = save(tmp_path / "m.safetensors", {"a": torch.ones(1)})
    with vllm_fastload.open(path, config={"threads": 4}) as ckpt:
        assert (ckpt.config.threads, ckpt.config.progress) == (4, True)
    with vllm_fastload.open(path) as ckpt:
        assert (ckpt.config.threads, ckpt.config.progress) == (3, False)


def test_nested_remote_fields_from_env():
    c = FastloadConfig.from_env({"FASTLOAD_REMOTE__TIMEOUT_S": "10", "FASTLOAD_REMOTE__REQUEST_SIZE": "16MiB",
                                 "FASTLOAD_REMOTE__ANONYMOUS": "true", "FASTLOAD_REMOTE__ENDPOINT": "http://127.0.0.1:9",
                                 "FASTLOAD_REMOTE__VIRTUAL_HOSTED_STYLE": "null"})
    r = c.remote
    assert (r.timeout_s, r.request_size, r.anonymous, r.endpoint) == (10, 16 * MiB, True, "http://127.0.0.1:9")
    assert r.virtual_hosted_style is None and r.max_in_flight == RemoteConfig().max_in_flight
    # FASTLOAD_REMOTE (JSON) and FASTLOAD_REMOTE__<FIELD> combine, the single field winning; arguments
    # (vLLM's extra config) go on top key by key, so the environment's endpoint survives a tuning override.
    env = {"FASTLOAD_REMOTE": '{"timeout_s": 10, "max_retries": 2, "region": "eu-1"}',
           "FASTLOAD_REMOTE__TIMEOUT_S": "20"}
    r = FastloadConfig.from_env(env, remote={"max_retries": 3}).remote
    assert (r.timeout_s, r.max_retries, r.region) == (20, 3, "eu-1")
    r = FastloadConfig.from_env(env, remote=RemoteConfig(max_retries=4)).remote     # an object replaces
    assert (r.timeout_s, r.max_retries, r.region) == (RemoteConfig().timeout_s, 4, None)
    with pytest.raises(ConfigError, match=r"remote\.timeout_s \(from FASTLOAD_REMOTE__TIMEOUT_S\)"):
        FastloadConfig.from_env({"FASTLOAD_REMOTE__TIMEOUT_S": "-1"})


@pytest.mark.parametrize(("env", "where"), [
    ({"FASTLOAD_THREADS": "0"}, "threads (from FASTLOAD_THREADS)"),
    ({"FASTLOAD_THREADS": "many"}, "threads (from FASTLOAD_THREADS)"),
    ({"FASTLOAD_READ_SIZE": "lots"}, "read_size (from FASTLOAD_READ_SIZE)"),
    ({"FASTLOAD_BACKEND": "gpu"}, "backend (from FASTLOAD_BACKEND)"),
    ({"FASTLOAD_Progress": "perhaps"}, "progress (from FASTLOAD_Progress)"),
    ({"FASTLOAD_ON_LAYER_READY": "no_colon"}, "on_layer_ready (from FASTLOAD_ON_LAYER_READY)"),
    ({"FASTLOAD_REMOTE": '{"timeout_s": -1}'}, "remote.timeout_s (from FASTLOAD_REMOTE)"),
    ({"FASTLOAD_REMOTE": "not json"}, "remote (from FASTLOAD_REMOTE)"),
    ({"FASTLOAD_REMOTE__MAX_IN_FLIGHT": "0"}, "remote.max_in_flight (from FASTLOAD_REMOTE__MAX_IN_FLIGHT)"),
])
def test_from_env_bad_value_names_the_variable(env: dict, where: str):
    with pytest.raises(ConfigError) as info:
        FastloadConfig.from_env(env)
    assert where in str(info.value)


def test_bad_explicit_value_is_not_blamed_on_the_environment():
    with pytest.raises(ConfigError) as info:
        FastloadConfig.from_env({"FASTLOAD_THREADS": "4"}, threads=0)
    assert "threads: " in str(info.value) and "FASTLOAD_THREADS" not in str(info.value)


def test_secrets_from_env_stay_out_of_reprs_and_errors():
    secret = "s3cr3t-v4lue"
    env = {"FASTLOAD_REMOTE__STORE_OPTIONS__AWS_SECRET_ACCESS_KEY": secret,
           "FASTLOAD_REMOTE__STORE_OPTIONS__AWS_ACCESS_KEY_ID": "0123"}
    c = FastloadConfig.from_env(env)
    options = c.remote.store_options
    assert options["aws_secret_access_key"].get_secret_value() == secret
    assert options["aws_access_key_id"].get_secret_value() == "0123"     # text as given, not JSON-decoded
    assert secret not in repr(c) and secret not in str(c) and secret not in str(c.model_dump())
    bad_envs = [
        {**env, "FASTLOAD_THREADS": "0"},
        {**env, "FASTLOAD_REMOTE__TIMEOUT_S": secret},
        {"FASTLOAD_REMOTE": f'{{"store_options": {{"key": "{secret}"}}, "timeout_s": "{secret}"}}'},
        {"FASTLOAD_REMOTE": secret},
        {"FASTLOAD_REMOTE__STORE_OPTIONS": secret},
        {"FASTLOAD_REMOTE__STORE_OPTIONS": f'{{"key": ["{secret}"]}}'},
        {"FASTLOAD_FOO": secret},
    ]
    for bad in bad_envs:
        with pytest.raises(ConfigError) as info:
            FastloadConfig.from_env(bad)
        assert secret not in str(info.value), bad


def test_private_keys_are_unknown_keys(monkeypatch):
    """pydantic-settings reads keyword arguments such as ``_cli_parse_args`` as its own options."""
    monkeypatch.setattr("sys.argv", ["prog", "--threads", "2"])
    for values in ({"_cli_parse_args": True}, {"_env_prefix": "X_"}):
        with pytest.raises(ConfigError, match=f"{next(iter(values))}: Extra inputs are not permitted"):
            FastloadConfig.build(values)
        with pytest.raises(ConfigError, match="Extra inputs are not permitted"):
            FastloadConfig.from_env({}, **values)


def test_open_without_config_reads_the_environment(tmp_path: Path, monkeypatch):
    path = save(tmp_path / "m.safetensors", {"a": torch.ones(1)})
    monkeypatch.setenv("FASTLOAD_THREADS", "3")
    monkeypatch.setenv("FASTLOAD_PROGRESS", "false")
    with vllm_fastload.open(path) as ckpt:
        assert ckpt.config.threads == 3 and ckpt.config.progress is False
    monkeypatch.setenv("FASTLOAD_THREDS", "3")
    with pytest.raises(ConfigError, match="FASTLOAD_THREDS"):
        vllm_fastload.open(path)


def test_gpu_backend_on_cpu_device_is_refused(tmp_path: Path):
    path = save(tmp_path / "m.safetensors", {"a": torch.ones(1)})
    for backend in ("cuda", "kvikio"):  # (the reader's backend is chosen as the checkpoint opens)
        with pytest.raises(ValueError, match=backend):
            open_ckpt(path, {"backend": backend})


# -- layer events -------------------------------------------------------------------------------------


N = 12


@pytest.fixture
def layered(tmp_path: Path) -> Path:
    tensors = {"model.embed_tokens.weight": random_tensor((16, 8), torch.bfloat16, 0),
               "model.norm.weight": random_tensor((8,), torch.bfloat16, 1),
               "lm_head.weight": random_tensor((16, 8), torch.bfloat16, 2)}
    for i in range(N):
        for j, part in enumerate(("q", "k", "mlp")):
            tensors[f"model.layers.{i}.{part}.weight"] = random_tensor((8 + 8 * j, 8), torch.bfloat16, 10 * i + j)
    # Two files, layers interleaved across them.
    names = sorted(tensors)
    save(tmp_path / "model-1.safetensors", {n: tensors[n] for n in names[::2]})
    save(tmp_path / "model-2.safetensors", {n: tensors[n] for n in names[1::2]})
    return tmp_path


def layer_of(key: str):
    from vllm_fastload.layers import layer_key

    return layer_key(key)


@pytest.mark.parametrize("config", [{}, {"aggregate_size": 4096, "read_size": 4096, "memory_budget": 8192,
                                         "threads": 1}])
def test_one_event_per_group_in_order(layered: Path, config: dict):
    events: list[LayerEvent] = []
    with open_ckpt(layered, dict(config, on_layer_ready=events.append)) as ckpt:
        requests = [TensorRequest(n, 0, 0, 4, key=n) if n.endswith("mlp.weight") else n for n in ckpt.keys()]
        plan = ckpt.plan(requests)
        consumed = 0
        for key, _ in ckpt.iter_tensors(requests):
            # The event of the group this item belongs to has not fired yet; all earlier ones have.
            group_index = [g.key for g in plan.groups].index(layer_of(key))
            assert len(events) == group_index
            consumed += 1
    assert consumed == len(plan.tensors)
    assert len(events) == len(plan.groups) == N + 2
    assert [e.layer for e in events] == [None, *range(N), None]
    assert [e.name for e in events] == ["embeddings", *[f"layer {i}" for i in range(N)], "final"]
    assert [e.tensors for e in events] == [len(g.tensors) for g in plan.groups]
    assert [e.bytes for e in events] == [g.read_bytes for g in plan.groups]
    assert [e.layers_done for e in events] == list(range(1, N + 3))
    assert all(e.layers_total == N + 2 and e.bytes_total == plan.read_bytes for e in events)
    running = 0
    for e in events:
        running += e.bytes
        assert e.bytes_done == running
    times = [e.elapsed_s for e in events]
    assert times == sorted(times) and times[0] >= 0


def test_event_fires_only_after_the_next_item_is_requested(layered: Path):
    log: list[tuple[str, int]] = []
    consumed = 0

    def on_ready(event: LayerEvent) -> None:
        log.append((event.name, consumed))

    with open_ckpt(layered, {"on_layer_ready": on_ready}) as ckpt:
        plan = ckpt.plan()
        it = ckpt.iter_tensors()
        for _ in range(len(plan.groups[0].tensors)):
            next(it)
            consumed += 1
        assert log == []          # the caller holds the embedding group's last tensor: not ready yet
        next(it)                  # asks for the item after it
        consumed += 1
        assert log == [("embeddings", len(plan.groups[0].tensors))]
        for _ in it:
            consumed += 1
    cumulative = 0
    for (name, at), group in zip(log, plan.groups):
        cumulative += len(group.tensors)
        assert name == group.key.name
        assert at == cumulative   # every tensor of the group (and those before) had been taken
    assert len(log) == len(plan.groups)


def test_events_from_read_into(layered: Path):
    events: list[LayerEvent] = []
    with open_ckpt(layered, {"on_layer_ready": [events.append]}) as ckpt:
        dests = {n: torch.empty(ckpt.info(n).shape, dtype=torch.bfloat16) for n in ckpt.keys()}
        ckpt.read_into(dests)
        assert [e.layer for e in events] == [None, *range(N), None]


def test_single_tensor_reads_fire_no_events(layered: Path):
    events: list[LayerEvent] = []
    with open_ckpt(layered, {"on_layer_ready": events.append, "strided_min_skip": 1 << 40}) as ckpt:
        ckpt.get_tensor("model.layers.3.q.weight")
        ckpt.get_slice("model.layers.3.q.weight", 0, 1, 2)
        ckpt.get_slice("model.layers.3.q.weight", 1, 1, 2)   # enclosing rows, read then narrowed
    assert events == []


@pytest.fixture
def callback_module(tmp_path: Path, monkeypatch) -> str:
    name = "fastload_test_callbacks"
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / f"{name}.py").write_text(textwrap.dedent("""
        EVENTS = []
        OTHER = []
        NOT_CALLABLE = 42

        def record(event):
            EVENTS.append(event)

        class Sink:
            @staticmethod
            def collect(event):
                OTHER.append(event.layer)
    """))
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    yield name
    import sys

    sys.modules.pop(name, None)


def test_module_function_string_callbacks(layered: Path, callback_module: str):
    import importlib

    spec = f"{callback_module}:record, {callback_module}:Sink.collect"
    with open_ckpt(layered, {"on_layer_ready": spec}) as ckpt:
        for _ in ckpt.iter_tensors():
            pass
    module = importlib.import_module(callback_module)
    assert [e.layer for e in module.EVENTS] == [None, *range(N), None]
    collected = module.OTHER
    assert collected == [None, *range(N), None]


@pytest.mark.parametrize("spec", ["no_such_module_xyz:fn", "{mod}:missing", "{mod}:NOT_CALLABLE", "{mod}:Sink.nope"])
def test_bad_module_function_raises_config_error_at_open(layered: Path, callback_module: str, spec: str):
    """A typo in a callback name stops the load before anything is read: at open()."""
    spec = spec.format(mod=callback_module)
    with pytest.raises(ConfigError) as info:
        open_ckpt(layered, {"on_layer_ready": spec})
    assert spec in str(info.value)


def test_log_layers(layered: Path, caplog):
    with caplog.at_level(logging.DEBUG, logger="vllm_fastload"), open_ckpt(layered, {"log_layers": True}) as ckpt:
        for _ in ckpt.iter_tensors():
            pass
    lines = [r.getMessage() for r in caplog.records if "ready" in r.getMessage()]
    assert len(lines) == N + 2
    assert lines[0].startswith("fastload: embeddings ready") and lines[-1].startswith("fastload: final ready")


def test_progress_bar_goes_to_stderr(layered: Path, capsys):
    with vllm_fastload.open(layered, config={"progress": True}) as ckpt:
        for _ in ckpt.iter_tensors():
            pass
        ckpt.get_tensor("lm_head.weight")   # single reads draw no bar
    err = capsys.readouterr().err
    assert err.count("fastload") >= 1 and f"layers {N + 2}/{N + 2}" in err


def test_the_documented_variables_are_exactly_what_the_config_reads():
    """docs/configuration.md lists every environment variable fastload reads: every field and remote
    field, one store option's prefix and the TGI switch; each field's is a config variable."""
    import re
    from pathlib import Path

    from vllm_fastload.config.env import is_config_variable

    text = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    section = text.split("\n## Environment variables", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(FASTLOAD_[A-Z_]+)(?:<OPTION>)?(?:=1)?`", section))
    fields = {f"FASTLOAD_{f.upper()}" for f in FastloadConfig.model_fields}
    remote = {f"FASTLOAD_REMOTE__{f.upper()}" for f in RemoteConfig.model_fields}
    assert documented == fields | remote | {"FASTLOAD_REMOTE__STORE_OPTIONS__", "FASTLOAD_TGI"}
    assert all(is_config_variable(name) for name in fields | remote)
    assert not is_config_variable("FASTLOAD_TGI") and not is_config_variable("FASTLOAD_DEV_VENV")


def test_stall_timeout_is_validated_and_longer_on_network_filesystems():
    from vllm_fastload import policy
    from vllm_fastload.errors import ConfigError

    assert FastloadConfig.build({}).stall_timeout_s == policy.LOCAL_STALL_TIMEOUT_S
    with pytest.raises(ConfigError, match="stall_timeout_s"):
        FastloadConfig.build({"stall_timeout_s": 0})
    network = policy.filesystem_defaults(network=True, set_fields=set())
    assert FastloadConfig.build({}).model_copy(update=network).stall_timeout_s == policy.NETWORK_STALL_TIMEOUT_S
