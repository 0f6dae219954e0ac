"""What `fleet check` runs on each host, with the job's interpreter: `python -c SOURCE facts|health JSON`.

Self-contained on purpose (standard library only; torch imported by `health` alone): it is sent as source, so
it tells the truth about a host whose toolkit is missing or another version, which is one of the things it is
asked. It prints one JSON document on stdout; the decisions about what the facts mean are in
toolkit.launcher.check.decide, on the machine that asked.

`facts` (one Python start, no torch import: versions come from the installed distributions' metadata):
  clock, python, torch, toolkit, the source address toward MASTER_ADDR, the watched environment variables,
  manifests (file count, bytes, digest of sizes and SHA-256s) of the project copy and of each data path, free
  disk at the checkpoint directory, and whether the scheduler's ports can be bound (else who holds them).
  A manifest is cached per path in the host's ~/.cache/toolkit/manifests/: a file whose size and mtime match
  the cache is not read again, so a second check of unchanged data costs a directory walk.
`health`: a matmul loop, timed, then for each pair this host is in (in round order) a 2-rank gloo group on its
  own TCPStore, one all-reduce to warm up and a timed loop of small all-reduces whose sums are verified.
"""

import fnmatch
import hashlib
import json
import os
import platform
import socket
import sys
import time

CACHE_DIR = "~/.cache/toolkit/manifests"
HASH_CHUNK = 1 << 20  # bytes read at a time while hashing
TCP_LISTEN = "0A"  # state of a listening socket in /proc/net/tcp


def _dist_version(name):
    """The installed version of a distribution (what pip would report), without importing it; or an error."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except Exception as e:  # noqa: BLE001 - any failure is the fact reported
        return f"missing ({type(e).__name__})"


def _source_address(host):
    """The local address the kernel would use toward `host` (UDP connect: no packet is sent), or None."""
    if not host:
        return None
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(addr)
                return s.getsockname()[0]
        except OSError:
            continue
    return None


def _excluded(rel, exclude):
    return any(fnmatch.fnmatch(part, pat) for part in rel.split("/") for pat in exclude)


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest(path, exclude=(), cache_dir=CACHE_DIR):
    """{"files", "bytes", "digest", "hashed"} of a file or directory tree, or {"error"}.

    The digest covers each file's path relative to `path`, size and SHA-256 (not mtimes, which differ between
    copies). Symlinks that lead out of the tree are left out (deploy never copies them); names matching
    `exclude` are skipped. `hashed` counts the files actually read: the others matched the cache on size and
    mtime. The cache is written atomically; failing to write it is not an error. `cache_dir` None: no cache."""
    root = os.path.realpath(os.path.expanduser(path))
    if not os.path.exists(root):
        return {"error": "missing"}
    entries = _entries(root, exclude)
    cache_file = None
    cache = {}
    if cache_dir is not None:
        cache_file = os.path.join(os.path.expanduser(cache_dir), hashlib.sha256(root.encode()).hexdigest() + ".json")
        cache = _read_cache(cache_file)
    fresh = {}
    hashed = total = 0
    digest = hashlib.sha256()
    for rel, full in sorted(entries):
        try:
            st = os.stat(full)
            known = cache.get(rel)
            if isinstance(known, list) and len(known) == 3 and known[:2] == [st.st_size, st.st_mtime_ns]:
                sha = known[2]
            else:
                sha = _sha256(full)
                hashed += 1
        except OSError as e:
            return {"error": f"{rel}: {e.strerror}"}
        fresh[rel] = [st.st_size, st.st_mtime_ns, sha]
        total += st.st_size
        digest.update(f"{rel}\0{st.st_size}\0{sha}\n".encode())
    if cache_file is not None and fresh != cache:
        _write_cache(cache_file, fresh)
    return {"files": len(entries), "bytes": total, "digest": digest.hexdigest(), "hashed": hashed}


def _entries(root, exclude):
    """[(path relative to `root`, full path)] of the files a manifest covers: `root` itself if it is a file, else
    every file of the tree in walk order, less names matching `exclude` and symlinks that lead out of the tree."""
    if os.path.isfile(root):
        return [(os.path.basename(root), root)]
    entries = []
    for top, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not _excluded(d, exclude))
        for name in sorted(files):
            full = os.path.join(top, name)
            rel = os.path.relpath(full, root)
            if _excluded(rel, exclude):
                continue
            if os.path.islink(full) and not os.path.realpath(full).startswith(root + os.sep):
                continue
            entries.append((rel, full))
    return entries


def _read_cache(cache_file):
    """The cached {rel: [size, mtime_ns, sha256]} of one tree; {} when there is none or it is damaged."""
    try:
        with open(cache_file) as f:
            cache = json.load(f)
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _write_cache(cache_file, fresh):
    """Replace the cache with `fresh`, atomically (a temp file renamed over it); failing to write is no error: the
    next check reads the files again."""
    try:
        os.makedirs(os.path.dirname(cache_file), mode=0o700, exist_ok=True)
        tmp = f"{cache_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(fresh, f)
        os.replace(tmp, cache_file)
    except OSError:
        pass


def _listener(port):
    """(pid, command) of the process listening on TCP `port` here, found through /proc; (None, None) if unseen."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == TCP_LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None, None
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                    return int(pid), command
            except OSError:
                continue
    return None, None


def _own_scheduler_pid(job_dir):
    """The pid of this job's scheduler as its agent recorded it (state/agent.json), if it is running."""
    try:
        with open(os.path.join(job_dir, "state", "agent.json")) as f:
            doc = json.load(f)
        for p in doc.get("processes") or []:
            if p.get("node_id") == "sched" and p.get("state") == "running" and isinstance(p.get("pid"), int):
                return p["pid"]
    except (OSError, ValueError, AttributeError):
        pass
    return None


def ports(wanted, job_dir):
    """{port: {"free", "pid", "command", "ours"}}: whether each port can be bound on every IPv4 interface, else
    who listens there, and whether that is this job's own running scheduler."""
    out = {}
    ours = _own_scheduler_pid(job_dir)
    for port in wanted:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            out[str(port)] = {"free": True, "pid": None, "command": None, "ours": False}
            continue
        except OSError:
            pass
        finally:
            s.close()
        pid, command = _listener(port)
        out[str(port)] = {"free": False, "pid": pid, "command": command, "ours": pid is not None and pid == ours}
    return out


def free_disk(path):
    """Bytes available to this user at `path` (or its nearest existing parent), or None."""
    path = os.path.expanduser(path)
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        st = os.statvfs(path or "/")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def watched_env(names, prefixes):
    """The environment variables that change torch, gloo or NCCL behaviour, as this process has them."""
    return {k: v for k, v in sorted(os.environ.items()) if k in names or any(k.startswith(p) for p in prefixes)}


def facts(args):
    """Everything `facts` reports (see the module's docstring)."""
    clock = time.time()
    return {
        "clock": clock,
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": _dist_version("torch"),
        "toolkit": _dist_version("toolkit"),
        "address": _source_address(os.environ.get("MASTER_ADDR")),
        "env": watched_env(set(args["env_names"]), tuple(args["env_prefixes"])),
        "project": manifest(args["project"], args["exclude"]) if args.get("project") else None,
        "data": {p: manifest(os.path.join(args["project"] or "", p)) for p in args["data"]},
        "disk": {"path": args["disk_path"], "free": free_disk(args["disk_path"])},
        "ports": ports(args["ports"], args["job_dir"]),
    }


def _interface_toward(address):
    """The interface whose address is the source toward `address` (what gloo must bind to), or None."""
    import fcntl
    import struct

    mine = _source_address(address)
    if mine is None:
        return None
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                reply = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
        if socket.inet_ntoa(reply[20:24]) == mine:
            return name
    return None


def health(args):
    """A timed matmul, then this host's pairs in round order: {"matmul": s, "pairs": {peer: {"seconds"} or
    {"error"}}}. Each pair's rendezvous must be done by its round's deadline (seconds from this program's start),
    so a broken peer costs its partners one bounded wait and never shifts later rounds."""
    began = time.monotonic()
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    n, iters, reps = args["matmul_size"], args["matmul_iters"], args["matmul_reps"]
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    a @ b
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iters):
            a @ b
        times.append(time.perf_counter() - t)
    out = {"matmul": sorted(times)[len(times) // 2], "pairs": {}}
    if args["pairs"] and "GLOO_SOCKET_IFNAME" not in os.environ:
        ifname = _interface_toward(args["pairs"][0]["store"])
        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname  # this throwaway process's own environment, read by gloo
    for pair in args["pairs"]:
        left = pair["deadline"] - (time.monotonic() - began)
        try:
            if left <= 0:
                raise TimeoutError("its round's deadline passed before it began")
            timeout = timedelta(seconds=left)
            store = dist.TCPStore(pair["store"], pair["port"], 2, pair["rank"] == 0, timeout=timeout)
            dist.init_process_group("gloo", store=store, rank=pair["rank"], world_size=2, timeout=timeout)
            try:
                x = torch.full((args["allreduce_size"],), float(pair["rank"] + 1))
                dist.all_reduce(x)
                t = time.perf_counter()
                for _ in range(args["allreduce_iters"]):
                    x = torch.full((args["allreduce_size"],), float(pair["rank"] + 1))
                    dist.all_reduce(x)
                seconds = time.perf_counter() - t
                if not bool((x == 3.0).all()):
                    raise ValueError(f"all-reduce gave a wrong sum ({float(x[0])} instead of 3.0)")
                dist.barrier()
            finally:
                dist.destroy_process_group()
                del store
            out["pairs"][pair["peer"]] = {"seconds": seconds}
        except Exception as e:  # noqa: BLE001 - any failure is the fact reported
            text = " ".join(str(e).split())[:300]
            out["pairs"][pair["peer"]] = {"error": f"{type(e).__name__}: {text}"}
    return out


def main(argv):
    mode, args = argv[1], json.loads(argv[2])
    result = facts(args) if mode == "facts" else health(args)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main(sys.argv)
