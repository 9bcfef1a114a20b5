"""BubblewrapBackend's image (shell.py): the host's root file system, read-only, and what a Dockerfile subset adds.

``plan(dockerfile)`` reads the subset into a work dir, ENV and steps (RUN, and COPY as a ``cp`` from the build context,
staged read-only at ``STAGE``); anything outside it is a ``PrepareError`` naming the file, the line and the fix.
``mount_point`` says whether a folder of the episode can be mounted at a path of that read-only tree.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
from pathlib import Path

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
STAGE = "/.molt-stage"  # where the build context is bound, read-only, for COPY
_IGNORED = {"FROM", "LABEL", "EXPOSE", "CMD", "ENTRYPOINT", "MAINTAINER", "HEALTHCHECK", "STOPSIGNAL", "VOLUME"}
_FIX = "is not supported by BubblewrapBackend: use BuildahBackend for this task"


class PrepareError(RuntimeError):
    """The environment cannot be prepared; names the file and line, and the fix."""


def plan(dockerfile: Path) -> tuple[str, dict[str, str], list[tuple]]:
    """BubblewrapBackend's Dockerfile subset: (WORKDIR, ENV, steps: (line, RUN or COPY, argv, ENV then))."""
    if not dockerfile.is_file():
        raise PrepareError(f"{dockerfile}: no Dockerfile in the environment folder")
    text, root, env, steps, ctx = dockerfile.read_text(), None, {}, [], dockerfile.parent
    for m in re.finditer(r"(?m)^[ \t]*([A-Za-z]+)[ \t]*((?:[^\n]*\\\n)*[^\n]*)", text):  # continued lines joined
        first, word, args = text.count("\n", 0, m.start()) + 1, m[1].upper(), re.sub(r"\\\n", " ", m[2]).strip()
        where = f"{dockerfile}:{first}: {word}"

        def expand(value: str) -> str:  # $VAR and ${VAR} from ENV (PATH: the sandbox's)
            if "${" in re.sub(r"\$\{\w+\}", "", value):
                raise PrepareError(f"{where}: {value}: ${{...}} beyond a plain variable {_FIX}")
            return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda v: {"PATH": PATH, **env}.get(v[1] or v[2], ""), value)
        if word == "ENV":
            name, _, rest = args.partition(" ")
            pairs = [p.partition("=") for p in shlex.split(args)] if "=" in name else [(name, "", rest.strip())]
            env |= {k: expand(v) for k, _, v in pairs}
        elif word == "WORKDIR":
            path = posixpath.normpath(posixpath.join(root or "/", expand(args)))
            if path == "/" or root not in {None, path}:
                raise PrepareError(f"{where} {path}: a second work dir (or /) {_FIX}")
            root = mount_point(path, f"{where} {path}")
        elif word in ("COPY", "ADD"):
            words = json.loads(args) if args.startswith("[") else args.split()
            if flags := [w for w in words if w.startswith("--") and not w.startswith("--chown=")]:
                raise PrepareError(f"{where} {' '.join(flags)} {_FIX}")
            words, root = [expand(w) for w in words if not w.startswith("--")], root or "/app"
            dest, found = posixpath.normpath(posixpath.join(root, words[-1])), [ctx / w for w in words[:-1]]
            if len(words) < 2 or not (dest == root or dest.startswith(root + "/")):
                raise PrepareError(f"{where}: needs sources and a destination in the work dir {root}")
            for path, pattern in zip(found, words):
                if re.search(r"[*?[]", pattern) or word == "ADD" and re.search(r"://|\.(tar|t[gbx]z2?)\b", pattern):
                    raise PrepareError(f"{where} of a glob, URL or archive {_FIX}")
                rel = os.path.relpath(os.path.join(os.path.realpath(path.parent), path.name), os.path.realpath(ctx))
                if not (path.exists() or path.is_symlink()) or rel == ".." or rel.startswith("../"):
                    raise PrepareError(f"{where}: {pattern} is not a file or folder of the build context")
            into = len(found) > 1 or words[-1].endswith("/") or any(p.is_dir() and not p.is_symlink() for p in found)
            sources = [shlex.quote(f"{STAGE}/{os.path.relpath(p, ctx)}" + ("/." if p.is_dir() and
                                   not p.is_symlink() else "")) for p in found]  # Docker copies a folder's contents
            script = f"mkdir -p {shlex.quote(dest if into else posixpath.dirname(dest))} && cp -R -P " \
                     f"--preserve=mode,timestamps {' '.join(sources)} {shlex.quote(dest)}"
            steps.append((first, word, ["/bin/bash", "-c", script], dict(env)))
        elif word == "RUN":
            if args.startswith(("--", "<<")):
                raise PrepareError(f"{where} with flags or a here-document {_FIX}")
            root = root or "/app"
            steps.append((first, word, ["/bin/sh", "-c", 'exec "$@"', "sh", *json.loads(args)] if args.startswith("[")
                          else ["/bin/sh", "-c", args], dict(env)))
        elif word not in _IGNORED:  # FROM too: the host's root file system is the image
            raise PrepareError(f"{where} {_FIX}")
    return root or "/app", env, steps


def mount_point(inside: str, what: str) -> str:  # bwrap mounts in its root (new top-level folders) or on host ones
    if inside != (top := "/" + inside.split("/")[1]) and os.path.lexists(top) and not os.path.isdir(inside):
        raise PrepareError(f"{what}: {inside} would need a new folder in the host's read-only {top}: choose a new "
                           f"top-level folder (such as /app) or an existing one, or use BuildahBackend for this task")
    return inside
