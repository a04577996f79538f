"""The one error a configuration problem raises before launch: every problem at once, each a
sentence naming the key, the value, the allowed values and the fix."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem found before launch. The message lists every problem at once."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem(s)):\n{lines}")


class DataError(ValueError):
    """A problem in the training data found while reading it, after launch (the checks before
    launch read only the first records): one sentence naming the input, the record or line, and
    the fix. train.py says it in one line and exits 2."""
