"""Plan files as bytes on disk: replaced atomically under a directory lock, read with errors that say what is wrong,
versioned by a digest of their bytes. Nothing here knows what a plan is."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning_ckpt.errors import PlanError
from lightning_ckpt.plan.schema import MAX_INT_DIGITS, Unreadable, refuse_unreadable

__all__ = ["bytes_version", "directory_lock", "plan_file_version", "read_json", "replace_atomically"]


def plan_file_version(path: str | os.PathLike[str]) -> str | None:
    """A digest of the file's bytes (None: no file), what ``Plan.save(unchanged_since=...)`` compares: read it
    before loading the plan, so a change in between shows up."""
    try:
        return bytes_version(Path(path).read_bytes())
    except FileNotFoundError:
        return None


def bytes_version(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


@contextlib.contextmanager
def directory_lock(directory: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the directory itself (no lock file left beside the plan). Without flock (Windows,
    some network mounts) the save runs unlocked: ``format._refuse_if_changed`` still catches non-simultaneous ones."""
    try:
        import fcntl

        fd = os.open(directory, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _create_beside(target: Path) -> tuple[int, str]:
    """A new, empty temporary file in ``target``'s directory, created with mode 0o666 so the umask applies."""
    for _ in range(100):
        tmp = target.parent / f".{target.name}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), str(tmp)
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary file beside {str(target)!r}: every name tried exists")


def replace_atomically(target: Path, data: bytes) -> None:
    """Write ``data`` beside ``target``, then replace it, keeping a replaced file's mode (a new file gets what
    ``open()`` gives: ``0o666`` less the umask)."""
    try:
        keep_mode: int | None = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        keep_mode = None
    fd, tmp = _create_beside(target)
    try:
        with os.fdopen(fd, "wb") as f:
            if keep_mode is not None:
                os.fchmod(f.fileno(), keep_mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class _DuplicateKeyError(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(key)
        out[key] = value
    return out


def _parse_int(text: str) -> int | Unreadable:
    # Checked before int(): converting a long digit string costs quadratic time (and fails past 4,300 digits).
    return Unreadable(text) if len(text.lstrip("-")) > MAX_INT_DIGITS else int(text)


def _parse_float(text: str) -> float | Unreadable:
    value = float(text)
    return value if math.isfinite(value) else Unreadable(text)


# A real plan file is well under 1 MiB; this keeps a mistaken path (a log) from being parsed and printed.
MAX_PLAN_BYTES = 8 * 2**20


def max_plan_bytes() -> int:
    value = os.environ.get("LIGHTNING_CKPT_MAX_PLAN_BYTES")
    try:
        return int(value) if value else MAX_PLAN_BYTES
    except ValueError:
        raise PlanError(
            f"LIGHTNING_CKPT_MAX_PLAN_BYTES={value!r} is not a number of bytes; set it to e.g. 33554432 (32 MiB)."
        ) from None


def _read_bytes(path: Path, where: str) -> bytes:
    """The bytes of a regular file of at most ``max_plan_bytes()``, else ``PlanError`` saying why not."""
    limit = max_plan_bytes()
    try:
        info = path.stat()
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(str(path))
        if not stat.S_ISREG(info.st_mode):
            raise PlanError(
                f"{where} is not a regular file (a device, a pipe or a socket), so it is not read. Give the path of "
                "a plan JSON file."
            )
        if info.st_size > limit:
            raise PlanError(
                f"{where} is {info.st_size:,} bytes, larger than the {limit:,} bytes a plan file may be, so it is "
                "not read (a plan with its profile is well under 1 MiB). Check that the path names a "
                "plan file, or set LIGHTNING_CKPT_MAX_PLAN_BYTES to read a larger one."
            )
        with path.open("rb") as f:
            raw = f.read(limit + 1)
        if len(raw) > limit:
            raise PlanError(f"{where} grew beyond {limit:,} bytes while it was read; it is not read.")
    except FileNotFoundError:
        raise PlanError(f"{where} does not exist. Check the path, or tune first to write it.") from None
    except IsADirectoryError:
        raise PlanError(f"{where} is a directory. Give the path of a plan JSON file inside it.") from None
    except PermissionError:
        raise PlanError(
            f"{where} cannot be read: permission denied. Make it readable (chmod u+r), or point to a copy."
        ) from None
    except OSError as err:
        raise PlanError(f"{where} cannot be read: {err.strerror or err}. Check the path and the disk.") from None
    return raw


def read_json(path: Path, where: str) -> Any:
    """The JSON value at ``path``; anything unreadable or malformed raises ``PlanError`` starting with ``where``."""
    raw = _read_bytes(path, where)
    try:
        text = raw.decode("utf-8-sig")  # tolerate the byte-order mark some editors add
    except UnicodeDecodeError as err:
        raise PlanError(
            f"{where} is not a UTF-8 text file (byte {raw[err.start]:#04x} at offset {err.start}), so it cannot be "
            "a JSON plan. Check that the path names the plan, not another file; re-tune to write it again."
        ) from None
    if not text.strip():
        raise PlanError(
            f"{where} is empty (a write that never finished, or a placeholder). Delete it and re-tune, or "
            "restore it from version control."
        )
    try:
        hooks = {"parse_int": _parse_int, "parse_float": _parse_float, "parse_constant": Unreadable}
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys, **hooks)
    except json.JSONDecodeError as err:
        raise PlanError(
            f"{where} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}). "
            "Delete it and re-tune, or restore it from version control."
        ) from None
    except _DuplicateKeyError as err:
        raise PlanError(
            f"{where}: field {err.args[0]!r} appears more than once in one object, so which value counts is "
            "ambiguous. Keep one of them."
        ) from None
    except RecursionError:
        raise PlanError(f"{where} is nested too deeply to be a plan. Delete it and re-tune.") from None
    refuse_unreadable(data, where)  # NaN, Infinity, huge numbers and deep nesting, naming the field
    return data
