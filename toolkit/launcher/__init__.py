"""The launcher: what runs where the user types `fleet` (or `fab`): the command line, the plan, the hosts over SSH,
the commands. It starts the processes of toolkit.agent, toolkit.scheduler and toolkit.train on the hosts and reads
what they write, through the documents of toolkit.contracts only; it imports none of their code.

- cli.py, helptext.py      the `fleet` program and every task's help
- settings.py              flags + fabric.yaml (+ SLURM_*) -> Settings / Request / JobRef
- inventory.py, slurm.py   --hosts / --hostfile / --inventory / a Slurm allocation -> Inventory
- plan.py, render.py       Inventory + options -> LaunchPlan (pure) -> the files each host gets
- report.py                `fleet report`'s data (pure), its picture and tables
- tasks/                   one module per command, the only thing the CLI calls
- jobhosts/                the job's hosts as a whole below the commands: reach, deploy, start, follow, stop, check
- check/                   the pre-flight checks' decisions (pure) and the probe run on each host
- remote/                  the transport: one Host over SSH or locally, fan-out, sync
"""
