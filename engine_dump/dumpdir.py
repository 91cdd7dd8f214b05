"""The dump dir belongs to the server and the workers alone: who may own it, and its files.

Whoever can write into it can put forged hidden states where a worker reads them, and
``/dev/shm`` is world-writable, so every side refuses at start-up a dump dir another user owns
or can write to, or can rename away or reach through a link of theirs (``problem``). Every file
is then opened through the very directory that passed (``open_dir``), without following links.
Layouts (one user: 0700; two users: a setgid group dir, 2770): docs/deployment.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import stat
from pathlib import Path

DIR_MODE = 0o700
GROUP_DIR_MODE = 0o2770


class DumpDirUnsafe(RuntimeError):
    """The dump dir (or a file in it) is not the server's and the workers' alone; the message
    has the fix."""


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no such user"


def problem(path: Path, euid: int | None = None) -> str | None:
    """Why ``path`` (an existing directory) must not be a dump dir; None when it is fine."""
    euid = os.geteuid() if euid is None else euid
    try:
        st = os.stat(path)
        parent = os.stat(path.absolute().parent)
    except OSError as e:
        return f"dump dir {path} cannot be examined ({e})"
    why = _dir_problem(path, st, euid)
    if why:
        return why
    pmode = stat.S_IMODE(parent.st_mode)
    if pmode & stat.S_IWOTH and not pmode & stat.S_ISVTX:
        return (f"dump dir {path} is in {path.absolute().parent}, which others can write to "
                f"(mode {pmode:04o}, no sticky bit): they can replace the dump dir; use a dir "
                "under /dev/shm")
    return _path_problem(path, euid)


def _dir_problem(path: Path, st: os.stat_result, euid: int) -> str | None:
    """Why the directory ``st`` (the dump dir, looked up or opened) is not this user's alone:
    another user owns it, or others can write to it."""
    if not stat.S_ISDIR(st.st_mode):
        return f"dump dir {path} is not a directory: remove it (rm {path}) or set another"
    if st.st_uid not in (euid, 0):
        return (f"dump dir {path} is owned by uid {st.st_uid} ({_user(st.st_uid)}), not by "
                f"this process's user {_user(euid)} (uid {euid}): that user can put forged "
                f"hidden states in it. Remove it (as root; it may hold forged files): rm -rf "
                f"{path}, and let the server create it (or: chown {euid} {path} && chmod 0700 "
                f"{path}, if you know what is in it)")
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH:
        return (f"dump dir {path} is mode {mode:04o}: others can write to it (forged hidden "
                f"states): chmod 0700 {path}")
    if mode & stat.S_IWGRP and not mode & stat.S_ISGID:
        return (f"dump dir {path} is mode {mode:04o}: its group can write to it, and it is no "
                f"shared group dir (setgid): chmod 0700 {path} (or, for a group that holds "
                f"the server's and the workers' users: chmod 2770 {path})")
    return None


_MAX_LINKS = 40  # as the kernel's lookup: more is a loop


def _path_problem(path: Path, euid: int, missing_ok: bool = False) -> str | None:
    """Why another user can put a dir of their own at ``path``: a symbolic link on it that is
    not root's or this user's (its owner points it elsewhere at will), or a directory a name of
    it is looked up in that another user owns or can write to (without the sticky bit, as
    ``/dev/shm`` and ``/tmp`` have). Each component as given, up from ``/``, and the components
    of each link's target; None when every one is safe (``missing_ok``: also when a component
    does not exist yet, as before ``ensure`` creates it)."""
    todo = list((Path.cwd() / path).parts[1:])
    here, links = Path("/"), 0
    while todo:
        name = todo.pop(0)
        if name == "..":
            here = here.parent
            continue
        why = _holder_problem(path, here, euid)
        if why:
            return why
        at = here / name
        try:
            st = os.lstat(at)
        except FileNotFoundError as e:
            return None if missing_ok else f"dump dir {path}: {at} cannot be examined ({e})"
        except OSError as e:
            return f"dump dir {path}: {at} cannot be examined ({e})"
        if not stat.S_ISLNK(st.st_mode):
            here = at
            continue
        if st.st_uid not in (euid, 0):
            return _link_problem(path, at, st.st_uid)
        links += 1
        if links > _MAX_LINKS:
            return f"dump dir {path}: more than {_MAX_LINKS} symbolic links on its path (a loop)"
        target = Path(os.readlink(at))
        if target.is_absolute():
            here = Path("/")
        todo[:0] = target.parts[1:] if target.is_absolute() else target.parts
    return None


def _holder_problem(path: Path, d: Path, euid: int) -> str | None:
    """Why ``d``, a directory on the way to ``path``, lets another user replace what is in it."""
    try:
        st = os.stat(d)
    except OSError as e:
        return f"dump dir {path}: its parent {d} cannot be examined ({e})"
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in (euid, 0):
        return (f"dump dir {path} is under {d}, owned by uid {st.st_uid} "
                f"({_user(st.st_uid)}): that user can rename the dump dir away and put "
                f"one of their own at its path (forged hidden states). Use a dump dir "
                f"whose every parent is root's or this user's (e.g. /dev/shm/hsfarm-dumps), "
                f"or, as root: chown root {d}")
    if mode & (stat.S_IWOTH | stat.S_IWGRP) and not mode & stat.S_ISVTX:
        return (f"dump dir {path} is under {d} (mode {mode:04o}): others can write to it "
                f"and replace what lies below it: chmod go-w {d} (or chmod +t {d}), or "
                "use a dir under /dev/shm")
    return None


def _link_problem(path: Path, link: Path, uid: int) -> str:
    which = "" if link == Path.cwd() / path else f": {link}"  # the dump dir itself, or on its way
    return (f"dump dir {path}{which} is a symbolic link owned by uid {uid} ({_user(uid)}): "
            f"that user can point it elsewhere at any time, at a dir of their own (forged "
            f"hidden states). Give the dump dir by a path without their links (it leads to "
            f"{os.path.realpath(path)} now), or remove the link (as root): rm {link}")


def ensure(path: Path) -> os.stat_result:
    """Create the dump dir (0700) if it does not exist; refuse it if it is not safe.

    Raises:
        DumpDirUnsafe: another user owns it, others can write to it, ...; the fix is named.
        OSError: it cannot be created.
    """
    why = _path_problem(path, os.geteuid(), missing_ok=True)  # nothing made through a link
    if why:  # that another user can point anywhere
        raise DumpDirUnsafe(why)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, DIR_MODE)  # the umask cannot add bits; the check below sees the result
    return _trust(path)


def check(path: Path) -> os.stat_result:
    """``ensure`` without creating: for a reader (a worker, preflight) of an existing dir.

    Raises:
        DumpDirUnsafe: as ``ensure``.
        FileNotFoundError: it does not exist.
    """
    os.stat(path)
    return _trust(path)


# each dump dir (absolute path) this process checked -> the (st_dev, st_ino) that passed
_checked: dict[str, tuple[int, int]] = {}


def _trust(path: Path, seen: os.stat_result | None = None) -> os.stat_result:
    """Check ``path`` (``problem``) and remember the directory that passed, which must be
    ``seen`` (the one opened) when given: files are read and made only in that one."""
    why = problem(path)
    if why:
        raise DumpDirUnsafe(why)
    st = os.stat(path)
    if seen is not None and (st.st_dev, st.st_ino) != (seen.st_dev, seen.st_ino):
        raise DumpDirUnsafe(f"dump dir {path} was replaced while it was checked: someone "
                            f"renames directories there. Find out who (ls -la "
                            f"{path.absolute().parent}); then restart the server")
    _checked[os.path.abspath(path)] = (st.st_dev, st.st_ino)
    return st


def open_dir(path: Path) -> int:
    """A descriptor of the dump dir ``path``, the very directory that passed the checks (its
    device and inode) and still no one else's; another at that path is checked first, as at
    start-up. Opened per file, never held: a held descriptor of a dir deleted and made again
    would write and wait in the deleted one. The caller closes it.

    Raises:
        DumpDirUnsafe: the directory now at ``path`` fails the checks.
        OSError: it cannot be opened (FileNotFoundError: it is gone).
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        # Owner and mode at every open, not only device and inode: a disk file system (ext4)
        # gives a dir deleted and made again, by anyone, the number of the old one. Free (the
        # fstat is needed anyway), and a dump dir on disk, as the tests and the demo place it,
        # stays as safe as one on tmpfs, only slower (the launchers warn).
        why = _dir_problem(path, st, os.geteuid())
        if why:
            raise DumpDirUnsafe(why)
        if _checked.get(os.path.abspath(path)) != (st.st_dev, st.st_ino):
            _trust(path, st)
    except BaseException:
        os.close(fd)
        raise
    return fd


def file_mode(dir_st: os.stat_result) -> int:
    """The mode of a file of ours in the dump dir: 0640 in a shared group dir, else 0600."""
    return 0o640 if dir_st.st_mode & stat.S_ISGID else 0o600


def create_private(path: Path) -> int:
    """Create ``path`` (a new temp name of ours) with the dump dir's file mode, whatever the
    umask, and return its fd, open for writing; the caller renames it into place."""
    dir_fd = open_dir(path.parent)  # made in the dir that was checked, whatever the path
    try:
        mode = file_mode(os.fstat(dir_fd))
        with contextlib.suppress(FileNotFoundError):  # our own temp name, left by a process
            os.unlink(path.name, dir_fd=dir_fd)  # that had this pid
        fd = os.open(path.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (``create_private``); the caller renames it into place."""
    fd = create_private(path)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def seal(path: Path) -> None:
    """Give a file of ours (a temp file another library wrote) the dump dir's file mode,
    whatever the umask or that library chose, before it is renamed into place."""
    dir_fd = open_dir(path.parent)
    try:
        mode = file_mode(os.fstat(dir_fd))
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def open_trusted(path: Path) -> int:
    """Open a file of the dump dir for reading, in the directory that passed the checks
    (``open_dir``) without following a link, and check the opened descriptor: a regular file,
    one link, the dump dir's owner's or this user's (or its group's, in a group dir), writable
    by no one else. Returns the fd.

    Raises:
        DumpDirUnsafe: a link, another user's file, writable by others; or the dir fails the checks.
        OSError: it cannot be opened (FileNotFoundError: it, or the dump dir, is not there).
    """
    dir_fd = open_dir(path.parent)
    try:
        dir_st = os.fstat(dir_fd)
        fd = _open_in(dir_fd, path)
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        why = _file_problem(st, dir_st)
        if why:
            raise DumpDirUnsafe(_foreign(path, why))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_in(dir_fd: int, path: Path) -> int:
    try:
        return os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                       dir_fd=dir_fd)
    except OSError as e:
        with contextlib.suppress(OSError):
            if stat.S_ISLNK(os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                raise DumpDirUnsafe(_foreign(path, "is a symbolic link")) from e
        raise


def _file_problem(st: os.stat_result, dir_st: os.stat_result) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    group_dir = bool(dir_st.st_mode & stat.S_ISGID)
    ours = st.st_uid in (dir_st.st_uid, os.geteuid()) or (group_dir
                                                           and st.st_gid == dir_st.st_gid)
    if not ours:
        return (f"is owned by uid {st.st_uid} ({_user(st.st_uid)}), not by the dump dir's owner "
                f"(uid {dir_st.st_uid})")
    if st.st_nlink != 1:
        return f"has {st.st_nlink} hard links (a file of ours has one)"
    if stat.S_IMODE(st.st_mode) & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is mode {stat.S_IMODE(st.st_mode):04o}: others can write to it"
    return None


def _foreign(path: Path, why: str) -> str:
    return (f"{path} {why}: someone else writes into the dump dir {path.parent}, so its hidden "
            f"states cannot be trusted. Find out who (ls -la {path.parent}); then remove the "
            f"dir (rm -rf {path.parent}) and restart the server, which creates it 0700")


def main(argv: list[str] | None = None, prog: str = "python -m sglang_patch dumpdir") -> int:
    """``python -m sglang_patch dumpdir --dump-dir D [--create]`` (or ``vllm_hook``'s): OK/FAIL
    and the fix."""
    p = argparse.ArgumentParser(prog=prog,
                                description="Is the dump dir the server's and the workers' "
                                "alone? (--create: create it 0700 first, as the server does)")
    p.add_argument("--dump-dir", type=Path, required=True)
    p.add_argument("--create", action="store_true")
    args = p.parse_args(argv)
    d: Path = args.dump_dir
    if not args.create and not os.path.lexists(d):
        print(f"OK    dump dir {d} does not exist yet: the server creates it 0700")
        return 0
    try:
        st = ensure(d) if args.create else check(d)
    except (DumpDirUnsafe, OSError) as e:
        print(f"FAIL  {e}")
        return 1
    print(f"OK    dump dir {d}: owner {_user(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o}")
    return 0
