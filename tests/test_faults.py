"""Faults injected into the store and the CLI: corrupt and cut files, kill -9 at points of a repack, a full disk
(a file-size limit), folders --force must not delete, malformed manifests and settings. Each gives a one-line
error naming the culprit, or is survived: a rerun resumes or restarts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import sluice
from sluice.cli import main
from sluice.errors import CheckpointError, StoreError
from tiny import make_tiny_checkpoint
from sluice.storage.home import resolve_store
from sluice.storage.repack import repack
from sluice.storage.store import ExpertStore
from sluice.storage.verify import verify


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("faults") / "ckpt", "qwen3_moe", seed=3)


@pytest.fixture
def store(ckpt, tmp_path):
    return repack(ckpt, tmp_path / "store", progress=False).path


def _one_line_error(capsys, *parts: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("sluice: error:") and err.count("\n") == 1, err
    for p in parts:
        assert p in err, err
    return err


# -- --force deletes only a store -----------------------------------------------------------------------------

def test_force_refuses_a_folder_of_user_files_and_the_source(ckpt, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    assert main(["repack", str(ckpt), str(mine), "--force"]) == 1
    _one_line_error(capsys, str(mine), "not part of a Sluice store")
    assert (mine / "thesis.tex").read_text() == "years of work"
    before = sorted(p.name for p in ckpt.iterdir())
    for target in (ckpt, ckpt.parent):
        assert main(["repack", str(ckpt), str(target), "--force"]) == 1
        _one_line_error(capsys, "source checkpoint")
    assert sorted(p.name for p in ckpt.iterdir()) == before


def test_force_replaces_a_store_an_empty_folder_and_a_store_without_manifest(ckpt, store, tmp_path):
    (store / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json is missing"):  # not "no *.safetensors files"
        sluice.load(store, device="cpu")
    assert repack(ckpt, store, force=True, progress=False).total_blocks > 0
    empty = tmp_path / "empty"
    empty.mkdir()
    assert repack(ckpt, empty, force=True, progress=False).total_blocks > 0


# -- kill -9 and a full disk during a repack ------------------------------------------------------------------

KILLER = """
import os, signal, sys
from sluice.storage import repack as r
point, n = sys.argv[3], int(sys.argv[4])
calls = [0]
def dying(real):
    def f(*a, **k):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **k)
    return f
if point == "block":
    r.build_block = dying(r.build_block)
elif point == "json":
    r._write_json = dying(r._write_json)
elif point == "swap":
    r._swap_into_place = dying(r._swap_into_place)
else:
    r.write_file = dying(r.write_file)
r.repack(sys.argv[1], sys.argv[2], progress=False)
"""


@pytest.mark.parametrize("point,n", [("json", 1), ("block", 3), ("block", 20), ("json", 3), ("resident", 1),
                                      ("swap", 1)])
def test_a_repack_killed_anywhere_is_resumed_or_restarted(ckpt, tmp_path, point, n):
    """Killed before progress.json exists, inside the first and the second MoE layer, after a layer, while writing
    the resident file, between the manifest and the rename: a rerun finishes a good store,
    without --force, and so does the server's automatic repack into SLUICE_HOME."""
    target = tmp_path / "store"
    p = subprocess.run([sys.executable, "-c", KILLER, str(ckpt), str(target), point, str(n)], capture_output=True, text=True)
    assert p.returncode == -9, p.stderr
    assert (tmp_path / "store.partial").exists() and not target.exists()
    assert repack(ckpt, target, progress=False).total_blocks > 0
    assert verify(target, progress=False) == []
    assert not (tmp_path / "store.partial").exists()


def test_the_automatic_repack_resumes_after_a_kill(ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    script = KILLER.replace("r.repack(sys.argv[1], sys.argv[2], progress=False)",
                            "from sluice.storage.home import resolve_store; resolve_store(sys.argv[1], progress=False)")
    env = {**os.environ, "SLUICE_HOME": str(tmp_path / "home")}
    p = subprocess.run([sys.executable, "-c", script, str(ckpt), "-", "block", "3"], capture_output=True, text=True, env=env)
    assert p.returncode == -9, p.stderr
    assert list((tmp_path / "home" / "stores").glob("*.partial"))
    assert ExpertStore.open(resolve_store(ckpt, progress=False)).total_blocks > 0


FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), int(sys.argv[3])))
from sluice.cli import main
sys.exit(main(["repack", sys.argv[1], sys.argv[2]]))
"""


def test_a_full_disk_is_one_line_and_the_rerun_finishes(ckpt, store, tmp_path):
    target = tmp_path / "again"
    layer = ExpertStore.open(store).file(ExpertStore.open(store).moe_layers[0]).stat().st_size
    p = subprocess.run([sys.executable, "-c", FULL_DISK, str(ckpt), str(target), str(layer // 2)], capture_output=True, text=True)
    assert p.returncode == 1, p.stderr
    err = p.stderr.strip().splitlines()[-1]
    assert err.startswith("sluice: error:") and "File too large" in err and "Traceback" not in p.stderr, p.stderr
    assert repack(ckpt, target, progress=False).total_blocks > 0
    assert verify(target, progress=False) == []


# -- a damaged store ----------------------------------------------------------------------------------------

def _flip(path, at: int, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    for i in range(at, at + n):
        data[i] ^= 0xFF
    path.write_bytes(data)


def test_a_changed_resident_file_is_caught_at_load_and_named(store):
    resident = store / "resident.safetensors"
    _flip(resident, resident.stat().st_size - 200)  # tensor bytes, not the header
    with pytest.raises(StoreError, match="resident.safetensors: checksum mismatch"):
        sluice.load(store, device="cpu")
    sluice.load(store, device="cpu", verify_checksums=False).close()  # --no-verify: the documented trade
    assert any("resident.safetensors: checksum mismatch" in p for p in verify(store, progress=False))


@pytest.mark.parametrize("damage", ["truncate", "garble"])
def test_a_cut_or_garbled_resident_file_is_named_without_verification(store, damage):
    resident = store / "resident.safetensors"
    if damage == "truncate":
        os.truncate(resident, resident.stat().st_size // 2)
    else:
        _flip(resident, 0, 16)  # the header's length and first bytes
    with pytest.raises(StoreError, match="resident.safetensors: unreadable"):
        sluice.load(store, device="cpu", verify_checksums=False)


def _edit_manifest(store, edit) -> None:
    mf = store / "manifest.json"
    m = json.loads(mf.read_text())
    mf.write_text(json.dumps(edit(m)))


@pytest.mark.parametrize("edit,match", [
    (lambda m: [m], "a JSON list, not an object"),
    (lambda m: {**m, "num_experts": "32"}, "num_experts must be an integer"),
    (lambda m: {**m, "tensors": [{**m["tensors"][0], "offset": -4096}, *m["tensors"][1:]]}, "offset must be an integer >= 0"),
    (lambda m: {**m, "layers": [{**m["layers"][0], "file": "../../etc/passwd"}, *m["layers"][1:]]}, "a path inside the store"),
])
def test_malformed_manifests_are_named_in_one_short_line(store, capsys, edit, match):
    _edit_manifest(store, edit)
    with pytest.raises(StoreError, match=match) as e:
        ExpertStore.open(store)
    assert len(str(e.value)) < 300 and "\n" not in str(e.value)
    assert main(["verify", str(store)]) == 1
    _one_line_error(capsys, "manifest.json")


def test_a_deleted_config_is_named(store):
    (store / "config.json").unlink()
    with pytest.raises(StoreError, match="config.json is missing"):
        sluice.load(store, device="cpu")


# -- bad settings ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,named", [
    (["generate", "--prompt", "x", "--seed", str(2**64)], "--seed"),
    (["generate", "--prompt", "x", "--max-new-tokens", "-1"], "--max-new-tokens"),
    (["generate", "--prompt", "x", "--trace", "/no/such/folder/t.json"], "--trace"),
    (["generate", "--prompt", "x", "--record-routing", "/no/such/folder/r.jsonl"], "--record-routing"),
    (["serve", "--port", "99999"], "--port"),
    (["serve", "--context", "-1"], "--context"),
    (["synth", "out", "--shape", "qwen3-30b-a3b", "--moe-layers", "-1"], "--moe-layers"),
])
def test_bad_settings_are_refused_before_anything_runs(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and named in err.splitlines()[-1]


def test_an_unexpected_error_is_one_line_unless_debug(monkeypatch, capsys):
    import sluice.cli as cli

    def boom(args):
        raise RuntimeError("first line\nsecond line")

    monkeypatch.setattr(cli, "cmd_verify", boom)
    assert main(["verify", "x"]) == 1
    _one_line_error(capsys, "RuntimeError: first line", "--debug")
    with pytest.raises(RuntimeError):
        main(["verify", "x", "--debug"])


def test_a_prompt_over_the_context_is_warned_about(store, capsys):
    assert main(["generate", "--model", str(store), "--device", "cpu", "--prompt", "a b " * 600, "--max-new-tokens", "1"]) == 0
    assert "exceed the model's context" in capsys.readouterr().err
