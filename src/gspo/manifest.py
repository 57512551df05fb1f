"""Manifests: the size and sha256 of every file of a folder gspo wrote, in its ``manifest.json``, written last;
checked before the folder is read back. A checkpoint has one (gspo.run.checkpoint), and so does each entry of
the GGUF cache (gspo.models.loading): damage (a disk, a partial copy, 4 KB overwritten at the same length)
is found by its hash instead of being loaded, and a file someone added is refused by name. A manifest catches
damage, not forgery: whoever can rewrite the files can rewrite it too.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path, PurePosixPath
from typing import Any

from gspo.files import replace_file

MANIFEST_FILE = "manifest.json"


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file's content, read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(2**20):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> tuple[list[str], list[str]]:
    """(files, links): the relative posix paths of the files in `folder` but its manifest, and of the
    symbolic links in it (os.walk does not enter a linked folder: nothing outside is listed)."""
    files, links = [], []
    for parent, folders, names in os.walk(folder):
        for name in [*folders, *names]:
            path = Path(parent, name)
            relative = path.relative_to(folder).as_posix()
            if path.is_symlink():
                links.append(relative)
            elif name in names and relative != MANIFEST_FILE:
                files.append(relative)
    return sorted(files), sorted(links)


def write_manifest(folder: Path, **facts: str) -> None:
    """Write `folder`'s manifest: every file's size and sha256, and `facts` (what the folder was made from),
    atomically and fsynced. Call it once the folder is complete: it vouches for what is there."""
    files, _ = _files(folder)
    manifest: dict[str, Any] = {
        "files": {
            name: {"size": (folder / name).stat().st_size, "sha256": file_sha256(folder / name)}
            for name in files
        },
        **facts,
    }
    replace_file(folder / MANIFEST_FILE, json.dumps(manifest, indent=1), sync=True)


def listed_files(folder: Path) -> set[str] | None:
    """The files `folder`'s manifest lists, or None where it has no manifest that reads as one."""
    try:
        return set(_read(folder)[0])
    except (OSError, ValueError):
        return None


def _read(folder: Path) -> tuple[dict[str, tuple[int, str]], dict[str, Any]]:
    """(file -> (size, sha256), the other facts) of `folder`'s manifest; ValueError naming what is wrong
    with one gspo did not write, OSError without one."""
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text(encoding="utf-8"))
        listed = {
            str(name): (int(entry["size"]), str(entry["sha256"])) for name, entry in manifest["files"].items()
        }
    except (TypeError, KeyError, AttributeError, RecursionError, ValueError) as error:
        raise ValueError(f"it is not a manifest gspo wrote ({type(error).__name__})") from None
    for name in listed:  # a path of the folder's own: never one that leads out of it
        parts = PurePosixPath(name).parts
        if not parts or PurePosixPath(name).is_absolute() or ".." in parts or "." in parts:
            raise ValueError(f"it is not a manifest gspo wrote (it lists {name[:80]!r})")
    return listed, {k: v for k, v in manifest.items() if k != "files"}


def manifest_problem(folder: Path, **facts: str) -> tuple[Path, str] | None:
    """The first file of `folder` that its manifest does not vouch for, and why, or None: a manifest that is
    missing or not gspo's, a symbolic link, a file it does not list (added), one it lists that is missing,
    of another size or with another sha256, or a fact of `facts` it does not hold. Every file is hashed:
    the cost is proportional to the folder's bytes."""
    manifest = folder / MANIFEST_FILE
    try:
        listed, held = _read(folder)
    except FileNotFoundError:
        return manifest, "it is missing"
    except (OSError, ValueError) as error:
        return manifest, str(error) if isinstance(
            error, ValueError
        ) else f"it cannot be read ({error.strerror})"
    files, links = _files(folder)
    if links:
        link = folder / links[0]
        return link, f"it is a symbolic link (to {os.readlink(link)}), which {MANIFEST_FILE} cannot vouch for"
    added = sorted(set(files) - listed.keys())
    if added:
        return folder / added[0], f"it is not in {MANIFEST_FILE}: something added it"
    for name, (size, sha256) in listed.items():
        file = folder / name
        if not file.is_file():
            return file, f"it is missing ({MANIFEST_FILE} lists {size:,} bytes)"
        if file.stat().st_size != size:
            return file, f"it is {file.stat().st_size:,} bytes, {MANIFEST_FILE} lists {size:,}"
        if file_sha256(file) != sha256:
            return file, f"its sha256 differs from the one in {MANIFEST_FILE}"
    for key, value in facts.items():
        if held.get(key) != value:
            return manifest, f"it was made from {key} {str(held.get(key))[:80]}, not {value}"
    return None
