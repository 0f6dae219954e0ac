"""The hosts the replica check found corrupt (issue 44): the scheduler's decisions on a worker's `corruption` report
(messages.Corruption), pure over its Roster and the state kept here (`CorruptHosts`, persisted). The membership
(toolkit.scheduler.membership) applies what needs its members: a spare's takeover, a shrink, the job's end.

- A report is logged and noted for the ledger. The ranks it names (`healed` or `fenced`; `rolled back` and
  `stopped` name no one) are counted per rank of a host (`host/rank`): a rank's own count lives in its process and
  starts from zero when the rank is relaunched, this one survives relaunches of the ranks and of the scheduler. A
  rank found corrupt twice fences its host; two ranks of one host found once each are each healed. Only hosts of the
  roster are counted (the report is hostile input).
- A host is fenced (the report's action `fenced`, or a rank counted twice here) only while the job runs formed in the
  report's generation with every rank training, and only where the report places the rank where the scheduler does
  (`hosts_to_fence`); a host handed over or benched already is left alone. Its ranks go to a free spare; with none,
  an elastic job shrinks without it, else the job stops (the membership's `fence_corrupt`).
- A host so benched is quarantined: it does not come back by itself. Its workers are refused (`refuse`); the first
  hello of its agent after the fence, if that agent was not connected then (it never got its `stop`), is answered
  `stop`; a later hello can only come from an agent the operator started again (`fleet restart --host`), which ends
  the quarantine and forgets the host's findings (`hello`). A spare that takes the host's ranks forgets them too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Collection, Mapping

from toolkit.contracts import logical, protocol
from toolkit.contracts import messages as wire
from toolkit.contracts.rundoc import JobStatus
from toolkit.scheduler.actions import Action, Log, Note, NoteKind, Send
from toolkit.scheduler.roster import Roster

WARNING = logging.WARNING
NAMING_ACTIONS = ("healed", protocol.CORRUPT_FENCED)  # reports that name corrupt ranks (the others: every rank,
#                                                    rolled back or stopped)


@dataclass(frozen=True)
class Fence:
    """The hosts of `report`'s ranks are not to be trusted with the job's state, for `why`."""

    report: wire.Corruption
    why: str


@dataclass(frozen=True)
class Finding:
    """What a report comes to: its log line and Note (`actions`), the fence it asks for (None: none), and whether
    the persisted counts changed."""

    actions: list[Action]
    fence: Fence | None
    counted: bool


def read_quarantined(doc: object) -> dict[str, bool]:
    """The persisted hosts fenced for corruption and benched ({host: whether its agent is still owed `stop`});
    ValueError if malformed (the state file is hostile input)."""
    if doc is None:
        return {}
    if not isinstance(doc, dict) or len(doc) > logical.MAX_LOGICAL_RANKS or not all(
            isinstance(h, str) and 0 < len(h) <= 256 and type(v) is bool for h, v in doc.items()):
        raise ValueError("quarantined: not a map of host names to true or false")
    return dict(doc)


def read_corrupt(doc: object) -> dict[str, int]:
    """The persisted count of the times the replica check named each rank of a host corrupt ({"host/rank": times},
    each at least 1; CorruptHosts.counts); ValueError if malformed (the state file is hostile input)."""
    if doc is None:
        return {}
    if not isinstance(doc, dict) or len(doc) > logical.MAX_LOGICAL_RANKS or not all(
            isinstance(h, str) and 0 < len(h) <= 256 and type(v) is int and v >= 1 for h, v in doc.items()):
        raise ValueError("corrupt: not a map of host/rank names to a count of findings")
    return dict(doc)


def window(report: wire.Corruption) -> str:
    """The steps in which the corruption started, as a log line says them."""
    return (f"steps {report.since + 1}-{report.step}" if report.since is not None
            else f"at or before step {report.step}")


def named(report: wire.Corruption) -> str:
    """The ranks a report names and their hosts, as a log line says them."""
    return ", ".join(f"rank {r} on {h}" for r, h in zip(report.ranks, report.hosts, strict=True))


class CorruptHosts:
    """What the scheduler keeps of the replica check's findings (see the module docstring), persisted with its state:
    `counts` ('host/rank' -> times the check named that rank corrupt) and `quarantined` (a host fenced for corruption
    and benched -> whether its agent is still owed `stop`)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.quarantined: dict[str, bool] = {}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take the persisted findings of `state` (ValueError if malformed: read_quarantined, read_corrupt)."""
        self.quarantined = read_quarantined(state.get("quarantined"))
        self.counts = read_corrupt(state.get("corrupt"))

    def snapshot(self) -> dict[str, Any]:
        """What is persisted: each map only when it has entries."""
        return {**({"quarantined": dict(self.quarantined)} if self.quarantined else {}),
                **({"corrupt": dict(self.counts)} if self.counts else {})}

    def found(self, report: wire.Corruption, node_id: str, roster: Roster) -> Finding:
        """A report (its ranks checked to be the job's) sent by the worker `node_id`: its log line and Note for the
        ledger, counted (`count`); a fence when its action is `fenced`, or for the ranks now counted twice (named
        once more after a relaunch: the rank's own count started from zero)."""
        who, span = named(report), window(report)
        actions: list[Action] = [
            Log(WARNING, f"corruption found at step {report.step} (reported by {node_id}): {who}, started in {span}: "
                         f"{report.action}"),
            Note(NoteKind.CORRUPTION, {**report.encode(), "node_id": node_id})]
        counted, again = self.count(report, roster)
        if report.action == protocol.CORRUPT_FENCED:
            return Finding(actions, Fence(report, f"found corrupt twice by the replica check ({who}; the second time "
                                                  f"in {span})"), counted)
        if not again:
            return Finding(actions, None, counted)
        pairs = [(r, h) for r, h in zip(report.ranks, report.hosts, strict=True) if h in again]
        subset = replace(report, ranks=tuple(r for r, _ in pairs), hosts=tuple(h for _, h in pairs))
        return Finding(actions, Fence(subset, f"found corrupt {max(again.values())} times by the replica check "
                                              f"({named(subset)}; the last time in {span})"), counted)

    def count(self, report: wire.Corruption, roster: Roster) -> tuple[bool, dict[str, int]]:
        """Count each rank of a roster host the report names (once per report); (whether a count changed, the hosts
        with a rank now named twice or more, with its count)."""
        if report.action not in NAMING_ACTIONS:
            return False, {}
        counted, again = False, {}
        for rank, host in dict.fromkeys(zip(report.ranks, report.hosts, strict=True)):
            if host in roster.hosts:
                key = f"{host}/{rank}"
                self.counts[key] = self.counts.get(key, 0) + 1
                counted = True
                if self.counts[key] >= 2:
                    again[host] = max(again.get(host, 0), self.counts[key])
        return counted, again

    def forget(self, host: str) -> None:
        """`host` is replaced by a spare, or started again by the operator: its quarantine ends and its ranks'
        findings start over."""
        self.quarantined.pop(host, None)
        for key in [k for k in self.counts if k.rpartition("/")[0] == host]:
            del self.counts[key]

    def refuse(self, peer: int, node_id: str, placed: str | None, host: str, pid: int, where: str) -> list[Action]:
        """The refusal (`fenced`: it must exit) of the worker `node_id` (pid `pid`, `where` for the log) placed on
        `placed` or saying it runs on `host`, if that host is quarantined; else []."""
        if placed not in self.quarantined and host not in self.quarantined:
            return []
        fenced = placed if placed in self.quarantined else host
        return [Log(WARNING, f"fenced {node_id} ({where}): host {fenced} is fenced for corruption; told it to exit"),
                Note(NoteKind.FENCED, {"node_id": node_id, "pid": pid, "host": host}),
                Send(peer, wire.Fenced(f"host {fenced} is fenced for corruption: its processes may not rejoin the job "
                                       "until the operator starts it again"), close=True)]

    def hello(self, peer: int, host: str, addr: str, job: str) -> tuple[bool, list[Action]] | None:
        """The hello of the agent of `host` from `addr` if the host is quarantined (the persisted state changes),
        else None: the fenced agent itself when it never got its `stop` (refused: True, `welcome` then `stop`),
        else an agent started again after it stopped, which only the operator does (`fleet restart --host`): the
        quarantine ends (False, its log line) and the hello goes on."""
        if host not in self.quarantined:
            return None
        if self.quarantined[host]:
            self.quarantined[host] = False
            return True, [Log(WARNING, f"refused the agent of {host} ({addr}): the host is fenced for corruption; told "
                                       "it to stop its processes"),
                          Send(peer, wire.Welcome()),
                          Send(peer, wire.Stop(f"host {host} is fenced for corruption in job {job}: it is out of the "
                                               "job until the operator starts it again"), close=True)]
        self.forget(host)
        return False, [Log(WARNING, f"host {host}, fenced for corruption, is back: its agent was started again (fleet "
                                    "restart --host); its workers rejoin the job")]


def hosts_to_fence(report: wire.Corruption, roster: Roster, quarantined: Collection[str], generation: int,
                   formed: bool, status: str) -> list[str] | Log:
    """The hosts of `report`'s ranks to fence, in order, once each, leaving out those handed over or benched
    already; or the one line saying why none is: a report of another generation than the job's (its ranks may be
    held elsewhere by now), one while the job is not running formed with every rank training, or one placing a rank
    on another host than the scheduler does (it has moved since)."""
    if report.generation != generation or not formed or status != JobStatus.RUNNING or roster.done:
        return Log(WARNING, f"not fencing after the corruption report of generation {report.generation}: the job is "
                            f"in generation {generation}, {status}{'' if formed else ', gathering'}"
                            + (", some ranks finished" if roster.done else ""))
    hosts: dict[str, None] = {}
    for r, h in zip(report.ranks, report.hosts, strict=True):
        placed = roster.host_of(protocol.worker_node_id(r))
        if placed is not None and placed != h:
            return Log(WARNING, f"not fencing after the corruption report: it places rank {r} on {h}, the scheduler "
                                f"on {placed}")
        hosts[h] = None
    return [h for h in hosts if roster.replaced_by(h) is None and h not in quarantined]
