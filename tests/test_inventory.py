from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit.launcher.inventory import (
    InventoryError,
    load_ansible_inventory,
    load_hostfile,
    parse_hostfile_text,
    parse_hosts,
    split_host_item,
)

# (--hosts value, expected message fragment)
BAD_HOSTS = [
    ("", "--hosts item 1: empty"),
    ("a,,b", "--hosts item 2: empty"),
    ("a,", "--hosts item 2: empty"),
    ("a:0", "item 1 ('a:0'): slots=0: slots must be a whole number of at least 1"),
    ("a:-1", "slots='-1': slots must be a whole number"),
    ("a:two", "slots='two'"),
    ("a:1.5", "slots='1.5'"),
    ("a:", "slots='': slots must be"),
    ("a:1:2", "too many ':'; write host:slots (put IPv6 addresses in brackets)"),
    ("fe80::1:2", "too many ':'"),
    ("bad host", "'bad host' is not a host name or address"),
    ("a;rm -rf /", "is not a host name or address"),
    ("-oProxyCommand=x", "'-oProxyCommand=x' is not a host name"),
    ("@a", "'' is not a user name; write user@host"),
    ("al ice@a", "'al ice' is not a user name"),
    ("alice@a,bob@a", "item 2 ('bob@a'): host a listed again with user 'bob', before 'alice'"),
    ("[zz]:2", "'[zz]' is not a host name"),
    ("a.", "'a.' is not a host name"),
    ("node1\n:2", "'node1\\n' is not a host name"),  # `$` with match let a trailing newline by
    ("bob\n@a", "'bob\\n' is not a user name"),
    ("[fe80::1%eth0\n]:2", "is not a host name"),  # ipaddress takes any zone text
]


@pytest.mark.parametrize("text,expected", [
    ("node9", (None, "node9", None)), ("node9:2", (None, "node9", 2)), ("bob@node9:3", ("bob", "node9", 3)),
    ("[fe80::1]", (None, "[fe80::1]", None)), ("[fe80::1]:2", (None, "[fe80::1]", 2)),
])
def test_one_grow_host_says_whether_slots_were_given(text: str, expected: tuple[object, ...]) -> None:
    assert split_host_item(text, "--host") == expected  # `fleet grow --host`: no :SLOTS means the lost host's count


@pytest.mark.parametrize("text", ["node9,node8", "node9:0", "bad host", "-oProxyCommand=x"])
def test_a_bad_grow_host_is_one_line_naming_the_flag(text: str) -> None:
    with pytest.raises(InventoryError, match=r"^--host: ") as e:
        split_host_item(text, "--host")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text,message", BAD_HOSTS)
def test_bad_hosts_items_are_named_with_the_fix(text: str, message: str) -> None:
    with pytest.raises(InventoryError) as e:
        parse_hosts(text)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


BAD_HOSTFILES = [
    ("a slots=0\n", "hf:1: slots=0: slots must be a whole number of at least 1"),
    ("# c\na slots=x\n", "hf:2: slots='x'"),
    ("a slots=-2\n", "hf:1: slots='-2'"),
    ("a slot=2\n", "hf:1: unknown keyword 'slot'; a hostfile line is: host slots=N [max_slots=M]"),
    ("a gpus=2\n", "unknown keyword 'gpus'"),
    ("a slots\n", "hf:1: 'slots': expected keyword=value"),
    ("a slots=2 slots=3\n", "hf:1: slots given twice for a"),
    ("a slots=4 max_slots=2\n", "hf:1: slots=4 exceeds max_slots=2 for a"),
    ("a max_slots=0\n", "hf:1: max_slots=0"),
    ("a:4\n", "hf:1: 'a:4': a hostfile gives slots as 'slots=N', not 'host:N'"),
    ("", "hf: no hosts in the hostfile; add lines like 'node1 slots=4'"),
    ("# only comments\n\n   \n", "hf: no hosts in the hostfile"),
    ("alice@a\nbob@a slots=2\n", "hf:2: host a listed again with user 'bob', before 'alice'"),
    ("-oProxyCommand=x slots=1\n", "hf:1: '-oProxyCommand=x' is not a host name"),
    ("a b\n", "hf:1: 'b': expected keyword=value"),
]


@pytest.mark.parametrize("text,message", BAD_HOSTFILES)
def test_bad_hostfiles_name_file_and_line(text: str, message: str) -> None:
    with pytest.raises(InventoryError) as e:
        parse_hostfile_text(text, "hf")
    assert message in str(e.value)


def test_hostfile_that_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="hostfile not found; check the path"):
        load_hostfile(tmp_path / "missing")
    with pytest.raises(InventoryError, match="is a directory, not a hostfile file"):
        load_hostfile(tmp_path)
    binary = tmp_path / "bin"
    binary.write_bytes(b"a slots=1\n\xff\xfe\n")
    with pytest.raises(InventoryError, match="is not UTF-8 text"):
        load_hostfile(binary)


BAD_INVENTORIES = [
    ("[workers\nfoo\n", ":1: not a valid Ansible inventory"),
    ("[workers]\nfoo bar\n",
     ":2: not a valid Ansible inventory: Expected key=value host variable assignment, got: bar"),
    ("[workers:children]\nnope\n",
     "not a valid Ansible inventory: Section [workers:children] includes undefined group 'nope'"),
    ("", "the inventory has no hosts; add hosts under a group such as [workers]"),
    ("[workers]\na slots=0\n", "host a: slots=0: slots must be a whole number of at least 1"),
    ("[workers]\na slots=abc\n", "host a: slots='abc'"),
    ("[workers]\na ansible_port=70000\n", "host a: ansible_port=70000: the SSH port must be a number from 1 to 65535"),
    ("[workers]\na ansible_user='b c'\n", "host a: ansible_user='b c' is not a user name"),
    ("[workers]\na ansible_host='x;y'\n", "ansible_host: 'x;y' is not a host name"),
    ("[scheduler]\na\nb\n[workers]\na\n", "group 'scheduler' must name exactly one host (found: a, b)"),
    ("[spares]\na\n[workers]\na\n", "host a is in both 'workers' and 'spares'; keep it in one"),
    ("[spares]\na\n", "no worker hosts"),
    ("[x]\nn1 slots=2\n[y]\nn1 slots=4\n", "host n1 is defined twice with slots=2 and slots=4; keep one"),
    ("[workers]\na workdir=''\n", "host a: workdir='' must be a non-empty string"),
]


@pytest.mark.parametrize("text,message", BAD_INVENTORIES)
def test_bad_ini_inventories(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "inventory.ini"
    path.write_text(text)
    with pytest.raises(InventoryError) as e:
        load_ansible_inventory(path)
    assert message in str(e.value)
    assert str(path) in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_yaml_inventory_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "inventory.yml"
    path.write_text("all:\n  hosts:\n    a: {slots: 2\n  children: {}\n")
    with pytest.raises(InventoryError, match=r"inventory.yml:\d+: not a valid Ansible inventory"):
        load_ansible_inventory(path)


def test_missing_inventory(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="inventory not found; check the path"):
        load_ansible_inventory(tmp_path / "nope.ini")


def test_hosts_syntax() -> None:
    inv = parse_hosts("node1:4,alice@node2:2,node3,[fe80::1]:2,node1:2")
    assert [(h.name, h.slots, h.user) for h in inv.hosts] == [
        ("node1", 6, None),
        ("node2", 2, "alice"),
        ("node3", 1, None),
        ("[fe80::1]", 2, None),
    ]
    assert inv.scheduler == "node1"
    assert inv.host("[fe80::1]").reach == "fe80::1"


def test_hostfile_syntax_adds_repeated_hosts_like_openmpi() -> None:
    inv = parse_hostfile_text("a slots=2 max_slots=4  # two GPUs\n\nb\nfe80::2 slots=3\na slots=1\n", "hf")
    assert [(h.name, h.slots, h.max_slots) for h in inv.hosts] == [("a", 3, 5), ("b", 1, None), ("fe80::2", 3, None)]


def test_ansible_groups_ranges_and_vars(tmp_path: Path) -> None:
    path = tmp_path / "inv.ini"
    path.write_text(
        "[all:vars]\npython=/opt/py/bin/python\nworkdir=/srv/jobs\n"
        "[scheduler]\nhead\n"
        "[gpu]\nnode[01:03] slots=2\n"
        "[big]\nnode04 ansible_host=10.0.0.4 ansible_port=2222 ansible_user=ml slots=4 "
        "ansible_ssh_private_key_file=/k/id\n"
        "[workers:children]\ngpu\nbig\n"
        "[workers:vars]\nworkdir=/data/jobs\n"
        "[spares]\nnode09\n"
    )
    inv = load_ansible_inventory(path)
    assert inv.workers == ("node01", "node02", "node03", "node04")
    assert inv.scheduler == "head"
    assert inv.spares == ("node09",)
    n4 = inv.host("node04")
    assert (n4.address, n4.port, n4.user, n4.slots, n4.key_file) == ("10.0.0.4", 2222, "ml", 4, "/k/id")
    assert n4.workdir == "/data/jobs"  # group var of 'workers' beats all:vars
    assert inv.host("head").workdir == "/srv/jobs" and inv.host("head").python == "/opt/py/bin/python"
    assert sum(h.slots for h in inv.worker_hosts) == 10


def test_yaml_inventory(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text("all:\n  children:\n    workers:\n      hosts:\n"
                    "        a: {slots: 2}\n        b:\n          slots: 3\n")
    inv = load_ansible_inventory(path)
    assert [(h.name, h.slots) for h in inv.worker_hosts] == [("a", 2), ("b", 3)]


def test_torch_still_loads_after_two_ansible_parses(tmp_path: Path) -> None:
    """ansible-core patches sys.intern on import and torch's compiler refuses the patched one: a process that
    read an inventory must still be able to train (a fresh interpreter, since this one may have loaded torch)."""
    path = tmp_path / "hosts.ini"
    path.write_text("[workers]\nnode[1:2] slots=2\n")
    code = ("import sys; from toolkit.launcher.inventory import load_ansible_inventory as load; "
            f"assert len(load({str(path)!r}).hosts) == len(load({str(path)!r}).hosts) == 2; "
            "import torch._dynamo; import torch; torch.optim.SGD([torch.zeros(1, requires_grad=True)]).step()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_example_inventory_parses() -> None:
    inv = load_ansible_inventory(Path(__file__).parent.parent / "inventory.example.ini")
    assert inv.workers and inv.scheduler in {h.name for h in inv.hosts}


# --- properties ----------------------------------------------------------------------------------------------

names = st.from_regex(r"[a-z][a-z0-9-]{0,10}[a-z0-9]", fullmatch=True)
entries = st.lists(st.tuples(names, st.integers(1, 64)), min_size=1, max_size=12)


def _expected(items: list[tuple[str, int]]) -> list[tuple[str, int]]:
    slots: dict[str, int] = {}
    for name, n in items:
        slots[name] = slots.get(name, 0) + n
    return list(slots.items())


@settings(max_examples=200, deadline=None)
@given(entries)
def test_generated_host_lists_parse_to_what_they_describe(items: list[tuple[str, int]]) -> None:
    text = ",".join(f"{n}:{s}" if s != 1 else n for n, s in items)
    inv = parse_hosts(text)
    assert [(h.name, h.slots) for h in inv.hosts] == _expected(items)
    assert inv.workers == tuple(n for n, _ in _expected(items))


@settings(max_examples=200, deadline=None)
@given(entries, st.lists(st.sampled_from(["", "  # comment", "\t"]), min_size=12, max_size=12))
def test_generated_hostfiles_parse_to_what_they_describe(items: list[tuple[str, int]], tails: list[str]) -> None:
    lines = [f"{n} slots={s}{tails[i]}" if s != 1 or i % 2 else f"{n}{tails[i]}" for i, (n, s) in enumerate(items)]
    inv = parse_hostfile_text("# generated\n\n" + "\n".join(lines) + "\n", "hf")
    assert [(h.name, h.slots) for h in inv.hosts] == _expected(items)
