"""The training side of toolkit: `init()` joins the job and returns a Runtime (rank, world size, process group,
generations); the sampler and checkpoints live in `toolkit.train.data` and `toolkit.train.checkpoint`."""

from toolkit.train.runtime import (
    GenerationChanged,
    JobStopped,
    RegistrationError,
    Runtime,
    RuntimeConfigError,
    WorkerEnv,
    init,
)

__all__ = [
    "GenerationChanged",
    "JobStopped",
    "RegistrationError",
    "Runtime",
    "RuntimeConfigError",
    "WorkerEnv",
    "init",
]
