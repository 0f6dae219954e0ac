"""The job's hosts as a whole, below the commands (toolkit.launcher.tasks), which share it and never import one another:

- reach.py       the job record's hosts and SSH settings, the fan-out to them, the bounds of the commands' own
                 remote commands
- scripts.py     the shell snippets run on the hosts, and the parsers of what they print
- output.py      what the commands print: tables on stdout, notes on stderr, small formats
- view.py        HostStatus and ProcStatus (how a host and its processes stand), the scheduler's live.json, the
                 job's recovery mode
- judge.py       pure: each host's status from its agent's document (toolkit.contracts.agentdoc) and live.json
- poll.py        reading every host's agent files in one bounded command each, and the layout the spares settle
- tables.py      the status table and the scheduler's view in lines (`status`, `status --watch`)
- stopping.py    stopping the job on one host through its stop.sh
- follow.py      `train --join`: following the job to its end, the evidence when it failed
- rerun.py       what a new run starts on: the size of the previous run, the checkpoints `--fresh` moves aside
- deployment.py  deploying the job (`deploy`, `train` on a job never deployed, `run`)
- launch.py      starting the job on every host, all or nothing (`train`, `run`)

Nothing here imports toolkit.launcher.tasks (tests/test_import_shape.py)."""
