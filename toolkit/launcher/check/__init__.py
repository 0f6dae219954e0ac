"""Pre-flight checks of a deployed job's hosts (`fleet check`, and `train` before it starts anything).

- decide.py  the decisions, pure: facts gathered from the hosts in, one Problem (host, what, fix) per finding out
- probe.py   the small program run on each host with the job's interpreter (standard library only until the
             health test imports torch): `facts` (versions, digests, environment, ports, disk, clock) and
             `health` (a timed matmul and timed gloo all-reduces with paired hosts)
Both phases are run on the job's hosts, and the table made, by toolkit.launcher.jobhosts.preflight (`fleet check`,
toolkit.launcher.tasks.check, and `train`): this package imports nothing of the hosts."""
