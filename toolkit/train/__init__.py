"""The training side of toolkit.

- `init()` joins the job and returns a Runtime (rank, world size, process group, generations): what
  `dist.init_process_group()` is for a plain script.
- `Trainer` gives a data-parallel loop in-place recovery with no lost step (toolkit.train.trainer).
- `python -m toolkit.train SCRIPT` runs any script as a worker (toolkit.train.wrapper).
- `report(step, loss=...)` shows a torchrun-style script's progress in `fleet status` and `fleet report`, one line
  of the script; a no-op outside toolkit (toolkit.train.progress). `long_phase("evaluation")` around a part of the
  loop the progress watchdog must not take for a hang.
- Checkpoints live in `toolkit.train.ckpt.manager`; the sample's IDX reader in `toolkit.train.data`.
"""

from toolkit.train.faults import GenerationChanged, RuntimeConfigError
from toolkit.train.progress import long_phase, report
from toolkit.train.runtime import JobStopped, RegistrationError, Runtime, WorkerEnv, init
from toolkit.train.trainer import Terminated, Trainer, TrainerError

__all__ = [
    "GenerationChanged",
    "JobStopped",
    "RegistrationError",
    "Runtime",
    "RuntimeConfigError",
    "Terminated",
    "Trainer",
    "TrainerError",
    "WorkerEnv",
    "init",
    "long_phase",
    "report",
]
