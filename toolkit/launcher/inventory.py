"""Host sources -> Inventory: `--hosts` (mpirun -H), `--hostfile` (OpenMPI), `--inventory` (Ansible INI/YAML).

Parsing is pure but for reading the named file; every malformed input raises InventoryError with one line that
names the file and line (or the --hosts item), what is wrong and what to do.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from toolkit.contracts.protocol import is_int
from toolkit.errors import UserError

LOCALHOST = "localhost"

# Whole-string patterns, always used with fullmatch: `$` with match would accept a trailing newline.
_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?")
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9._-]*")
_SCOPE = re.compile(r"[A-Za-z0-9._-]+")  # an IPv6 zone (interface name or index)
_SLOTS_HELP = "slots must be a whole number of at least 1"
MAX_SLOTS = 4096  # workers on one host: more is a typo, and would only make the planner eat memory


class InventoryError(UserError):
    """A host source is malformed; the message is the one line shown to the user."""


@dataclass(frozen=True)
class Host:
    """One machine of the cluster, with what toolkit needs to reach it and to place processes on it.

    `slots` is the number of workers it runs (1 to MAX_SLOTS); `workdir` and `python`, when set, override --workdir
    and --python for this host. Construction raises InventoryError for bad slots or an SSH port outside 1-65535."""

    name: str
    slots: int = 1
    address: str | None = None  # where peers and SSH reach it (ansible_host); None: the name
    port: int | None = None  # SSH port; None: ssh_config or 22
    user: str | None = None
    key_file: str | None = None
    workdir: str | None = None
    python: str | None = None
    max_slots: int | None = None

    def __post_init__(self) -> None:
        if not is_int(self.slots) or self.slots < 1:
            raise InventoryError(f"host {self.name}: slots={self.slots!r}: {_SLOTS_HELP}")
        if self.slots > MAX_SLOTS:
            raise InventoryError(f"host {self.name}: slots={self.slots}: more than {MAX_SLOTS} workers on one host; "
                                 "give the number of processes the host really runs")
        if self.port is not None and not 1 <= self.port <= 65535:
            raise InventoryError(f"host {self.name}: SSH port {self.port} is outside 1-65535")

    @property
    def reach(self) -> str:
        """The address other hosts and SSH use for this host."""
        return (self.address or self.name).removeprefix("[").removesuffix("]")


@dataclass(frozen=True)
class Inventory:
    """Hosts in order (ranks follow this order), with the scheduler's host and the hosts held in reserve.

    `workers` run the ranks, `spares` (Ansible group) are held in reserve, `scheduler` names the host of the
    scheduler; every name refers to a host of `hosts`, and there is at least one worker host (InventoryError at
    construction otherwise). `source` names where it came from in messages ("--hosts", a file path, "local");
    `note`, when set, is said with the plan and at deploy: where the hosts came from when no flag shows it (a Slurm
    allocation picked up from the environment) and how processes are started there."""

    hosts: tuple[Host, ...]
    scheduler: str
    workers: tuple[str, ...]
    spares: tuple[str, ...] = ()
    source: str = "--hosts"
    local: bool = False
    note: str = ""
    _by_name: Mapping[str, Host] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_name = {h.name: h for h in self.hosts}
        object.__setattr__(self, "_by_name", by_name)
        if not self.workers:
            raise InventoryError(f"{self.source}: no worker hosts; list at least one host (group 'workers')")
        for role, names in (("scheduler", (self.scheduler,)), ("workers", self.workers), ("spares", self.spares)):
            unknown = [n for n in names if n not in by_name]
            if unknown:
                raise InventoryError(f"{self.source}: {role} names unknown host {unknown[0]}; define it first")

    def host(self, name: str) -> Host:
        """The host called `name`; InventoryError if the inventory has none."""
        try:
            return self._by_name[name]
        except KeyError:
            raise InventoryError(f"{self.source}: no host named {name!r}") from None

    @property
    def worker_hosts(self) -> tuple[Host, ...]:
        """The worker hosts, in `workers` order (the order ranks are assigned in)."""
        return tuple(self._by_name[n] for n in self.workers)

    def with_hosts(self, hosts: Iterable[Host]) -> Inventory:
        """The same inventory with some hosts replaced (by name), e.g. with addresses or workdirs resolved."""
        new = {h.name: h for h in hosts}
        return replace(self, hosts=tuple(new.get(h.name, h) for h in self.hosts))


def local_inventory(slots: int) -> Inventory:
    """The inventory of a job that runs on this machine without SSH."""
    host = Host(name=LOCALHOST, slots=slots, address="127.0.0.1")
    return Inventory(hosts=(host,), scheduler=LOCALHOST, workers=(LOCALHOST,), source="local", local=True)


# --- --hosts -------------------------------------------------------------------------------------------------


def parse_hosts(text: str) -> Inventory:
    """mpirun -H syntax, `[user@]host[:slots]` comma-separated; a host named twice adds its slots (as OpenMPI)."""
    items = text.split(",")
    hosts: dict[str, Host] = {}
    for index, raw in enumerate(items, 1):
        item = raw.strip()
        where = f"--hosts item {index} ({item!r})" if item else f"--hosts item {index}"
        if not item:
            raise InventoryError(f"{where}: empty; write host[:slots] items separated by single commas")
        user, name, slots = _split_host_item(item, where)
        _merge_host(hosts, Host(name=name, slots=slots, user=user), where)
    return _flat_inventory(hosts, "--hosts")


def split_host_item(item: str, where: str) -> tuple[str | None, str, int | None]:
    """One `[user@]host[:slots]` (`fleet grow --host`): user, name and slots (None: not given); InventoryError,
    starting with `where`, if malformed."""
    user, name, slots = _split_host_item(item, where)
    given = re.fullmatch(r"(?:[^@]*@)?(?:\[[^\]]*\]|[^:\[]*):.*", item) is not None
    return user, name, slots if given else None


def _split_host_item(item: str, where: str) -> tuple[str | None, str, int]:
    """`[user@]host[:slots]`; IPv6 addresses in brackets (`[fe80::1]:4`) since ':N' means slots here."""
    user, rest = _split_user(item, where)
    m = re.fullmatch(r"(\[[^\]]*\])(?::(.*))?", rest)
    if m:
        name, slots_text = m.group(1), m.group(2)
    else:
        name, sep, slots_text = rest.partition(":")
        if sep and ":" in slots_text:
            raise InventoryError(f"{where}: too many ':'; write host:slots (put IPv6 addresses in brackets)")
        slots_text = slots_text if sep else None
    check_name(name, where)
    slots = 1 if slots_text is None else _parse_slots(slots_text, where + ": slots")
    return user, name, slots


def _split_user(item: str, where: str) -> tuple[str | None, str]:
    if "@" not in item:
        return None, item
    user, _, rest = item.partition("@")
    if not _USER.fullmatch(user):
        raise InventoryError(f"{where}: {user!r} is not a user name; write user@host")
    return user, rest


def check_name(name: str, where: str) -> None:
    """InventoryError naming `where` unless `name` is a host name or address toolkit accepts (letters, digits,
    '.', '-', '_'; an IPv6 address in brackets): names end up in ssh argv and rendered files."""
    if _NAME.fullmatch(name) or _is_ipv6(name.removeprefix("[").removesuffix("]")):
        return
    raise InventoryError(
        f"{where}: {name!r} is not a host name or address (letters, digits, '.', '-', '_'; IPv6 in brackets)"
    )


def _is_ipv6(text: str) -> bool:
    """An IPv6 address, with at most a zone of letters, digits, '.', '_' or '-' (ipaddress takes any zone text,
    a newline included)."""
    _, percent, zone = text.partition("%")
    if percent and not _SCOPE.fullmatch(zone):
        return False
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def _parse_slots(text: str, where: str) -> int:
    text = text.strip()
    if not re.fullmatch(r"[0-9]+", text):
        raise InventoryError(f"{where}={text!r}: {_SLOTS_HELP}")
    value = int(text)
    if value < 1:
        raise InventoryError(f"{where}={value}: {_SLOTS_HELP}")
    return value


def _merge_host(hosts: dict[str, Host], new: Host, where: str) -> None:
    old = hosts.get(new.name)
    if old is None:
        hosts[new.name] = new
        return
    for attr in ("user", "address", "port", "key_file", "workdir", "python"):
        a, b = getattr(old, attr), getattr(new, attr)
        if a is not None and b is not None and a != b:
            raise InventoryError(
                f"{where}: host {new.name} listed again with {attr} {b!r}, before {a!r}; keep one {attr} per host"
            )
    max_slots = None
    if old.max_slots is not None or new.max_slots is not None:
        max_slots = (old.max_slots or old.slots) + (new.max_slots or new.slots)
    hosts[new.name] = Host(
        name=new.name,
        slots=old.slots + new.slots,
        user=old.user or new.user,
        max_slots=max_slots,
    )


def _flat_inventory(hosts: dict[str, Host], source: str) -> Inventory:
    if not hosts:
        raise InventoryError(f"{source}: no hosts; list at least one host")
    names = tuple(hosts)
    return Inventory(hosts=tuple(hosts.values()), scheduler=names[0], workers=names, source=source)


# --- --hostfile ----------------------------------------------------------------------------------------------


def parse_hostfile_text(text: str, path: str) -> Inventory:
    """OpenMPI hostfile: `host [slots=N] [max_slots=M]`, '#' comments; a host listed twice adds its slots."""
    hosts: dict[str, Host] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{lineno}"
        token, *words = line.split()
        user, name = _split_user(token, where)
        if ":" in name and not _is_ipv6(name.removeprefix("[").removesuffix("]")):
            raise InventoryError(f"{where}: {token!r}: a hostfile gives slots as 'slots=N', not 'host:N'")
        check_name(name, where)
        slots, max_slots = 1, None
        seen: set[str] = set()
        for word in words:
            key, sep, value = word.partition("=")
            key = key.replace("-", "_")
            if not sep:
                raise InventoryError(f"{where}: {word!r}: expected keyword=value (slots=N or max_slots=M)")
            if key in seen:
                raise InventoryError(f"{where}: {key} given twice for {name}")
            seen.add(key)
            if key in ("slots", "count", "cpu"):
                slots = _parse_slots(value, f"{where}: {key}")
            elif key == "max_slots":
                max_slots = _parse_slots(value, f"{where}: max_slots")
            else:
                raise InventoryError(f"{where}: unknown keyword {key!r}; "
                                     "a hostfile line is: host slots=N [max_slots=M]")
        if max_slots is not None and slots > max_slots:
            raise InventoryError(f"{where}: slots={slots} exceeds max_slots={max_slots} for {name}")
        _merge_host(hosts, Host(name=name, slots=slots, user=user, max_slots=max_slots), where)
    if not hosts:
        raise InventoryError(f"{path}: no hosts in the hostfile; add lines like 'node1 slots=4'")
    return _flat_inventory(hosts, path)


def load_hostfile(path: str | Path) -> Inventory:
    """Read and parse an OpenMPI hostfile (see parse_hostfile_text); InventoryError, naming the file, if it is
    missing, unreadable, not UTF-8 or malformed."""
    return parse_hostfile_text(_read(path, "hostfile"), str(path))


def _read(path: str | Path, what: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InventoryError(f"{path}: {what} not found; check the path") from None
    except IsADirectoryError:
        raise InventoryError(f"{path}: is a directory, not a {what} file") from None
    except PermissionError:
        raise InventoryError(f"{path}: {what} is not readable (permission denied)") from None
    except UnicodeDecodeError as e:
        raise InventoryError(f"{path}: {what} is not UTF-8 text (byte {e.start})") from None


# --- --inventory (Ansible) -----------------------------------------------------------------------------------

RECOGNISED_VARS = (
    "ansible_host",
    "ansible_port",
    "ansible_user",
    "ansible_ssh_private_key_file",
    "slots",
    "workdir",
    "python",
)


def load_ansible_inventory(path: str | Path) -> Inventory:
    """Parse with ansible-core's own INI/YAML plugins, so groups, children, ranges and vars mean what they do in
    Ansible; then read toolkit's groups (scheduler, workers, spares) and vars."""
    path = Path(path).absolute()
    _read(path, "inventory")  # one clear line for a missing or unreadable file before Ansible sees it
    with _ansible_patches():
        data = _ansible_parse(path)
        return _inventory_from_ansible(data, str(path))


@contextlib.contextmanager
def _ansible_patches() -> Iterator[None]:
    """ansible-core (2.19+) replaces `sys.intern` and `socket.getaddrinfo` process-wide on import, to accept its
    tagged str/int subclasses; torch refuses the replaced `sys.intern` when it loads its compiler. So Ansible gets
    its versions only while it parses, and the rest of the process keeps the originals."""
    saved = sys.intern, socket.getaddrinfo
    try:
        from ansible.module_utils._internal._patches import _socket_patch, _sys_intern_patch
    except ImportError:  # older ansible-core patches nothing
        patches: tuple[Any, ...] = ()
    else:
        patches = (_sys_intern_patch.SysInternPatch, _socket_patch.GetAddrInfoPatch)
    for patch in patches:
        patch.patch()  # idempotent; re-applies what a previous call restored
    try:
        yield
    finally:
        sys.intern, socket.getaddrinfo = saved


def _ansible_parse(path: Path) -> Any:
    from ansible.inventory.data import InventoryData
    from ansible.parsing.dataloader import DataLoader

    data = _RecordingInventoryData()
    yaml_file = path.suffix in (".yml", ".yaml", ".json")
    plugin = _yaml_plugin() if yaml_file else _ini_plugin()
    try:
        plugin.parse(data, DataLoader(), str(path), cache=False)
        InventoryData.reconcile_inventory(data)
    except Exception as e:  # noqa: BLE001 - Ansible raises AnsibleParserError, ValueError, ...: all mean a malformed file
        cause = e.__cause__ or e
        message = str(cause).splitlines()[0].removeprefix("Failed to parse inventory: ")
        line = getattr(plugin, "error_line", None) or (_yaml_error_line(path) if yaml_file else None)
        where = f"{path}:{line}" if line else str(path)
        raise InventoryError(f"{where}: not a valid Ansible inventory: {message}") from None
    if data.conflict:
        host, var, a, b = data.conflict
        raise InventoryError(f"{path}: host {host} is defined twice with {var}={a!r} and {var}={b!r}; keep one")
    return data


def _ini_plugin() -> Any:
    from ansible.plugins.inventory import ini

    class IniWithLines(ini.InventoryModule):
        """Ansible's INI plugin forgets the line of an error before it reports it; remember it."""

        error_line: int | None = None

        def _parse(self, lines: list[str]) -> None:
            try:
                super()._parse(lines)
            except Exception:
                self.error_line = self._origin.line_num
                raise

    return IniWithLines()


def _yaml_plugin() -> Any:
    from ansible.plugins.loader import inventory_loader

    return inventory_loader.get("yaml")


def _yaml_error_line(path: Path) -> int | None:
    import yaml

    try:
        yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.MarkedYAMLError as e:
        return e.problem_mark.line + 1 if e.problem_mark else None
    except (OSError, UnicodeError, yaml.YAMLError):
        return None
    return None


def _RecordingInventoryData() -> Any:
    from ansible.inventory.data import InventoryData

    class Recording(InventoryData):
        """Notes a host var set twice to different values (e.g. a host listed in two groups): Ansible would
        silently keep the last one, which for slots or ansible_host is a mistake worth stopping on."""

        def __init__(self) -> None:
            super().__init__()
            self.conflict: tuple[str, str, Any, Any] | None = None

        def set_variable(self, entity: str, varname: str, value: Any) -> None:
            if entity in self.hosts and varname in RECOGNISED_VARS and self.conflict is None:
                old = self.hosts[entity].vars.get(varname, value)
                if old != value:
                    self.conflict = (entity, str(varname), old, value)
            super().set_variable(entity, varname, value)

    return Recording()


def _inventory_from_ansible(data: Any, source: str) -> Inventory:
    from ansible.inventory.helpers import get_group_vars
    from ansible.utils.vars import combine_vars

    all_names = [h.name for h in data.groups["all"].get_hosts()]
    if not all_names:
        raise InventoryError(f"{source}: the inventory has no hosts; add hosts under a group such as [workers]")

    def group(name: str) -> list[str] | None:
        g = data.groups.get(name)
        return None if g is None else [h.name for h in g.get_hosts()]

    spares = group("spares") or []
    workers = group("workers")
    if workers is None:
        workers = [n for n in all_names if n not in spares]
    if not workers:
        where = "group 'workers' is empty" if group("workers") is not None else "every host is a spare"
        raise InventoryError(f"{source}: no worker hosts ({where}); add hosts to [workers]")
    overlap = [n for n in workers if n in spares]
    if overlap:
        raise InventoryError(f"{source}: host {overlap[0]} is in both 'workers' and 'spares'; keep it in one")
    scheduler = group("scheduler")
    if scheduler is not None and len(scheduler) != 1:
        found = ", ".join(scheduler) or "none"
        raise InventoryError(f"{source}: group 'scheduler' must name exactly one host (found: {found})")

    hosts = []
    for name in all_names:
        h = data.hosts[name]
        merged = combine_vars(get_group_vars(h.get_groups()), h.get_vars())
        hosts.append(_host_from_vars(name, merged, f"{source}: host {name}"))
    return Inventory(
        hosts=tuple(hosts),
        scheduler=scheduler[0] if scheduler else workers[0],
        workers=tuple(workers),
        spares=tuple(spares),
        source=source,
    )


def _host_from_vars(name: str, v: Mapping[str, Any], where: str) -> Host:
    check_name(name, where)

    def text(key: str) -> str | None:
        value = v.get(key)
        if value is None:
            return None
        if not (isinstance(value, str) or is_int(value)) or str(value).strip() == "":
            raise InventoryError(f"{where}: {key}={value!r} must be a non-empty string")
        return str(value)

    def number(key: str, default: int | None, lo: int, hi: int, hint: str) -> int | None:
        value = v.get(key, default)
        if value is None:
            return None
        if isinstance(value, str) and re.fullmatch(r"\s*[0-9]+\s*", value):
            value = int(value)
        if not is_int(value) or not lo <= value <= hi:
            raise InventoryError(f"{where}: {key}={value!r}: {hint}")
        return value

    slots = number("slots", 1, 1, 1 << 20, _SLOTS_HELP)
    port = number("ansible_port", None, 1, 65535, "the SSH port must be a number from 1 to 65535")
    address = text("ansible_host")
    if address is not None:
        check_name(address, f"{where}: ansible_host")
    user = text("ansible_user")
    if user is not None and not _USER.fullmatch(user):
        raise InventoryError(f"{where}: ansible_user={user!r} is not a user name")
    if slots is None:  # set above on every path that reaches here
        raise RuntimeError(f"{where}: no slots")
    return Host(
        name=name,
        slots=slots,
        address=address,
        port=port,
        user=user,
        key_file=text("ansible_ssh_private_key_file"),
        workdir=text("workdir"),
        python=text("python"),
    )
