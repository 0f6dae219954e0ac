"""TrainerError: the one error the Trainer raises for a loop, an argument or a state that cannot work, with the fix
in its message. Its own module so that the Trainer's parts (agreement, checkpointing) raise it without importing
the Trainer."""


class TrainerError(RuntimeError):
    """The training loop uses the Trainer wrongly; the message says how to fix it."""
