"""Where a dataset's names lead. A dataset folder is untrusted input: every shard and index name
its manifest holds resolves inside the folder, on its filesystem, with its options. A name that is
an absolute path or a URL (an archive indexed in place outside the folder, another bucket) is read
only under a root the user named when opening the dataset (`allowed_roots`); anything else is
refused, never rewritten into a name that would pass.

On local disk the rule holds for the file a name leads to, symlinks followed: its real path lies
inside the folder's real path or an allowed root's. One exception, for Hugging Face hub
snapshots: a dataset folder inside `<cache>/(datasets|models|spaces)--<name>/snapshots/<revision>/`
is symlinks into the repository's own `blobs/` folder (made by huggingface_hub, one per file), so
links into that `blobs/` folder, and nowhere else, are followed too."""

from __future__ import annotations

import dataclasses
import functools
import os
import posixpath
import re
from collections.abc import Sequence

from pipeline.errors import ConfigError, ShardError

__all__ = ["ALLOW", "Places", "check_roots", "within"]

ALLOW = "allowed_roots=[...] (shard-pack: --allow-root)"  # the option that allows a place, as messages name it
_HUB_REPO = re.compile(r"(datasets|models|spaces)--.+")


def _is_url(text: str) -> bool:
    return "://" in text


def _normal(place: str) -> str:
    """A root or name as compared: a local path absolute and normalised, a URL without a trailing slash."""
    return place.rstrip("/") if _is_url(place) else os.path.normpath(os.path.abspath(place))


def within(place: str, root: str) -> bool:
    """Whether `place` (a path or URL) is `root` or lies under it, compared by whole path components
    (`s3://b/data` holds `s3://b/data/x.tar`, not `s3://b/database/x.tar`); never across schemes."""
    place, root = _normal(place), _normal(root)
    if _is_url(place) != _is_url(root):
        return False
    return place == root or place.startswith(root if root.endswith("/") else root + "/")


def check_roots(roots: Sequence[str]) -> tuple[str, ...]:
    """`allowed_roots` as given, checked: a list of non-empty paths or URLs (a single string is
    refused: it would be read as a list of characters)."""
    if isinstance(roots, (str, bytes)) or not all(isinstance(r, str) and r.strip() for r in roots):
        raise ConfigError(f"allowed_roots must be a list of paths or URLs (places outside a dataset's folder that its "
                          f"manifest may name), got {roots!r}")
    return tuple(roots)


@dataclasses.dataclass(frozen=True)
class Places:
    """The places the names of the dataset at `root` may lead to: the folder, and `allowed` roots."""

    root: str
    allowed: tuple[str, ...] = ()

    def url(self, name: str) -> str:
        """The URL (or local path) of a name the manifest holds: a relative name under the root; an
        absolute path or URL only inside the root or an allowed root, else a ShardError naming the option."""
        if not (name.startswith("/") or _is_url(name)):
            return posixpath.join(self.root.rstrip("/"), name)
        if not any(within(name, place) for place in (self.root, *self.allowed)):
            raise ShardError(f"the manifest of {self.root} names a file outside its folder; it is read only where "
                             f"you allow it: {ALLOW}, e.g. allowed_roots=[{posixpath.dirname(name)!r}]", url=name)
        return name

    def inside(self, name: str) -> bool:
        """Whether the name lies in the dataset's folder (read with its filesystem), not elsewhere."""
        return not (name.startswith("/") or _is_url(name)) or within(name, self.root)

    def real(self, path: str, url: str) -> str:
        """The real path of a local file a name led to (symlinks resolved), checked to lie inside the
        folder's or an allowed root's real path (or a hub snapshot's blobs: see the module); else a
        ShardError saying where the link leads and which option allows it."""
        real = os.path.realpath(path)
        if any(real == place or real.startswith(place.rstrip("/") + "/") for place in self._trusted):
            return real
        raise ShardError(f"{path} is a symlink to {real}, outside the dataset's folder ({self.root}): links are "
                         f"followed only inside it or where you allow it: {ALLOW}", url=url)

    @functools.cached_property
    def _trusted(self) -> tuple[str, ...]:
        """The real paths a local file may lie in: the folder's, the local allowed roots', and the
        blobs of the hub repository whose snapshot holds the folder (if it does)."""
        root = os.path.realpath(self.root)
        places = [root] + [os.path.realpath(place) for place in self.allowed if not _is_url(place)]
        folder = root
        while os.path.dirname(folder) != folder:
            snapshots, repo = os.path.dirname(folder), os.path.dirname(os.path.dirname(folder))
            if os.path.basename(snapshots) == "snapshots" and _HUB_REPO.fullmatch(os.path.basename(repo)):
                blobs = os.path.join(repo, "blobs")
                if os.path.isdir(blobs) and not os.path.islink(blobs):
                    places.append(blobs)
                break
            folder = snapshots
        return tuple(places)
