"""BubblewrapBackend's image (shell.py): the host's root file system, read-only, and what a Dockerfile subset adds.

``plan(dockerfile)`` reads the subset into a work dir, ENV and steps (RUN, and COPY as a ``cp`` from the build context,
staged read-only at ``STAGE``); anything outside it is a ``PrepareError`` naming the file, the line and the fix.
``tree(mounts)`` places the episode's folders (the work dir, /logs, /tmp, ``put``'s) in the read-only tree wherever they
go, as Harbor tasks put their work dir anywhere (/app, /srv/x, /home/user/work, /opt/tool, /data/inbox): a host
folder that must hold a new mount point is covered by a tmpfs in which its entries are bound again read-only, the
folders made on the way are 0755 and root's, nothing is written on the host. ``mount_point`` refuses, with the cause
and the fix, what cannot be placed: the sandbox's own /proc, /dev, /sys, /tmp and /logs, a path through a link or a
file of the host, a folder that would hide the interpreter that starts each command.
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
_OWN = {"/proc": "the kernel's", "/dev": "the kernel's", "/sys": "the kernel's", "/tmp": "the episode's scratch folder",
        "/logs": "the episode's logs", STAGE: "the build context while preparing"}


class PrepareError(RuntimeError):
    """The environment cannot be prepared; names the file and line, and the fix."""


def plan(dockerfile: Path, keep: tuple[str, ...] = ()) -> tuple[str, dict[str, str], list[tuple]]:
    """BubblewrapBackend's Dockerfile subset: (WORKDIR, ENV, steps: (line, RUN or COPY, argv, ENV then)); ``keep``:
    see ``mount_point``."""
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
            root = mount_point(path, f"{where} {path}", keep)
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


def mount_point(inside: str, what: str, keep: tuple[str, ...] = ()) -> str:
    """``inside``, when ``tree`` can mount a folder of the episode there; else a PrepareError naming the cause and the
    fix. ``keep``: what the sandbox must still reach (the launcher's interpreter)."""
    def refuse(why: str, fix: str = "choose another folder (such as /app), or use BuildahBackend for this task"):
        return PrepareError(f"{what}: {why}: {fix}")
    top = "/" + inside.split("/")[1]
    if top in _OWN:
        raise refuse(f"{top} is the sandbox's own ({_OWN[top]}), not a folder of the image")
    if hidden := [k for k in keep if f"{k}/".startswith(f"{inside}/")]:
        raise refuse(f"a folder mounted there would hide {hidden[0]}, the Python that starts every command",
                     "choose another folder (such as /app), run molt with a Python installed elsewhere, or use "
                     "BuildahBackend")
    for i in range(2, inside.count("/") + 2):
        path = "/".join(inside.split("/")[:i])
        if os.path.islink(path):
            raise refuse(f"{path} is a link on the host (to {os.readlink(path)})",
                         f"write the folder it leads to ({os.path.realpath(inside)}), or use BuildahBackend")
        if os.path.lexists(path) and not os.path.isdir(path):
            raise refuse(f"{path} is a file on the host")
    return inside


def tree(mounts: dict[str, str], keep: tuple[str, ...] = ()) -> list[str]:
    """bwrap arguments, once the host's top-level entries are bound read-only, that bind ``mounts`` (inside -> host
    folder) writable and ``keep`` read-only, each reachable by the episode's uid, nothing written on the host. A host
    folder in which a mount point is missing is covered by a tmpfs of its mode in which its entries are bound again
    read-only; one that others cannot search (/root, 0700) on the way to a mount point by an empty 0755 tmpfs that holds
    only what is bound in it; folders made on the way are 0755 (bwrap would make them 0700); covers end read-only."""
    covers: dict[str, bool] = {}  # folder -> its host entries bound again (else an empty cover of a closed folder)
    binds: list[str] = []
    for target, flag in [*((k, "--ro-bind") for k in sorted(keep)), *((m, "--bind") for m in sorted(mounts))]:
        parts, made = target.split("/"), []
        for i in range(2, len(parts) + 1):
            path, above = "/".join(parts[:i]), "/".join(parts[:i - 1])
            if not os.path.isdir(path):  # missing from here down: made in a cover of the host folder above (or /)
                made = ["/".join(parts[:j]) for j in range(i, len(parts))]
                if above:
                    covers.setdefault(above, True)
                break
            if path != target and not os.stat(path).st_mode & 0o001:  # others cannot search it: an empty cover
                covers[path], made = False, ["/".join(parts[:j]) for j in range(i + 1, len(parts))]
                break
        binds += [a for d in made for a in ("--perms", "0755", "--dir", d)] + [flag, mounts.get(target, target), target]
    argv = []
    for cover in sorted(covers, key=lambda path: path.split("/")):
        argv += ["--perms", f"{os.stat(cover).st_mode & 0o7777 if covers[cover] else 0o755:04o}", "--tmpfs", cover]
        for entry in [os.path.join(cover, name) for name in sorted(os.listdir(cover))] if covers[cover] else []:
            argv += ["--symlink", os.readlink(entry), entry] if os.path.islink(entry) else ["--ro-bind", entry, entry]
    return argv + binds + [a for cover in covers for a in ("--remount-ro", cover)]
