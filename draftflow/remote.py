"""Object-store URLs (``s3://…``) for every folder a run writes, with the store's storage options.

One set of fsspec options serves the hidden-state store, the training run folder and its export:
the store block's (or ``$DRAFTFLOW_STORAGE_OPTIONS``, see :mod:`draftflow.process_env`). The
trainer is a torchrun subprocess, so it reads them from the environment; credentials never reach
argv. A local path gets no options (fsspec's local filesystem has no use for an endpoint URL).

Code that needs a real local folder (the contract check, the offline simulator, ``vllm serve``,
the model card) downloads a remote export once into a local copy (:func:`local_copy`).

:func:`missing_credentials` is the check that runs before any server starts: an ``s3://``
folder with no credentials anywhere fails at plan time with one line naming the field, instead
of after an hour of extraction, when the trainer first writes a checkpoint.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

import fsspec

from draftflow.paths import join, remote_copy, remote_copy_stamp
from draftflow.process_env import STORAGE_OPTIONS_ENV, storage_options_from_env

_S3 = ("s3", "s3a")


def protocol(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def is_remote(url: str) -> bool:
    return protocol(str(url)) not in ("file", "local")


def options_for(url: str, storage_options: dict | None = None) -> dict:
    """fsspec options for ``url``: the given ones (None: the environment's) if it is remote, else none."""
    if not is_remote(url):
        return {}
    return dict(storage_options_from_env() if storage_options is None else storage_options)


def url_to_fs(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(url, **options_for(url, storage_options))


def open_url(url: str, mode: str = "rb", storage_options: dict | None = None):
    return fsspec.open(url, mode, **options_for(url, storage_options))


def local_copy(url: str | Path, storage_options: dict | None = None, local_home: str | None = None) -> Path:
    """A local folder with the files of ``url``: the folder itself when local, else a copy under
    ``local_home`` (default ``$DRAFTFLOW_HOME``), downloaded again only when the listing (names,
    sizes, ETags) changed since the last copy."""
    url = str(url)
    if not is_remote(url):
        return Path(url.removeprefix("file://"))
    if local_home is None:
        from draftflow.recipe.load import default_home

        local_home = str(default_home())
    fs, root = url_to_fs(url, storage_options)
    root = root.rstrip("/")
    listing = _listing(fs, root, url)
    if not listing:
        raise FileNotFoundError(f"{url}: no files there")
    dest, stamp = Path(remote_copy(url, local_home)), Path(remote_copy_stamp(url, local_home))
    if dest.is_dir() and stamp.is_file() and json.loads(stamp.read_text()) == listing:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(6)}.tmp")
    try:
        for rel in sorted(listing):
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f"{root}/{rel}", str(tmp / rel))
        stamp.unlink(missing_ok=True)  # no stamp while the folder is swapped: a crash re-downloads
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
        stamp.write_text(json.dumps(listing))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _listing(fs: fsspec.AbstractFileSystem, root: str, url: str) -> dict[str, list]:
    """Relative key -> [size, ETag or mtime] of every file under ``root``; ValueError, before
    anything is written, for a key that would land outside the copy.

    Object stores keep keys verbatim, so ``export/../../x`` or ``export//etc/x`` are legal keys
    there; joined to a local folder they would write outside it.
    """
    listing = {}
    for path, info in fs.find(root, detail=True).items():
        key = path[len(root) + 1 :]
        if key.endswith("/") and not info.get("size"):
            continue  # a folder marker some S3 tools write: no file to copy
        if not key or any(part in ("", ".", "..") for part in key.split("/")):
            raise ValueError(
                f"{url}: refusing to copy key {key!r}: it points outside the folder (an absolute "
                "path, an empty, '.' or '..' segment); nothing was copied"
            )
        listing[key] = [info.get("size"), str(info.get("ETag") or info.get("mtime") or "")]
    return listing


def put_folder(local: str | Path, url: str, storage_options: dict | None = None) -> None:
    """Upload the files of a local folder under ``url`` (one PUT each)."""
    fs, root = url_to_fs(url, storage_options)
    local = Path(local)
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        fs.put_file(str(path), join(root, path.relative_to(local).as_posix()))


def _truthy(value) -> bool:
    return value is True or str(value).lower() in ("1", "true", "yes")


def missing_credentials(url: str, storage_options: dict | None = None) -> str | None:
    """Why ``url`` cannot be written with the credentials available here, or None.

    S3: explicit ``key``/``secret`` (or ``anon``) in the options or fsspec's config, else botocore's
    own chain (``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``/``profile``, ``~/.aws/credentials``, SSO,
    container and instance roles) — exactly what s3fs would use. Other remote protocols are not
    checked (their libraries resolve credentials in ways this cannot see without them).
    """
    proto = protocol(url)
    if proto not in _S3:
        return None
    options = {**fsspec.config.conf.get("s3", {}), **options_for(url, storage_options)}
    if _truthy(options.get("anon")) or (options.get("key") and options.get("secret")):
        return None
    import botocore.exceptions
    import botocore.session

    profile = options.get("profile")
    try:
        creds = botocore.session.Session(profile=profile).get_credentials()
    except botocore.exceptions.ProfileNotFound:
        return f"AWS profile {profile!r} (storage option `profile`) does not exist"
    except botocore.exceptions.BotoCoreError as err:
        return f"AWS credentials could not be resolved ({err})"
    if creds is not None:
        return None
    return (
        "no S3 credentials found: set key and secret in the store block or in "
        f"${STORAGE_OPTIONS_ENV}, or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE in the "
        "environment, or use an instance role (anonymous access: storage option anon=true)"
    )
