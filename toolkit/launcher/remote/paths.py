"""Paths on a host as its transports take them: `~` means the home directory, where sessions start and sftp
resolves relative paths. Shared by Host (command_text, put, write, preflight) and the directory sync
(toolkit.launcher.remote.projectsync)."""

from __future__ import annotations

from toolkit.errors import UserError


def home_relative(path: str) -> str:
    """`~` and `~/x` as paths relative to the home directory (where sessions start and sftp resolves relative
    paths), since a quoted `~` is not expanded. UserError for `~user` paths."""
    path = str(path)
    if path == "~":
        return "."
    if path.startswith("~/"):
        return path[2:] or "."
    if path.startswith("~"):
        raise UserError(f"{path}: ~user paths are not supported; give an absolute path or one relative to home")
    return path
