"""A Slurm allocation as a host source: SLURM_JOB_NODELIST and SLURM_TASKS_PER_NODE -> Inventory.

Inside an allocation (salloc, sbatch) Slurm names the job's nodes and the tasks of each in the environment. toolkit
takes them as the hosts and their slots, and still starts the processes over SSH (as torchrunx does), not with
srun: the agents, recovery and the job record work as with any other host source, and `status` or `stop` work
later from outside the allocation too. Pure: the environment comes in as a mapping, and every malformed value
raises SlurmError with one line naming the variable and what to do.

Hostlists (`gpu[01-04,07]`, `n[001-003]-ib`, `r[1-2]n[1-2]`) and tasks-per-node lists (`4(x3),2`) are parsed by
python-hostlist (`expand_hostlist`, `parse_slurm_tasks_per_node`), the maintained implementation of Slurm's syntax.
"""

from __future__ import annotations

import re
from typing import Mapping

import hostlist

from toolkit.contracts import envvars
from toolkit.launcher.inventory import MAX_SLOTS, Host, Inventory, InventoryError, check_name

_FIX = "give the hosts with --hosts, --hostfile or --inventory instead"


class SlurmError(InventoryError):
    """The allocation's variables are missing or malformed; the message is the one line shown to the user."""


def in_allocation(environ: Mapping[str, str]) -> bool:
    """True when `environ` is a Slurm allocation's (SLURM_JOB_NODELIST set): its hosts are the default source."""
    return bool(environ.get(envvars.SLURM_JOB_NODELIST, "").strip())


def slurm_inventory(environ: Mapping[str, str]) -> Inventory:
    """The allocation's hosts, in SLURM_JOB_NODELIST order (the first runs the scheduler), with slots from
    SLURM_TASKS_PER_NODE matched to them in order; without it every host gets SLURM_NTASKS_PER_NODE slots, and
    without that 1. Raises SlurmError outside an allocation, for a hostlist or tasks-per-node list that does not
    parse, for counts that do not match the hosts, and for a host name toolkit does not accept."""
    nodelist = environ.get(envvars.SLURM_JOB_NODELIST, "").strip()
    if not nodelist:
        raise SlurmError(f"--slurm: {envvars.SLURM_JOB_NODELIST} is not set, so this is not a Slurm allocation; run "
                         f"fleet inside one (salloc, sbatch) or {_FIX}")
    where = f"{envvars.SLURM_JOB_NODELIST}={nodelist!r}"
    try:
        names = hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist as e:
        raise SlurmError(f"{where}: not a Slurm hostlist ({e}); it reads like gpu[01-04,07],login1: correct or unset "
                         f"it, or {_FIX}") from None
    if not names:
        raise SlurmError(f"{where}: names no host; correct or unset it, or {_FIX}")
    for name in names:
        check_name(name, where)
    slots, slots_from = _slots(environ, len(names))
    job_id = environ.get(envvars.SLURM_JOB_ID, "").strip()
    source = f"Slurm job {job_id}" if job_id else "the Slurm allocation"
    allocation = f"the allocation of Slurm job {job_id}" if job_id else "the Slurm allocation (no SLURM_JOB_ID)"
    hosts = tuple(Host(name=name, slots=n) for name, n in zip(names, slots, strict=True))
    return Inventory(hosts=hosts, scheduler=names[0], workers=tuple(names), source=source,
                     note=f"hosts from {allocation}: {where}, slots from {slots_from}; processes are started over "
                          "SSH, not srun")


def _slots(environ: Mapping[str, str], count: int) -> tuple[list[int], str]:
    """Slots of each of `count` hosts, and where they came from (said in the plan)."""
    tasks = environ.get(envvars.SLURM_TASKS_PER_NODE, "").strip()
    if tasks:
        where = f"{envvars.SLURM_TASKS_PER_NODE}={tasks!r}"
        try:
            slots = hostlist.parse_slurm_tasks_per_node(tasks)
        except hostlist.BadHostlist:
            raise SlurmError(f"{where}: not a Slurm tasks-per-node list (counts like 4(x3),2); correct or unset it, "
                             f"or {_FIX}") from None
        if len(slots) != count:
            raise SlurmError(f"{where} gives tasks for {len(slots)} host(s), but {envvars.SLURM_JOB_NODELIST} names "
                             f"{count}: both must come from the same allocation; correct or unset the one set by "
                             f"hand, or {_FIX}")
        if not all(1 <= n <= MAX_SLOTS for n in slots):
            raise SlurmError(f"{where}: every host of the allocation needs 1 to {MAX_SLOTS} tasks; correct or unset "
                             f"it, or {_FIX}")
        return slots, where
    per_node = environ.get(envvars.SLURM_NTASKS_PER_NODE, "").strip()
    if per_node:
        where = f"{envvars.SLURM_NTASKS_PER_NODE}={per_node!r}"
        if not re.fullmatch(r"[0-9]+", per_node) or not 1 <= int(per_node) <= MAX_SLOTS:
            raise SlurmError(f"{where}: expected a whole number from 1 to {MAX_SLOTS}; correct or unset it")
        return [int(per_node)] * count, where
    return [1] * count, f"neither {envvars.SLURM_TASKS_PER_NODE} nor {envvars.SLURM_NTASKS_PER_NODE}: 1 per host"
