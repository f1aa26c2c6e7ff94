"""Crash-safe, verifiable checkpoints on top of torch.distributed.checkpoint (DCP).

Layout of ``folder``::

    folder/
      latest                  # text: name of the newest committed step dir
      step-00000100/
        .metadata             # written by DCP (coordinator rank)
        __0_0.distcp ...      # written by DCP, one or more per rank
        COMPLETE.json         # written LAST by rank 0: commit marker + manifest

A step directory without COMPLETE.json was interrupted mid-save and is never
loaded. COMPLETE.json lists size and SHA-256 of every file DCP wrote, so silent
corruption (bit rot, truncated copies) is detected and the previous checkpoint
is used instead.

DCP unpickles parts of a checkpoint when it loads it (its .metadata file, and non-tensor
values with torch.load(weights_only=False)), so a checkpoint directory must be trusted.
With a `manifest_key` (derived from the federation key) COMPLETE.json carries an
HMAC-SHA256 of its step and file hashes, checked before DCP opens any file: a checkpoint
someone without the key changed or planted is skipped like a corrupt one.

Multi-rank runs need ``folder`` on a filesystem every rank of the island can
see: the ranks hash each other's files (in parallel, round-robin) and rank 0
writes the manifest.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from archipelago.fsutil import sha256_file, write_text_atomic

log = logging.getLogger("archipelago.checkpoint")

COMPLETE_NAME = "COMPLETE.json"
LATEST_NAME = "latest"
_STEP_DIR_RE = re.compile(r"^step-(\d+)$")

T = TypeVar("T")


class CheckpointUnusable(RuntimeError):
    """Checkpoints exist but none can be used; training from scratch would bury that work."""


def step_dir_name(step: int) -> str:
    """Directory name for `step`; zero-padded so names sort like steps."""
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """Step number encoded in a directory name, or None if it is not one."""
    match = _STEP_DIR_RE.match(name)
    return int(match.group(1)) if match else None


def _dist_active() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _dist_active():
        dist.barrier()


def _broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (identity without a process group)."""
    if not _dist_active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Silence DCP's "assuming ... single process" UserWarning when that is intended."""
    with warnings.catch_warnings():
        if not _dist_active():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _short_error(exc: BaseException) -> str:
    """One line for a warning: DCP's CheckpointException embeds whole tracebacks."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def _all_ranks_true(flag: bool) -> bool:
    if not _dist_active():
        return flag
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, flag)
    return all(flags)


class CheckpointManager:
    """Save/load DCP checkpoints with commit markers, verification and pruning.

    Every rank must construct the manager and call `save` / `load_latest`
    collectively (same arguments, same order), like any collective op.

    Args:
        folder: checkpoint root (shared by all ranks).
        keep: number of newest complete checkpoints to retain; <= 0 keeps all.
        rank, world_size: this process's position; must match the process
            group when one is initialized.
        verify: hash every file at save and check the hashes at load. Costs
            one extra read of the whole checkpoint each time (~1-2 GB/s);
            with False only file sizes are checked.
        manifest_key: sign the manifest, and load only checkpoints whose manifest
            carries a valid signature (hashing is then always on).
    """

    def __init__(
        self,
        folder: Path,
        keep: int,
        rank: int = 0,
        world_size: int = 1,
        verify: bool = True,
        manifest_key: bytes | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.keep = keep
        self.rank = rank
        self.world_size = world_size
        self.manifest_key = manifest_key
        self.verify = verify or manifest_key is not None  # a signature over sizes alone proves little
        if rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
        # Newest committed step on disk; updated by save/load so error messages
        # can say "last good checkpoint: <dir>" without touching the disk.
        self.last_saved_step: int | None = self.latest_step()

    # ------------------------------------------------------------------ paths

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
        complete = [step for step, path in self._scan() if _is_committed(path)]
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
        with _quiet_single_process():
            dcp.save(state, checkpoint_id=path, no_dist=not _dist_active())
        # Every rank's shard must be on disk before any rank hashes them.
        _barrier()
        names = self._on_rank0(lambda: self._list_files(path), f"listing {path}") or []
        files = self._hash_files(path, names)
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
            _remove_checkpoint_dir(path)
        path.mkdir(parents=True, exist_ok=True)

    def _commit(self, step: int, path: Path, files: dict[str, dict[str, Any]]) -> int:
        manifest: dict[str, Any] = {"step": step, "time": time.time(), "files": files}
        if self.manifest_key is not None:
            manifest["hmac"] = _manifest_hmac(self.manifest_key, step, files)
        write_text_atomic(path / COMPLETE_NAME, json.dumps(manifest, indent=1) + "\n")
        write_text_atomic(self.folder / LATEST_NAME, path.name + "\n")
        self._prune(step)
        return sum(int(entry["size"]) for entry in files.values())

    @staticmethod
    def _list_files(path: Path) -> list[str]:
        """The files DCP wrote into `path`, as sorted relative names."""
        return sorted(p.relative_to(path).as_posix() for p in path.rglob("*")
                      if p.is_file() and p.name != COMPLETE_NAME and not p.name.endswith(".tmp"))

    def _hash_files(self, path: Path, names: list[str]) -> dict[str, dict[str, Any]]:
        """Size and SHA-256 of each file, hashed by all ranks in parallel (a collective).

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
                           "sha256": sha256_file(file) if present and self.verify else None}
        if not _dist_active():
            return share
        shares: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(shares, share)
        return {name: entry for part in shares for name, entry in part.items()}

    def _prune(self, current_step: int) -> None:
        """Keep the newest `keep` committed checkpoints up to `current_step`.

        Committed dirs newer than `current_step` belong to an abandoned run
        (e.g. one that was corrupt and skipped at resume); they are left alone
        for inspection and are never preferred over `latest` when loading.
        """
        entries = self._scan()
        committed = sorted(
            (s for s, p in entries if _is_committed(p) and s <= current_step), reverse=True
        )
        keep = set(committed if self.keep <= 0 else committed[: self.keep])
        for step, path in entries:
            stale_complete = _is_committed(path) and step <= current_step and step not in keep
            stale_partial = not _is_committed(path) and step < current_step
            if stale_complete or stale_partial:
                log.info("pruning checkpoint %s", path)
                _remove_checkpoint_dir(path)

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
        committed = self._on_rank0(lambda: [str(p) for p in candidates if _is_committed(p)],
                                   "listing checkpoints")
        failed: list[str] = []
        while True:
            name = self._next_usable(candidates)
            if name is None:
                break
            path = self.folder / name
            if self._try_load(path, state):
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

    def _try_load(self, path: Path, state: dict[str, Any]) -> bool:
        try:
            with _quiet_single_process():
                dcp.load(state, checkpoint_id=path, no_dist=not _dist_active())
            ok = True
        # CheckpointException derives from BaseException (not Exception) in
        # torch 2.x, so it must be named explicitly.
        except (Exception, CheckpointException) as exc:
            log.warning(
                "could not load checkpoint %s: %s: skipped, using the previous one",
                path, _short_error(exc),
            )
            log.debug("full load error for %s", path, exc_info=exc)
            ok = False
        everyone_ok = _all_ranks_true(ok)
        if ok and not everyone_ok:
            log.warning("checkpoint %s failed to load on another rank: skipped", path)
        return everyone_ok

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

    def _next_usable(self, candidates: list[Path]) -> str | None:
        """Pop candidates (held by rank 0) until one verifies; its dir name, or None.

        A collective: rank 0 reads each manifest, all ranks hash its files together.
        """
        while True:
            head = self._on_rank0(lambda: self._pop_manifest(candidates), "reading manifests")
            if head is None:
                return None
            name, files, problem = head
            if problem is None:
                actual = self._hash_files(self.folder / name, sorted(files))
                problem = self._on_rank0(  # called at once: the loop variables cannot change meanwhile
                    lambda: self._compare(self.folder / name, files, actual), "verifying checkpoint")  # noqa: B023
            if problem is None:
                return name
            if self.rank == 0:
                log.warning("%s", problem)

    def _pop_manifest(self, candidates: list[Path]) -> tuple[str, dict[str, Any], str | None] | None:
        """(name, manifest files, problem) of the next candidate; None when none is left."""
        if not candidates:
            return None
        path = candidates.pop(0)
        complete = path / COMPLETE_NAME
        if not complete.is_file():
            return path.name, {}, f"incomplete checkpoint {path} (no {COMPLETE_NAME}): skipped"
        try:
            manifest = json.loads(complete.read_text(encoding="utf-8"))
            files = dict(manifest["files"])
            signed = self.manifest_key is None or hmac.compare_digest(
                str(manifest.get("hmac", "")), _manifest_hmac(self.manifest_key, manifest["step"], files))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return path.name, {}, (f"corrupt checkpoint {path}: {COMPLETE_NAME} unreadable ({exc}): "
                                   "skipped, using the previous one")
        if not signed:
            return path.name, {}, (f"checkpoint {path} is not signed with this federation's key (written "
                                   "without it, with another key, or changed since): skipped")
        return path.name, files, None

    def _compare(self, path: Path, files: dict[str, Any], actual: dict[str, Any]) -> str | None:
        """None when every file matches its manifest entry, else why not."""
        for rel, expected in files.items():
            problem = self._file_problem(expected, actual[rel])
            if problem is not None:
                return f"corrupt checkpoint {path}: {rel} {problem}: skipped, using the previous one"
        return None

    def _file_problem(self, expected: dict[str, Any], got: dict[str, Any]) -> str | None:
        if got["size"] is None:
            return "is missing"
        if got["size"] != expected.get("size"):
            return f"has size {got['size']}, expected {expected.get('size')} (truncated?)"
        want = expected.get("sha256")
        if self.verify and want and got["sha256"] != want:
            return f"sha256 mismatch (expected {want[:12]}..., got {got['sha256'][:12]}...)"
        return None

    # ---------------------------------------------------------------- helpers

    def _scan(self) -> list[tuple[int, Path]]:
        if not self.folder.is_dir():
            return []
        found = []
        for child in self.folder.iterdir():
            step = parse_step_dir(child.name)
            if step is not None and child.is_dir():
                found.append((step, child))
        return sorted(found)

    def _read_latest_marker(self) -> str | None:
        try:
            text = (self.folder / LATEST_NAME).read_text(encoding="utf-8").strip()
        except OSError:
            return None
        return text or None

    def _check_process_group(self) -> None:
        if self.world_size > 1 and not _dist_active():
            raise RuntimeError(
                f"CheckpointManager(world_size={self.world_size}) needs a torch.distributed "
                "process group: call dist.init_process_group() before save/load_latest"
            )
        if _dist_active() and (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world_size):
            raise RuntimeError(
                f"CheckpointManager(rank={self.rank}, world_size={self.world_size}) does not match "
                f"the process group (rank {dist.get_rank()} of {dist.get_world_size()}): "
                "pass dist.get_rank() / dist.get_world_size()"
            )

    def _on_rank0(self, fn: Callable[[], T], what: str) -> T | None:
        """Run `fn` on rank 0 only and share its result (or failure) with all ranks.

        Without this, an exception on rank 0 (disk full, permissions) would
        leave the other ranks blocked forever in the next collective.
        """
        result: T | None = None
        failure: Exception | None = None
        if self.rank == 0:
            try:
                result = fn()
            except Exception as exc:
                failure = exc
        error = None if failure is None else f"{type(failure).__name__}: {failure}"
        result, error = _broadcast_from_rank0((result, error))
        if failure is not None:
            raise failure
        if error is not None:
            raise RuntimeError(f"rank 0 failed while {what}: {error}")
        return result


def _is_committed(path: Path) -> bool:
    return (path / COMPLETE_NAME).is_file()


def _remove_checkpoint_dir(path: Path) -> None:
    # Drop the commit marker first: if we crash halfway through rmtree, the
    # remains read as "incomplete" (skipped quietly) rather than "corrupt".
    try:
        (path / COMPLETE_NAME).unlink(missing_ok=True)
        shutil.rmtree(path)
    except OSError as exc:
        log.warning("could not remove %s (%s): delete it by hand to reclaim space", path, exc)


def _manifest_hmac(key: bytes, step: int, files: dict[str, Any]) -> str:
    """HMAC-SHA256 over the manifest's step and file entries (canonical JSON)."""
    message = json.dumps({"step": step, "files": files}, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()
