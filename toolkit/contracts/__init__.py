"""The contracts: every document and message that crosses a process boundary, defined once, for the side that
writes it and the side that reads it. The launcher, the agent, the scheduler and the workers import these and the
root helpers (toolkit.atomicfile, toolkit.procs, ...), never one another's code.

- protocol.py   the scheduler's wire protocol (workers and agents to the scheduler), its token proof
- session.py    an authenticated connection to the scheduler (client side)
- envvars.py    the environment contract: every variable a process of the job reads or is given
- hostspec.py   host.json: what the agent of a host runs and how it supervises it
- agentdoc.py   agent.json, agent.pid, the agent's control and progress sockets
- stepfile.py   the step file a worker shares with its agent
- rundoc.py     the scheduler's documents (scheduler.json's name and JobStatus, live.json, ledger.json,
                metrics.jsonl) as the launcher reads them
- jobrecord.py  the job record the launcher keeps in the project (and the playbooks write through `fleet record`)
- ckptkey.py    the checkpoints' key and its public id (the workers sign with it, `--fresh` tells whose a directory is)
"""
