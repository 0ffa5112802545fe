"""One output folder, one run: what every command that writes a folder opens it through.

A run folder holds ``run.lock``, locked (``fcntl.flock``) for as long as the run is alive, and
``run.json``, its manifest: the command, the digest of the config keys that decide what it computes
(:func:`config_digest`) and those keys themselves (a refusal names the ones that differ), the judgeloop
version, the start time, the pid and the state (``running`` while it works; ``finished`` once its outputs
are written; ``stopped`` when it ended on an error or a stop signal; a ``running`` folder whose lock is free
was killed). Opening a folder (:func:`open_run_dir`):

- missing or empty: a fresh run;
- locked: another run is writing it now: refused, naming its pid;
- holding this command's run with the same digest: kept (a resume continues it), cleaned (the run starts
  over) or refused, as the command says (``on_match``);
- holding another command's run, another config's, or files without ``run.json`` (an older judgeloop's
  outputs, anything else): refused, with the fix: a new ``output_dir``, or ``overwrite=true`` (the config
  key every such command has), which clears the folder first (only a judgeloop run folder is cleared).

Every check happens before the command's heavy work (data, models), so a refused run writes nothing. Under
several processes only the main one (``RANK`` 0) opens the folder; the others wait for it at their first
barrier. The lock is released by the kernel when the process dies (SIGKILL included), so a killed run's
folder is free for its resume.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from judgeloop.config import ConfigError, config_changes, default_dict, migrate, to_dict
from judgeloop.hashing import json_digest
from judgeloop.io import atomic_write_json, json_text
from judgeloop.version import __version__

RUN_FILE = "run.json"
LOCK_FILE = "run.lock"
# keys no command's digest holds: where the run is written, and whether an old folder may be cleared
ALWAYS_FREE = ("output_dir", "overwrite")
# what marks a folder written by judgeloop before run.json existed (overwrite=true may clear those only)
OLD_RUN_MARKS = (
    "config.yaml",
    "sft_config.yaml",
    "report.json",
    "eval_report.json",
    "stats.json",
    "metrics.jsonl",
    "checkpoints",
    "calibrated_judge",
    "model",
    "policy",
    "dataset",
)
FIX = "choose a new output_dir, or set overwrite=true to clear it"
# a command that holds a run folder and launches a recipe writing into it names the folder here, so the
# recipe's own run_dir does not take the lock a second time (judgeloop sft -> recipes/sft_raft.py)
HELD_ENV = "JUDGELOOP_HELD_RUN_DIR"

OnMatch = Literal["keep", "clean", "refuse"]


class RunDirError(ConfigError):
    """An output folder that holds another run (or is in use by one)."""


def free_keys(cfg: Any) -> tuple[str, ...]:
    """The keys of ``cfg`` that a rerun or resume may change: ``ALWAYS_FREE`` plus the schema's
    ``RUN_FREE_KEYS`` class attribute (a tuple of names, dotted for nested ones, like ``RENAMED``)."""
    return ALWAYS_FREE + tuple(getattr(type(cfg), "RUN_FREE_KEYS", ()))


def _without(tree: dict[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    """A copy of a config dict without the (dotted) ``keys``."""
    out = dict(tree)
    for key in keys:
        *parents, last = key.split(".")
        node: Any = out
        for part in parents:
            node[part] = dict(node[part]) if isinstance(node.get(part), dict) else {}
            node = node[part]
        node.pop(last, None)
    return out


def config_digest(cfg: Any) -> str:
    """The digest of the config keys that decide what the run computes (every key but :func:`free_keys`)."""
    return json_digest(_without(to_dict(cfg), free_keys(cfg)))


def is_main_process() -> bool:
    """Whether this is the main process of a launch (``RANK`` 0, or no launcher), known before an
    ``Accelerator`` exists."""
    return int(os.environ.get("RANK", "0") or 0) == 0


def _config_differences(folder: Path, manifest: dict[str, Any], cfg: Any) -> list[str] | None:
    """``key: old -> new`` between the config the folder's run was made with (its manifest's, else its
    ``config.yaml``) and ``cfg`` over the non-free keys (a key added to the schema since compares at its
    default); None where the folder has no readable config."""
    saved = manifest.get("config")
    if not isinstance(saved, dict):
        try:
            saved = yaml.safe_load((folder / "config.yaml").read_text()) or {}
        except (OSError, yaml.YAMLError):
            return None
    if not isinstance(saved, dict):
        return None
    new = yaml.safe_load(yaml.safe_dump(to_dict(cfg), sort_keys=False)) or {}
    keys = free_keys(cfg)
    saved, new = _without(migrate(type(cfg), saved), keys), _without(new, keys)
    return config_changes(saved, new, defaults=_without(default_dict(type(cfg)), keys))


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((folder / RUN_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # damaged: treated as another run's
    return manifest if isinstance(manifest, dict) else {}


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != LOCK_FILE) if folder.is_dir() else []


@dataclass
class RunDir:
    """An opened run folder; ``kept``: it held this run's outputs, kept for a resume to continue."""

    path: Path
    command: str
    digest: str
    config: dict[str, Any] = dataclasses.field(default_factory=dict)  # the non-free keys (run.json's)
    kept: bool = False
    shared: bool = False
    _lock: int | None = None

    def clean(self) -> None:
        """Remove everything in the folder but its lock, and write this run's manifest."""
        for name in _entries(self.path):
            p = self.path / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        self.kept = False
        self.write("running")

    def write(self, state: str) -> None:
        """Write ``run.json`` with ``state`` (``running`` / ``finished``)."""
        atomic_write_json(
            self.path / RUN_FILE,
            {
                "command": self.command,
                "config_digest": self.digest,
                "judgeloop_version": __version__,
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "pid": os.getpid(),
                "state": state,
                "config": self.config,
            },
        )

    def finish(self, state: str = "finished") -> None:
        """Mark the run ``finished`` (its outputs are all written) or ``stopped`` (it ended on an error or a
        stop signal; a resume may continue it)."""
        if not self.shared and self._lock is not None:
            from judgeloop.io import atomic_write_text

            manifest = _read_manifest(self.path) or {}
            manifest["state"] = state
            manifest["ended"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            atomic_write_text(self.path / RUN_FILE, json_text(manifest) + "\n")

    def release(self) -> None:
        """Release the lock (the lock file stays: removing it would let two runs lock two files)."""
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            os.close(self._lock)
            self._lock = None


def _take_lock(folder: Path, shared: bool) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            os.close(fd)
            raise
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        manifest = _read_manifest(folder) or {}
        what = f" ({manifest['command']})" if manifest.get("command") else ""
        raise RunDirError(
            f"output_dir={folder} is in use by another run{what}, pid {holder}; wait for it to end, or "
            "choose another output_dir"
        ) from None
    return fd


@contextlib.contextmanager
def held_folder(out_dir: str | Path, shared: bool = False) -> Iterator[None]:
    """Hold ``out_dir``'s lock (no manifest decision) while the block runs: for a step that only adds to a
    run folder opened before (``ablate --aggregate`` writing ``results.*`` beside its jobs). A folder that
    does not exist holds no run and is not created: the block runs unlocked (and says there is nothing)."""
    if not Path(out_dir).is_dir():
        yield
        return
    fd = _take_lock(Path(out_dir), shared)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@contextlib.contextmanager
def output_file(path: str | Path, command: str, cfg: Any) -> Iterator[dict[str, str]]:
    """Hold ``PATH.lock`` while a command writes the file ``path`` (and its companions): a second run
    writing the same file is refused in one line, naming the holder's pid. Yields what the file's summary
    records to say which run wrote it: the command and its config digest."""
    path = Path(path)
    lock = path.with_name(path.name + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        raise RunDirError(
            f"output_path={path} is being written by another run, pid {holder}; wait for it to end, or "
            "choose another output_path"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    try:
        yield {"command": command, "config_digest": config_digest(cfg)}
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def check_not_in_use(out_dir: str | Path) -> None:
    """Raise :class:`RunDirError` (naming the holder's pid) when a run holds ``out_dir`` now: call it
    before removing or replacing a run folder by other means than :func:`open_run_dir`."""
    folder = Path(out_dir)
    if (folder / LOCK_FILE).is_file():
        fd = _take_lock(folder, shared=False)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def open_run_dir(
    out_dir: str | Path,
    command: str,
    cfg: Any,
    on_match: OnMatch = "clean",
    can_resume: Callable[[Path], bool] | None = None,
    hint: str = "",
    shared: bool = False,
) -> RunDir:
    """Lock ``out_dir`` and decide what becomes of what it holds (see the module docstring); returns the
    opened folder, whose lock the caller releases (:func:`run_dir` does both).

    Args:
        on_match: a folder holding this command's run with this digest is kept (``keep``: the caller
            resumes it; with ``can_resume``, only when ``can_resume(folder)`` says there is something to
            resume, else it is cleaned), cleaned (``clean``: the run starts over) or refused (``refuse``,
            the message adds ``hint``, e.g. how to continue it).
        shared: a shared lock (jobs of one grid writing their own subfolders at once), else exclusive.

    Raises:
        RunDirError: the folder is in use, or holds another run (the message names the folder and the fix).
    """
    folder = Path(out_dir)
    if folder.exists() and not folder.is_dir():
        raise RunDirError(f"output_dir={folder} is a file; point output_dir at a folder")
    overwrite = bool(getattr(cfg, "overwrite", False))
    digest = config_digest(cfg)
    config = yaml.safe_load(yaml.safe_dump(_without(to_dict(cfg), free_keys(cfg)), sort_keys=False)) or {}
    rd = RunDir(folder, command, digest, config, shared=shared)
    rd._lock = _take_lock(folder, shared)
    try:
        _decide(rd, cfg, on_match, can_resume, hint, overwrite)
    except BaseException:
        rd.release()
        raise
    if not shared:  # the holder's pid, for the message of a run that finds the folder locked
        os.ftruncate(rd._lock, 0)
        os.pwrite(rd._lock, f"{os.getpid()}\n".encode(), 0)
    return rd


def _decide(
    rd: RunDir,
    cfg: Any,
    on_match: OnMatch,
    can_resume: Callable[[Path], bool] | None,
    hint: str,
    overwrite: bool,
) -> None:
    folder, command = rd.path, rd.command
    entries = _entries(folder)
    if not entries:
        rd.write("running")
        return
    manifest = _read_manifest(folder)
    if manifest is None:
        if not overwrite:
            raise RunDirError(
                f"output_dir={folder} holds files ({', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''}) "
                f"but no {RUN_FILE}: an older judgeloop's run or other files; {FIX}"
            )
        if not any(name in OLD_RUN_MARKS for name in entries):
            raise RunDirError(
                f"output_dir={folder} holds files that are no judgeloop run's ({', '.join(entries[:3])}); "
                "overwrite=true clears run folders only: choose an empty or new output_dir"
            )
        rd.clean()
        return
    if overwrite:
        if rd.shared:  # others may be writing it now
            raise RunDirError(
                f"output_dir={folder}: overwrite=true clears the folder, which runs sharing it may be writing "
                "now; clear it with a run that holds it alone (without --job / --aggregate), or drop overwrite"
            )
        rd.clean()
        return
    old = manifest.get("command")
    if old != command:
        raise RunDirError(f"output_dir={folder} holds a {old or 'damaged'} run, not a {command} run; {FIX}")
    if manifest.get("config_digest") != rd.digest:
        changes = _config_differences(folder, manifest, cfg)
        if changes != []:  # a key added to the schema since, at its default, changes nothing
            shown = "; ".join((changes or [])[:3]) + ("; ..." if changes and len(changes) > 3 else "")
            raise RunDirError(
                f"output_dir={folder} holds another {command} run, made with another config"
                f"{f' ({shown})' if shown else ''}; {FIX}"
            )
    if on_match == "refuse":
        raise RunDirError(
            f"output_dir={folder} holds this {command} run already ({manifest.get('state', 'unknown')}); "
            f"{hint + ', ' if hint else ''}choose a new output_dir, or set overwrite=true to start it over"
        )
    if on_match == "keep" and (can_resume is None or can_resume(folder)):
        rd.kept = True
        rd.write("running")
        return
    rd.clean()


def held_by_launcher(out_dir: str | Path) -> bool:
    """Whether the command that launched this process holds ``out_dir`` (see :func:`lent_to_child`)."""
    held = os.environ.get(HELD_ENV, "")
    return bool(held) and Path(held) == Path(out_dir).resolve()


@contextlib.contextmanager
def lent_to_child(out_dir: str | Path) -> Iterator[dict[str, str]]:
    """While the block runs, a recipe started from it (a subprocess given the yielded environment, or run
    in this process) finds ``out_dir`` held by its launcher: the launcher keeps the lock and the manifest."""
    before = os.environ.get(HELD_ENV)
    os.environ[HELD_ENV] = str(Path(out_dir).resolve())
    try:
        yield dict(os.environ)
    finally:
        if before is None:
            os.environ.pop(HELD_ENV, None)
        else:
            os.environ[HELD_ENV] = before


@contextlib.contextmanager
def run_dir(
    out_dir: str | Path,
    command: str,
    cfg: Any,
    on_match: OnMatch = "clean",
    can_resume: Callable[[Path], bool] | None = None,
    hint: str = "",
    shared: bool = False,
    main_process: bool | None = None,
) -> Iterator[RunDir | None]:
    """:func:`open_run_dir` for the ``with`` block, on the main process only (``None`` on the others); the
    run is marked finished when the block ends without an error, and the lock released however it ends."""
    if not (is_main_process() if main_process is None else main_process) or held_by_launcher(out_dir):
        yield None
        return
    created = not Path(out_dir).exists()
    rd = open_run_dir(out_dir, command, cfg, on_match, can_resume, hint, shared)
    try:
        yield rd
        rd.finish()
    except BaseException:
        if not rd.kept and _entries(rd.path) == [RUN_FILE]:  # failed before writing anything: leave no trace
            (rd.path / RUN_FILE).unlink(missing_ok=True)
            if created:
                (rd.path / LOCK_FILE).unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    rd.path.rmdir()
        elif (rd.path / RUN_FILE).is_file():
            rd.finish("stopped")
        raise
    finally:
        rd.release()
