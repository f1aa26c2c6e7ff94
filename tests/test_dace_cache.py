"""The DaCe backend's cache of compiled programs (island/backends/dace_cache.py): whoever can
write `data.cache_dir` must not have native code loaded. The checks on files run anywhere;
the backend's own load is tested where DaCe and a C compiler are installed."""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from archipelago.island.backends import backend

PROGRAM = "archipelago_matmul_loops_0123456789ab"


def _built(tmp_path: Path) -> Path:
    """A private build's two library files (stand-ins: any bytes)."""
    from archipelago.island.backends import dace_cache as cache

    built = tmp_path / "built"
    built.mkdir()
    for name in cache.library_names(PROGRAM):
        (built / name).write_bytes(secrets.token_bytes(5000))
    return built


def test_a_signed_build_loads_from_verified_copies_and_any_change_is_refused_naming_the_file(tmp_path):
    from archipelago.island.backends import dace_cache as cache

    key, cached = secrets.token_bytes(32), tmp_path / "cache" / PROGRAM
    built = _built(tmp_path)
    cache.publish(built, cached, PROGRAM, key)
    lib, stub = (cached / "build" / name for name in cache.library_names(PROGRAM))
    private = tmp_path / "private-0"
    private.mkdir()
    assert cache.verified_copies(cached, PROGRAM, key, private) is None
    assert (private / lib.name).read_bytes() == (built / lib.name).read_bytes()
    # A file swapped after its check is never loaded: what is loaded is the private copy.
    lib.write_bytes(b"\x7fELF planted")
    assert (private / lib.name).read_bytes() == (built / lib.name).read_bytes()

    def refused(why: str) -> str:
        fresh = tmp_path / f"private-{secrets.token_hex(4)}"
        fresh.mkdir()
        problem = cache.verified_copies(cached, PROGRAM, key, fresh)
        assert problem is not None and why in problem, problem
        return problem

    assert str(lib) in refused("differs from its signed record")  # another size
    lib.write_bytes((built / lib.name).read_bytes())
    stub.write_bytes(secrets.token_bytes(5000))  # the stub, same size, other bytes
    assert str(stub) in refused("differs from its signed record")
    stub.write_bytes((built / stub.name).read_bytes())
    lib.unlink()
    os.symlink(built / lib.name, lib)  # the right bytes, through a link: a path that could be redirected
    assert str(lib) in refused("cannot be opened")
    lib.unlink()
    assert str(lib) in refused("is missing")
    lib.write_bytes((built / lib.name).read_bytes())
    record = cached / cache.RECORD
    signed = json.loads(record.read_text())
    cache.publish(built, cached, PROGRAM, secrets.token_bytes(32))  # another machine's (or a forger's) key
    assert str(record) in refused("not signed with this island's local key")
    forged = {**signed, "files": {**signed["files"], lib.name: {"size": 11, "sha256": "0" * 64}}}
    record.write_text(json.dumps(forged))  # the entry changed to fit a planted file, the old signature kept
    refused("not signed with this island's local key")
    for garbage in ("[" * 5000, "{}", '{"files": 7}', "\ud800" * 3, json.dumps({**signed, "hmac": "\udc00"})):
        record.write_text(garbage, errors="surrogatepass")
        refused("malformed" if "hmac" not in garbage else "not signed")
    record.unlink()
    assert str(record) in refused("has no signed record")
    assert cache.cached(cached, PROGRAM)
    record.write_text(json.dumps(signed))
    fresh = tmp_path / "private-last"
    fresh.mkdir()
    assert cache.verified_copies(cached, PROGRAM, key, fresh) is None  # the genuine record and files: accepted


def test_the_local_key_may_not_lie_in_the_cache_folder(tmp_path, monkeypatch):
    from archipelago.island.backends import dace_cache as cache

    monkeypatch.setenv("ARCHIPELAGO_CHECKPOINT_KEY_FILE", str(tmp_path / "cache" / "dace" / "key"))
    with pytest.raises(cache.BuildCacheError, match="inside the DaCe cache folder"):
        cache.local_key(tmp_path / "cache" / "dace")


def _needs_dace_and_cc() -> str:
    missing = backend("dace-loops").available()
    if missing:
        pytest.skip(missing)
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("needs a C compiler to build the planted library")
    return cc


@pytest.fixture()
def fresh_backend(tmp_path, monkeypatch):
    """The dace module with no program loaded, its local key in tmp_path (never ~/.config)."""
    from archipelago.island.backends import dace as dace_backend

    monkeypatch.setenv("ARCHIPELAGO_CHECKPOINT_KEY_FILE", str(tmp_path / "key" / "checkpoint.key"))
    monkeypatch.setattr(dace_backend, "_PROGRAMS", {})
    return dace_backend


@pytest.mark.timeout(600)  # two builds of the loops program: 5 s on 2 cores
def test_a_library_planted_in_the_dace_cache_is_never_loaded(fresh_backend, tmp_path, monkeypatch, caplog):
    """The attack: someone who can write data.cache_dir replaces the cached library with their
    own. The base commit's DaCe cache (use_cache) loaded it and ran its constructor."""
    cc = _needs_dace_and_cc()
    import dace

    caplog.set_level(logging.WARNING, logger="archipelago.island")
    where = tmp_path / "cache"
    fresh_backend.load(where, fresh_backend.LOOPS)  # built once, as on the island's first run
    [lib] = (where / "dace").glob("archipelago_matmul_loops_*/build/libarchipelago_matmul_loops_*.so")
    marker = tmp_path / "planted-code-ran"
    source = tmp_path / "planted.c"
    source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) {\n'
                      f'  FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("ran", f); fclose(f); }}\n}}\n')
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp_path / "planted.so"), str(source)], check=True, timeout=60)
    os.replace(tmp_path / "planted.so", lib)
    monkeypatch.setattr(fresh_backend, "_PROGRAMS", {})  # a later run
    failed = None
    try:
        fresh_backend.load(where, fresh_backend.LOOPS)
    except Exception as exc:  # noqa: BLE001 - the base commit's load fails after running the planted code
        failed = exc
    assert not marker.exists(), "the planted library was loaded and its code ran"
    assert failed is None, failed
    assert f"the cached DaCe build file {lib} differs from its signed record" in caplog.text, caplog.text
    assert "building it anew" in caplog.text
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    assert torch.allclose(fresh_backend.matmul(a, b, fresh_backend.LOOPS), a @ b, atol=1e-5)
    # The next run loads the rebuilt, signed files, without building, from private copies.
    caplog.clear()
    monkeypatch.setattr(fresh_backend, "_PROGRAMS", {})

    def no_build(self, *args, **kwargs):
        raise AssertionError("built again although the cache verified")

    monkeypatch.setattr(dace.SDFG, "compile", no_build)
    compiled = fresh_backend.load(where, fresh_backend.LOOPS)
    assert "building it anew" not in caplog.text
    assert not Path(compiled._lib._library_filename).is_relative_to(where)  # a private copy, not the cache's file
    assert torch.allclose(fresh_backend.matmul(a, b, fresh_backend.LOOPS), a @ b, atol=1e-5)


@pytest.mark.timeout(300)
def test_a_lock_file_planted_as_a_symlink_truncates_nothing(fresh_backend, tmp_path, monkeypatch):
    _needs_dace_and_cc()
    import dace

    def no_compiler(self, *args, **kwargs):  # the lock is taken before the build: no build needed here
        raise RuntimeError("no compiler in this test")

    monkeypatch.setattr(dace.SDFG, "compile", no_compiler)
    where = tmp_path / "cache"
    with pytest.raises(ValueError, match="did not build"):
        fresh_backend.load(where, fresh_backend.LOOPS)
    [lock] = (where / "dace").glob("matmul-loops-*.lock")
    victim = tmp_path / "victim"
    victim.write_text("a file of the user's")
    lock.unlink()
    os.symlink(victim, lock)
    with pytest.raises(ValueError):
        fresh_backend.load(where, fresh_backend.LOOPS)
    assert victim.read_text() == "a file of the user's", "opening the planted lock truncated the file it points at"
