"""Fabric entry point: `fab deploy train --hosts=node1:4,node2:4`; `fab --list` for the tasks.

The same tasks are the `fleet` command, which works from any directory once toolkit is installed.
"""

from toolkit.launcher.cli import namespace, use_cluster_executor

use_cluster_executor()
ns = namespace()
