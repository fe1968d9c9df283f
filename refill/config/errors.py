"""What is wrong with a config: a `Problem` says where, what and what to do; `ConfigError` holds
every problem found, so a user fixes them all in one pass."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: where (`path`), what (`message`) and what to do (`fix`)."""

    path: str
    message: str
    fix: str

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        return f"{where}{self.message.rstrip('.')}. Fix: {self.fix}"


class ConfigError(ValueError):
    """A config that cannot run; `problems` holds every problem found."""

    def __init__(self, problems: list[Problem], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        head = f"{source}: " if source else ""
        count = len(self.problems)
        body = "\n".join(f"  {p}" for p in self.problems)
        super().__init__(f"{head}{count} problem{'s' if count != 1 else ''} in the config:\n{body}")


class ConfigFileError(ConfigError):
    """The file itself cannot be read: missing, unreadable, or not YAML. One line, no key path."""

    def __init__(self, message: str, source: str | None = None) -> None:
        self.message = message
        ValueError.__init__(self, message)
        self.problems = [Problem("", message, "correct the file")]
        self.source = source
