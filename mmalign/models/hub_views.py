"""Models by name, the local side of :mod:`mmalign.models.hub`: a *view* is a folder of links to
exactly the files a name means (and the ``open_clip_config.json`` open_clip would build from),
in ``MMALIGN_CACHE`` (default ``HF_HOME/mmalign``); it holds no weights of its own and is
rewritten safely by ranks or threads resolving one name at once."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path

from mmalign.errors import UsageError


def views_dir() -> Path:
    """Where views are written: ``MMALIGN_CACHE``, else ``HF_HOME/mmalign``."""
    own = os.environ.get("MMALIGN_CACHE")
    if own:
        return Path(own).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
    )
    return Path(home).expanduser() / "mmalign"


def flat(repo: str) -> str:
    return repo.replace("/", "--")


def view(rel: str, jsons: dict[str, dict], links: dict[str, Path]) -> Path:
    """``views_dir()/rel`` holding exactly ``jsons`` (written) and ``links`` (symlinks, or copies
    where the file system has none); stale entries removed."""
    folder = views_dir() / rel
    try:
        folder.mkdir(parents=True, exist_ok=True)
        wanted = set(jsons) | set(links)
        for old in folder.iterdir():  # another process's temporary (a dot name) is left alone
            if (
                old.name not in wanted
                and not old.name.startswith(".")
                and (old.is_symlink() or old.is_file())
            ):
                with contextlib.suppress(FileNotFoundError):  # removed by a process resolving it too
                    old.unlink()
        for fname, data in jsons.items():
            text = json.dumps(data, indent=2, sort_keys=True) + "\n"
            target = folder / fname
            if not target.is_file() or target.read_text(encoding="utf-8") != text:
                # ranks (processes) and threads may resolve one name at once: a temporary each
                tmp = folder / f".{fname}.{os.getpid()}.{threading.get_ident()}.tmp"
                tmp.write_text(text, encoding="utf-8")
                os.replace(tmp, target)
        for fname, src in links.items():
            _link(folder / fname, Path(src).resolve())
    except OSError as e:
        raise UsageError(
            f"cannot write the model view {folder} ({e.strerror or e}); set MMALIGN_CACHE to a writable folder"
        ) from None
    return folder


def _link(at: Path, src: Path) -> None:
    if at.is_symlink() and Path(os.readlink(at)) == src:
        return
    tmp = at.with_name(f".{at.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        tmp.symlink_to(src)
    except OSError:  # no symlinks here: a hard link, else a copy
        try:
            os.link(src, tmp)
        except OSError:
            import shutil

            shutil.copyfile(src, tmp)
    os.replace(tmp, at)
