"""The architecture zoo (tests/vllm/zoo.py): every architecture of vLLM's text-generation registry
that transformers can build, at two sizes and two shard sizes, plus quantized checkpoints, loaded
through vLLM's own loader interface by the default loader and by fastload at TP=2 (the settings
users get everywhere; the other reader settings on the smaller size and the quantized ones), and
chosen families at TP=4: every parameter and buffer on every rank must be bit-identical, and a rank
planned per rank must read only what it keeps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .conftest import HERE

#: The first test to ask for a zoo fixture runs every checkpoint on every rank (15-18 minutes on a
#: 2-core machine), past the suite's per-test limit; the rank processes' own limit (``ZOO_TIMEOUT``,
#: 30 minutes) stops a rank that hangs and reports its checkpoints as errors before this one would.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]

sys.path.insert(0, str(HERE))
import registry  # noqa: E402
import zoo  # noqa: E402

SIZES = tuple(registry.SIZES)
ARCHITECTURES = [a for a in registry.architectures() if registry.reason(a) is None]
BUILT = [f"{arch}-{size}" for arch in ARCHITECTURES for size in SIZES]
ALL = [*BUILT, *zoo.QUANTIZED]
#: Checkpoints also loaded with the other reader settings.
READERS = [*(f"{arch}-small" for arch in ARCHITECTURES), *zoo.QUANTIZED]
TP4 = [f"{arch}-large" for arch in zoo.TP4]
DOCS = HERE.parent.parent / "docs" / "model-families.md"

#: Checkpoints fastload reads whole and hands to the model's load_weights, because their loaders
#: compute on what they load -> a fragment of the reason fastload logs. Kept exact both ways: one
#: that starts planning per rank must be taken off this list.
TRANSFORMED = "after checkpoint data was copied into it (a loader that transforms what it loaded)"
COMPUTED = "a tensor computed from checkpoint data"
KNOWN_FALLBACKS: dict[str, str] = {
    f"{arch}-{size}": reason for size in SIZES for arch, reason in {
        # Mamba's A = -exp(A_log): in the parameter's loader, or in the model's load_weights.
        "Mamba2ForCausalLM": TRANSFORMED, "FalconH1ForCausalLM": TRANSFORMED,
        "GraniteMoeHybridForCausalLM": TRANSFORMED,
        "MambaForCausalLM": COMPUTED, "FalconMambaForCausalLM": COMPUTED, "JambaForCausalLM": COMPUTED,
        # the router's correction bias converted to float32 before the copy
        "MiniMaxM2ForCausalLM": COMPUTED,
        # ranks > 0 zero their copy of the row-parallel expert bias (rank 0 is planned)
        "GptOssForCausalLM": COMPUTED,
    }.items()
}


@pytest.fixture(scope="session")
def zoo_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("zoo-checkpoints")
    # The mismatched ones last: they end in errors, after every other checkpoint has loaded.
    return {name: zoo.build(name, root) for name in [*ALL, *zoo.MISMATCHED]}


@pytest.fixture(scope="session")
def zoo_results(zoo_checkpoints, tmp_path_factory) -> dict[str, dict]:
    """One set of TP=2 rank processes loads every checkpoint."""
    out = tmp_path_factory.mktemp("zoo-tp2")
    summary = zoo.run(list(zoo_checkpoints.values()), 2, out,
                      {zoo_checkpoints[name]: zoo.READER_MODES for name in READERS})
    assert sorted(summary) == sorted(zoo_checkpoints)
    return summary


@pytest.fixture(scope="session")
def zoo_run(zoo_results) -> dict[str, dict]:
    """The checkpoints that must load (the mismatched ones left out)."""
    return {name: s for name, s in zoo_results.items() if name not in zoo.MISMATCHED}


@pytest.fixture(scope="session")
def zoo_tp4(zoo_checkpoints, tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("zoo-tp4")
    return zoo.run([zoo_checkpoints[name] for name in TP4], 4, out)


def test_every_registry_architecture_is_built_or_listed_with_its_reason():
    archs = registry.architectures()
    assert len(archs) >= 100, "vLLM's text-generation registry looks truncated"
    assert not set(registry.SKIPPED) - set(archs), "SKIPPED names architectures vLLM no longer has"
    assert not set(zoo.TP4) - set(ARCHITECTURES)
    for arch in archs:
        if arch in ARCHITECTURES:
            assert registry.tiny_config(arch, "small").architectures == [arch]
        else:
            assert registry.reason(arch).strip()
            with pytest.raises(registry.Unsupported):
                registry.tiny_config(arch, "small")


def test_fifty_architectures_are_exact_on_every_rank_at_both_sizes(zoo_run):
    exact = [a for a in ARCHITECTURES
             if all("error" not in zoo_run[f"{a}-{s}"] and all(all(r) for r in zoo_run[f"{a}-{s}"]["exact"].values())
                    for s in SIZES)]
    assert len(exact) >= 50, f"{len(exact)} exact: {exact}"


@pytest.mark.parametrize("name", ALL)
def test_checkpoint_is_bit_exact_on_every_rank(name, zoo_run):
    s = zoo_run[name]
    assert "error" not in s, f"{s.get('error')}\n{s.get('traceback')}"
    wanted = {"fastload", *(zoo.READER_MODES if name in READERS else ())}
    assert set(s["exact"]) == wanted
    for mode, per_rank in s["exact"].items():
        assert all(per_rank), f"{mode}: {s['different'][mode][1]} differs on rank {s['different'][mode][0]}"


@pytest.mark.parametrize("name", ALL)
def test_checkpoint_reads_only_its_share(name, zoo_run):
    s = zoo_run[name]
    assert "error" not in s, s.get("error")
    if name in KNOWN_FALLBACKS:
        assert not all(s["planned"]), f"{name} is planned per rank now: take it off KNOWN_FALLBACKS"
        assert KNOWN_FALLBACKS[name] in s["reason"]
        return
    assert all(s["planned"]), s["reason"]
    worst = max(s["over_read"])
    assert worst <= 0.02, f"a rank read {100 * worst:.1f}% more than it keeps"
    assert max(s["read_share"]) <= 0.7


@pytest.mark.parametrize("name", TP4)
def test_checkpoint_is_bit_exact_on_four_ranks(name, zoo_tp4):
    s = zoo_tp4[name]
    assert "error" not in s, f"{s.get('error')}\n{s.get('traceback')}"
    if not all(s["exact"]["fastload"]):
        rank, param = s["different"]["fastload"]
        pytest.fail(f"{param} differs on rank {rank}")
    if name not in KNOWN_FALLBACKS:
        assert all(s["planned"]) and max(s["over_read"]) <= 0.02


@pytest.mark.parametrize("name", zoo.MISMATCHED)
def test_quantized_checkpoint_that_does_not_match_its_config_is_a_clear_error(name, zoo_results, zoo_checkpoints):
    """vLLM's default loader loads both without an error (a warning for the bf16 weights, nothing
    at all for the missing scales, which stay uninitialised); fastload stops each one, naming the
    tensor or the parameters the checkpoint does not provide."""
    s = zoo_results[name]
    error = s.get("error", "")
    assert "CheckpointError: " in error, f"{name}: {error or 'loaded without an error'}"
    assert str(zoo_checkpoints[name]) in error
    if name == "llama-int8-config-bf16-weights":
        assert "checkpoint dtype BF16 does not match parameter" in error and "(int8)" in error
        assert "tensor 'model.layers." in error
    else:
        assert "Following weights were not initialized from checkpoint" in error and "weight_scale" in error
        assert "do not match its quantization config (compressed-tensors)" in error
    # The default loader ran first in the same process and did not stop: the error is fastload's.
    assert "Traceback" in s["traceback"] and "vllm_fastload" in s["traceback"]


def test_docs_table_is_this_run(zoo_run, zoo_checkpoints, zoo_tp4):
    table = zoo.markdown_table(zoo_run, zoo_checkpoints, zoo_tp4)
    assert table in DOCS.read_text(), f"regenerate the table in {DOCS} from this run:\n{table}"
