"""Crash-safe, verifiable checkpoints on top of torch.distributed.checkpoint (DCP).

The folder's layout is layout.py's; the collectives among an island's ranks are ranks.py's.
A step directory without COMPLETE.json was interrupted mid-save and is never
loaded. COMPLETE.json lists size and SHA-256 of every file DCP wrote, so silent
corruption (bit rot, truncated copies) is detected and the previous checkpoint
is used instead.

DCP unpickles parts of a checkpoint when it loads it (its .metadata file, and non-tensor
values with torch.load(weights_only=False)), so what it reads must be what this island
wrote. With `verify` (the default):

- COMPLETE.json carries an HMAC-SHA256 of its step and file hashes under the island's
  LOCAL checkpoint key (signing.py: random, made on first use, kept outside the folder,
  mode 0600). A checkpoint signed with another key, or not signed, is skipped like a
  corrupt one. The federation secret signs nothing here: every member holds it.
- DCP never reads the folder itself: each rank copies the files it loads into a private
  folder under $TMPDIR, hashing them through the descriptor it copies from, and DCP reads
  only copies whose bytes match the manifest (verified.py; it costs scratch space the size
  of the largest file a rank loads). A file swapped after it was hashed is never read.

With verify=False only sizes are checked and DCP reads the folder: it must be trusted.

Multi-rank runs need ``folder`` on a filesystem every rank of the island can
see: at save the ranks hash each other's files (in parallel, round-robin) and rank 0
writes the manifest; at load rank 0 reads the manifest and checks its signature, and
each rank hashes the files it loads. Only rank 0 uses the key.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from archipelago.checkpoint.layout import (
    COMPLETE_NAME,
    LATEST_NAME,
    is_committed,
    list_files,
    parse_step_dir,
    read_latest_marker,
    read_manifest,
    remove_checkpoint_dir,
    scan_steps,
    step_dir_name,
)
from archipelago.checkpoint.ranks import (
    barrier,
    dist_active,
    failure_in,
    gather,
    on_rank0,
    quiet_single_process,
    short_error,
)
from archipelago.checkpoint.signing import (
    KEY_FILE_ENV,
    CheckpointKeyError,
    default_key_path,
    load_or_create_key,
    manifest_hmac,
)
from archipelago.checkpoint.verified import CorruptCheckpointFile, ScratchError, VerifiedCopyReader, scratch_root
from archipelago.fsutil import sha256_file, write_text_atomic

log = logging.getLogger("archipelago.checkpoint")

_SCRATCH = "scratch: "  # marks a rank's ScratchError among the problems ranks exchange as text
__all__ = ["CheckpointManager", "CheckpointUnusable", "parse_step_dir", "step_dir_name"]

T = TypeVar("T")


class CheckpointUnusable(RuntimeError):
    """Checkpoints exist but none can be used; training from scratch would bury that work."""


class CheckpointManager:
    """Save/load DCP checkpoints with commit markers, verification and pruning.

    Every rank must construct the manager and call `save` / `load_latest`
    collectively (same arguments, same order), like any collective op.

    Args:
        folder: checkpoint root (shared by all ranks).
        keep: number of newest complete checkpoints to retain; <= 0 keeps all.
        rank, world_size: this process's position; must match the process
            group when one is initialized.
        verify: hash every file at save and sign the manifest with the local key;
            at load, require that signature and load only private copies whose hashes
            match (module docstring). Costs one read of the checkpoint at save and, at
            load, one read plus one write to $TMPDIR of the files each rank loads; with
            False only file sizes are checked and the folder must be trusted.
        key_file: the local key file; None: $ARCHIPELAGO_CHECKPOINT_KEY_FILE, else
            ~/.config/archipelago/checkpoint.key (signing.py). Read (or made) by rank 0.
        accept_unsigned: also load checkpoints this key did not sign (none, or another
            key's, such as the federation key older releases signed with), to resume once
            from them. Their hashes are still checked: that proves them intact, not whose.
        scratch_dir: where the private copies go; None: $TMPDIR (else /tmp).
    """

    def __init__(
        self,
        folder: Path,
        keep: int,
        rank: int = 0,
        world_size: int = 1,
        verify: bool = True,
        *,
        key_file: Path | None = None,
        accept_unsigned: bool = False,
        scratch_dir: Path | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.keep = keep
        self.rank = rank
        self.world_size = world_size
        self.verify = verify
        self.key_file = Path(key_file) if key_file is not None else default_key_path()
        self.accept_unsigned = accept_unsigned
        self.scratch_dir = scratch_dir
        self._key: bytes | None = None
        self._key_created = False
        if rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            if self.verify:  # a bad key file stops the run now, not at its first save hours later
                self._key, self._key_created = self._load_key()
        # Newest committed step on disk; updated by save/load so error messages
        # can say "last good checkpoint: <dir>" without touching the disk.
        self.last_saved_step: int | None = self.latest_step()

    # ------------------------------------------------------------------ paths

    def _load_key(self) -> tuple[bytes, bool]:
        folder, key = self.folder.resolve(), self.key_file.expanduser().resolve()
        if key.is_relative_to(folder):
            raise CheckpointKeyError(
                f"the checkpoint key file {self.key_file} is inside the checkpoint folder {self.folder}: whoever "
                f"can write the folder could read or replace it. Point ${KEY_FILE_ENV} elsewhere")
        return load_or_create_key(self.key_file)

    def _signing_key(self) -> bytes:
        if self._key is None:  # loaded in __init__ on rank 0, the only rank that signs or checks
            self._key, self._key_created = self._load_key()
        return self._key

    def step_path(self, step: int) -> Path:
        """Directory that holds (or will hold) the checkpoint of `step`."""
        return self.folder / step_dir_name(step)

    def latest_step(self) -> int | None:
        """Newest committed checkpoint (has COMPLETE.json); hashes not checked.

        Prefers the step named in `latest` (what load_latest tries first) and
        falls back to the highest committed step directory.
        """
        marker = self._read_latest_marker()
        if marker is not None and (self.folder / marker / COMPLETE_NAME).is_file():
            return parse_step_dir(marker)
        complete = [step for step, path in self._scan() if is_committed(path)]
        return max(complete) if complete else None

    def latest_path(self) -> Path | None:
        """Directory of `latest_step()`, or None when there is none."""
        step = self.latest_step()
        return None if step is None else self.step_path(step)

    # ------------------------------------------------------------------- save

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Collectively write `state` as the checkpoint of `step`; returns its dir.

        `state` values must be DCP-compatible: tensors/DTensors, nested dicts
        of them, picklable scalars, or `Stateful` objects. Stateful objects
        must be top-level values: DCP only calls state_dict()/load_state_dict()
        on the top level.
        """
        self._check_process_group()
        path = self.step_path(step)
        started = time.monotonic()
        self._on_rank0(lambda: self._prepare_dir(path), f"preparing {path}")
        with quiet_single_process():
            dcp.save(state, checkpoint_id=path, no_dist=not dist_active())
        # Every rank's shard must be on disk before any rank hashes them.
        barrier()
        names = self._on_rank0(lambda: list_files(path), f"listing {path}") or []
        files = self._hash_files(path, names, with_hash=self.verify)
        nbytes = self._on_rank0(lambda: self._commit(step, path, files), f"committing {path}")
        self.last_saved_step = step
        if self.rank == 0:
            log.info(
                "saved checkpoint %s (%.2f GB in %.1f s)",
                path, (nbytes or 0) / 1e9, time.monotonic() - started,
            )
        return path

    def _prepare_dir(self, path: Path) -> None:
        # A leftover dir for this step (from a crashed or abandoned run) would
        # mix stale shards with new ones, so it is removed first.
        if path.exists():
            log.warning("checkpoint dir %s already exists: replacing it", path)
            remove_checkpoint_dir(path)
        path.mkdir(parents=True, exist_ok=True)

    def _commit(self, step: int, path: Path, files: dict[str, dict[str, Any]]) -> int:
        manifest: dict[str, Any] = {"step": step, "time": time.time(), "files": files}
        if self.verify:  # signs the hashes; a signature over sizes alone would prove little
            manifest["hmac"] = manifest_hmac(self._signing_key(), step, files)
        write_text_atomic(path / COMPLETE_NAME, json.dumps(manifest, indent=1) + "\n")
        write_text_atomic(self.folder / LATEST_NAME, path.name + "\n")
        self._prune(step)
        return sum(int(entry["size"]) for entry in files.values())

    def _hash_files(self, path: Path, names: list[str], with_hash: bool) -> dict[str, dict[str, Any]]:
        """Size and (`with_hash`) SHA-256 of each file, by all ranks in parallel (a collective).

        Rank r reads files r, r + W, r + 2W, ...: hashing costs one read of the
        checkpoint, spread over the island instead of done by rank 0 alone, which at
        large scale would outlast the process-group timeout the other ranks wait under.
        A missing file gets size None.
        """
        share = {}
        for name in names[self.rank::self.world_size]:
            file = path / name
            present = file.is_file()
            share[name] = {"size": file.stat().st_size if present else None,
                           "sha256": sha256_file(file) if present and with_hash else None}
        return {name: entry for part in gather(share) for name, entry in part.items()}

    def _prune(self, current_step: int) -> None:
        """Keep the newest `keep` committed checkpoints up to `current_step`.

        Committed dirs newer than `current_step` belong to an abandoned run
        (e.g. one that was corrupt and skipped at resume); they are left alone
        for inspection and are never preferred over `latest` when loading.
        """
        entries = self._scan()
        committed = sorted(
            (s for s, p in entries if is_committed(p) and s <= current_step), reverse=True
        )
        keep = set(committed if self.keep <= 0 else committed[: self.keep])
        for step, path in entries:
            stale_complete = is_committed(path) and step <= current_step and step not in keep
            stale_partial = not is_committed(path) and step < current_step
            if stale_complete or stale_partial:
                log.info("pruning checkpoint %s", path)
                remove_checkpoint_dir(path)

    # ------------------------------------------------------------------- load

    def load_latest(self, state: dict[str, Any]) -> int | None:
        """Load the newest usable checkpoint into `state` in place.

        Tries the checkpoint named in `latest`, then the other step dirs from
        the highest step down, skipping (with a warning) incomplete, corrupt
        or unloadable ones. Rank 0 verifies and broadcasts its choice so all
        ranks load the same step. Returns the loaded step, or None when no
        checkpoint exists (training starts from scratch).

        Raises CheckpointUnusable when committed checkpoints exist but none
        could be verified and loaded: `state` may be partially overwritten,
        and training "from scratch" in this folder would replace that work.
        A folder holding only incomplete saves (a crash during the first save)
        starts from scratch.
        """
        self._check_process_group()
        candidates = self._candidates() if self.rank == 0 else []
        committed = self._on_rank0(lambda: [str(p) for p in candidates if is_committed(p)],
                                   "listing checkpoints")
        failed: list[str] = []
        while True:
            usable = self._next_usable(candidates)
            if usable is None:
                break
            name, files = usable
            path = self.folder / name
            if self._try_load(path, state, files):
                step = parse_step_dir(name)
                self.last_saved_step = step
                log.info("resumed from checkpoint %s (step %s)", path, step)
                return step
            failed.append(str(path))
        if failed or committed:
            raise CheckpointUnusable(
                f"no usable checkpoint in {self.folder} although {len(committed or [])} were "
                f"written (could not load: {', '.join(failed) or 'none tried'}); see the warnings "
                "above. Fix the cause (e.g. a model or config change), or move the checkpoint "
                "folder away (or use a new --job.run_dir) to start from scratch."
            )
        log.info("no usable checkpoint in %s: training starts from scratch", self.folder)
        return None

    def _try_load(self, path: Path, state: dict[str, Any], files: dict[str, Any]) -> bool:
        """Collectively load `path` into `state`; False (all ranks) when any rank could not.

        Raises ScratchError on every rank when a rank could not make its private copies: that
        is this machine's problem, and skipping to an older checkpoint would not solve it.
        """
        reader = self._open_reader(path, files)
        try:
            problem = self._load(path, state, reader)
        finally:
            if reader is not None:
                reader.close()
        outcomes = gather(problem)
        scratch = next((p for p in outcomes if p and p.startswith(_SCRATCH)), None)
        if scratch is not None:
            raise ScratchError(scratch[len(_SCRATCH):])
        if problem is not None:
            log.warning("%s", problem)
        elif any(outcomes):
            log.warning("checkpoint %s failed to load on another rank: skipped", path)
        return not any(outcomes)

    def _open_reader(self, path: Path, files: dict[str, Any]) -> VerifiedCopyReader | None:
        """The reader DCP loads through (None with verify=False: DCP reads the folder).

        A collective: when any rank cannot make its private folder, every rank raises
        ScratchError, so that no rank is left waiting in DCP's collectives.
        """
        if not self.verify:
            return None
        reader, error = None, None
        try:
            reader = VerifiedCopyReader(path, files, scratch_root(self.scratch_dir))
        except Exception as exc:
            error = f"rank {self.rank}: {exc}"
        errors = [e for e in gather(error) if e]
        if errors:
            if reader is not None:
                reader.close()
            raise ScratchError(errors[0])
        return reader

    def _load(self, path: Path, state: dict[str, Any], reader: VerifiedCopyReader | None) -> str | None:
        """Load through `reader` (or from `path` directly); None, or why it failed."""
        try:
            with quiet_single_process():
                if reader is None:
                    dcp.load(state, checkpoint_id=path, no_dist=not dist_active())
                else:
                    dcp.load(state, storage_reader=reader, no_dist=not dist_active())
            return None
        # CheckpointException derives from BaseException (not Exception) in
        # torch 2.x, so it must be named explicitly.
        except (Exception, CheckpointException) as exc:
            log.debug("full load error for %s", path, exc_info=exc)
            own = reader.failure if reader is not None else None
            scratch = own if isinstance(own, ScratchError) else failure_in(exc, ScratchError)
            if scratch is not None:
                return f"{_SCRATCH}{scratch}"
            corrupt = own if isinstance(own, CorruptCheckpointFile) else failure_in(exc, CorruptCheckpointFile)
            if corrupt is not None:
                return f"corrupt checkpoint {path}: {corrupt}: skipped, using the previous one"
            return f"could not load checkpoint {path}: {short_error(exc)}: skipped, using the previous one"

    def _candidates(self) -> list[Path]:
        ordered: list[Path] = []
        marker = self._read_latest_marker()
        if marker is not None:
            marked = self.folder / marker
            if marked.is_dir() and parse_step_dir(marker) is not None:
                ordered.append(marked)
            else:
                log.warning("%s names %r which is not a checkpoint dir: ignoring it",
                            self.folder / LATEST_NAME, marker)
        for _, path in sorted(self._scan(), reverse=True):
            if path not in ordered:
                ordered.append(path)
        return ordered

    def _next_usable(self, candidates: list[Path]) -> tuple[str, dict[str, Any]] | None:
        """Pop candidates (held by rank 0) until one passes; (dir name, manifest files), or None.

        A collective: rank 0 reads each manifest and checks its signature, all ranks check
        the sizes together. The hashes are checked as the files are copied for loading.
        """
        while True:
            head = self._on_rank0(lambda: self._pop_manifest(candidates), "reading manifests")
            if head is None:
                return None
            name, files, problem = head
            if problem is None:
                actual = self._hash_files(self.folder / name, sorted(files), with_hash=False)
                problem = self._on_rank0(  # called at once: the loop variables cannot change meanwhile
                    lambda: self._compare(self.folder / name, files, actual), "verifying checkpoint")  # noqa: B023
            if problem is None:
                return name, files
            if self.rank == 0:
                log.warning("%s", problem)

    def _pop_manifest(self, candidates: list[Path]) -> tuple[str, dict[str, Any], str | None] | None:
        """(name, manifest files, problem) of the next candidate; None when none is left.

        The manifest is read from one open; every rank then works from this one reading
        (broadcast by `_on_rank0`), so what was checked is what the ranks verify against.
        """
        if not candidates:
            return None
        path = candidates.pop(0)
        try:
            manifest = read_manifest(path)
        except FileNotFoundError:
            return path.name, {}, f"incomplete checkpoint {path} (no {COMPLETE_NAME}): skipped"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return path.name, {}, (f"corrupt checkpoint {path}: {COMPLETE_NAME} unreadable ({exc}): "
                                   "skipped, using the previous one")
        problem = self._signature_problem(path, manifest)
        return path.name, (manifest["files"] if problem is None else {}), problem

    def _signature_problem(self, path: Path, manifest: dict[str, Any]) -> str | None:
        """None when the manifest is signed with this island's key (or need not be), else why not."""
        if not self.verify:
            return None  # sizes only: the folder is trusted
        given, files = manifest.get("hmac"), manifest["files"]
        if given is not None and hmac.compare_digest(
                str(given), manifest_hmac(self._signing_key(), manifest["step"], files)):
            return None
        if self.accept_unsigned:
            log.warning("checkpoint %s is %s: loading it anyway (accept_unsigned); its hashes are still checked",
                        path, "not signed" if given is None else "signed with another key")
            return None
        if given is None:
            return (f"checkpoint {path} is not signed (written by an older release, with checkpoint.verify = "
                    "false, or by someone else): skipped. If you trust it, resume from it once with "
                    "accept_unsigned (checkpoint.accept_unsigned = true)")
        new = " (it was made just now: none existed)" if self._key_created else ""
        return (f"checkpoint {path} is not signed with this island's checkpoint key {self.key_file}{new}: "
                "written with another key (another machine or user, or the federation key of an older "
                "release) or changed since: skipped. If this island wrote it with another key file, point "
                f"${KEY_FILE_ENV} at that file; if an older release wrote it and you trust it, resume from it "
                "once with accept_unsigned (checkpoint.accept_unsigned = true)")

    def _compare(self, path: Path, files: dict[str, Any], actual: dict[str, Any]) -> str | None:
        """None when every file matches its manifest entry, else why not."""
        for rel, expected in files.items():
            problem = self._file_problem(expected, actual[rel])
            if problem is not None:
                return f"corrupt checkpoint {path}: {rel} {problem}: skipped, using the previous one"
        return None

    @staticmethod
    def _file_problem(expected: dict[str, Any], got: dict[str, Any]) -> str | None:
        if got["size"] is None:
            return "is missing"
        if got["size"] != expected.get("size"):
            return f"has size {got['size']}, expected {expected.get('size')} (truncated?)"
        return None

    # ---------------------------------------------------------------- helpers

    def _scan(self) -> list[tuple[int, Path]]:
        return scan_steps(self.folder)

    def _read_latest_marker(self) -> str | None:
        return read_latest_marker(self.folder)

    def _check_process_group(self) -> None:
        if self.world_size > 1 and not dist_active():
            raise RuntimeError(
                f"CheckpointManager(world_size={self.world_size}) needs a torch.distributed "
                "process group: call dist.init_process_group() before save/load_latest"
            )
        if dist_active() and (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world_size):
            raise RuntimeError(
                f"CheckpointManager(rank={self.rank}, world_size={self.world_size}) does not match "
                f"the process group (rank {dist.get_rank()} of {dist.get_world_size()}): "
                "pass dist.get_rank() / dist.get_world_size()"
            )

    def _on_rank0(self, fn: Callable[[], T], what: str) -> T | None:
        return on_rank0(self.rank, fn, what)
