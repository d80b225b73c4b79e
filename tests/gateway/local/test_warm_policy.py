"""Warm wake's policy and files, without an engine: which part of a key a refusal names, what
goes back into an engine and in which order, what a disk budget keeps, a manifest that names a
path outside its directory, and what the key holds of a model file and of the launch flags."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from capyctl_gateway import GatewayConfig
from capyctl_gateway._deployments.warm import Saved, SavedSlot, WarmKey, to_restore, within_budget
from capyctl_gateway._local.warmfiles import InstanceDir, flags_hash, model_identity, prune
from tests.gateway.lifecycle.test_lifecycle import launched, refused

KEY = WarmKey("llamacpp", "b10798-unknown", "10:ab", 4096, 2, "f" * 64)


def slot(n: int, rank: int, size: int = 100) -> SavedSlot:
    return SavedSlot(n, f"slot{n}-x.bin", size // 10, size, rank, 1.0)


@pytest.mark.parametrize(
    ("part", "value", "says"),
    [
        ("model", "11:cd", "saved under another model"),
        ("context", 8192, "saved under another context size"),
        ("salt", "tenant-a", "saved under another cache_salt"),
        ("build", "b10799-unknown", "saved under another engine build"),
        ("slots", 4, "saved under another slot count"),
        ("flags", "0" * 64, "saved under other engine flags"),
    ],
)
def test_a_key_that_differs_in_any_part_refuses_the_restore(
    part: str, value: Any, says: str
) -> None:
    saved = Saved(replace(KEY, **{part: value}), (slot(0, 0),))
    assert to_restore(saved, KEY, 2) == ([], says)
    assert to_restore(Saved(KEY, (slot(0, 0),)), KEY, 2) == ([slot(0, 0)], None)


def test_the_hottest_goes_back_first_and_only_into_slots_the_engine_has() -> None:
    saved = Saved(KEY, (slot(0, 2), slot(1, 0), slot(2, 1)))
    assert [s.slot for s in to_restore(saved, KEY, 2)[0]] == [1, 0]
    assert to_restore(None, KEY, 2) == ([], "nothing saved")


def test_the_budget_drops_the_coldest_and_what_was_just_saved_last() -> None:
    saved = Saved(KEY, (slot(0, 0), slot(1, 1), slot(2, 2)))
    kept, dropped = within_budget(saved, budget=250, others=0)
    assert [s.slot for s in kept.slots] == [0, 1] and [s.slot for s in dropped] == [2]
    kept, dropped = within_budget(saved, budget=250, others=0, keep=[2])  # saved just now
    assert [s.slot for s in dropped] == [1] and kept.size == 200
    kept, dropped = within_budget(saved, budget=200, others=100)  # another instance's share
    assert [s.slot for s in kept.slots] == [0] and len(dropped) == 2
    assert within_budget(saved, budget=10**9, others=0) == (saved, [])


def test_a_manifest_round_trips_and_names_no_path(tmp_path: Path) -> None:
    saved = Saved(KEY, (slot(1, 0), slot(0, 1)))
    assert Saved.decode(saved.encode()) == Saved(KEY, (slot(0, 1), slot(1, 0)))
    doc = json.loads(saved.encode())
    doc["slots"][0]["file"] = "../../gateway.sqlite3"
    with pytest.raises(ValueError, match="not a slot file"):
        Saved.decode(json.dumps(doc).encode())
    for bad in (b"{}", b"[]", b"not json", json.dumps({**doc, "version": 2}).encode()):
        with pytest.raises(ValueError):
            Saved.decode(bad)


def test_a_slot_file_is_restored_only_while_it_is_the_file_recorded(tmp_path: Path) -> None:
    d = InstanceDir(tmp_path / "warm", "Qwen/Qwen3 4B", 0)
    d.open()
    assert d.path == tmp_path / "warm" / "Qwen%2FQwen3%204B" / "0"
    assert all(oct(p.stat().st_mode)[-3:] == "700" for p in (d.path, d.path.parent))
    s = slot(0, 0)
    assert d.problem(s) is not None  # gone
    (d.path / "tmp").write_bytes(b"x" * 100)
    d.place("tmp", s.file, 100)
    assert oct((d.path / s.file).stat().st_mode)[-3:] == "600" and d.problem(s) is None
    (d.path / s.file).write_bytes(b"x" * 99)
    assert "99 bytes" in str(d.problem(s))
    (d.path / s.file).unlink()
    (d.path / s.file).symlink_to(d.path / "elsewhere")
    assert d.problem(s) is not None
    with pytest.raises(OSError, match="wrote 5 bytes"):
        (d.path / "tmp2").write_bytes(b"12345")
        d.place("tmp2", "slot1-y.bin", 6)


def test_a_manifest_past_what_is_read_of_one_is_not_a_manifest(tmp_path: Path) -> None:
    d = InstanceDir(tmp_path, "m", 0)
    d.open()
    doc = json.loads(Saved(KEY, (slot(0, 0),)).encode())
    doc["padding"] = " " * (1 << 20)  # a manifest is a few hundred bytes
    (d.path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError):
        d.load()
    assert d.held() == 0


def test_what_no_manifest_names_is_removed(tmp_path: Path) -> None:
    d = InstanceDir(tmp_path, "m", 0)
    d.open()
    saved = Saved(KEY, (slot(0, 0),))
    d.store(saved)
    for name in ("slot0-x.bin", "tmp-slot1-half.bin", "slot1-old.bin"):
        (d.path / name).write_bytes(b"x")
    assert oct((d.path / "manifest.json").stat().st_mode)[-3:] == "600"
    assert d.tidy(saved) == 2
    assert sorted(p.name for p in d.path.iterdir()) == ["manifest.json", "slot0-x.bin"]
    assert d.load() == saved


def test_a_deployment_gone_from_the_configuration_is_pruned(tmp_path: Path) -> None:
    for name in ("kept", "gone"):
        InstanceDir(tmp_path, name, 0).open()
    assert prune(tmp_path, ["kept"]) == ["gone"]
    assert [p.name for p in tmp_path.iterdir()] == ["kept"]


def test_the_model_identity_follows_the_weights_not_the_path(tmp_path: Path) -> None:
    data = bytearray(os.urandom(4 << 20))
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(data)
    b.write_bytes(data)
    assert model_identity(a) == model_identity(b)
    data[-10] ^= 1  # a weight near the end: within the last sample
    b.write_bytes(data)
    assert model_identity(a) != model_identity(b)


def test_the_flags_hash_leaves_out_what_cannot_change_the_cache() -> None:
    base = ["llama-server", "-m", "/m/a.gguf", "-c", "8192", "--parallel", "2"]
    same = [*base, "-t", "8", "--alias", "x", "--metrics", "--api-key=secret"]
    assert flags_hash(base, {}) == flags_hash(same, {"LLAMA_ARG_THREADS": "4", "HOME": "/x"})
    for changed in (["--rope-freq-base", "50000"], ["-ctk", "q8_0"], ["--lora", "/l.gguf"]):
        assert flags_hash(base, {}) != flags_hash([*base, *changed], {})
    assert flags_hash(base, {}) != flags_hash(base, {"LLAMA_ARG_FLASH_ATTN": "on"})


def test_a_command_that_sets_the_slot_save_path_is_refused_while_the_gateway_keeps_it(
    tmp_path: Path,
) -> None:
    dep = launched(engine="llamacpp", engine_version="b10798", extra=["--slot-save-path=/s"])
    said = refused(tmp_path, {"deployments": [dep]})
    assert "instances.0.launch.command: sets --slot-save-path, where the gateway keeps" in said
    dep["lifecycle"] = {"warm_cache": False}  # the operator's own, then
    GatewayConfig.model_validate({"deployments": [dep]})
    vllm = launched(extra=["--slot-save-path", "/s"])  # not a flag of the gateway's there
    assert not GatewayConfig.model_validate({"deployments": [vllm]}).deployments[0].warms
