"""The one error a configuration problem raises before launch: every problem at once, each a
sentence naming the key, the value, the allowed values and the fix; and the one wording of a
mistyped name, with its "did you mean" (``no_such_option``, ``no_such_key``: train.py's lines and
the user-script hooks' alike)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


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


def closest(word: str, names: Iterable[str]) -> str | None:
    """The one of ``names`` closest to ``word`` (difflib's ratio, at least 0.6), or None: the guess
    of every "did you mean" line."""
    import difflib

    close = difflib.get_close_matches(word, list(names), n=1, cutoff=0.6)
    return close[0] if close else None


def no_such_option(group: str, value: str, options: Sequence[str]) -> str:
    """``strategy=zero33: no such strategy; did you mean zero3? (strategy=zero3); the options: ...``
    -- a mistyped option of a config group (train.py's, and the hooks' preset names)."""
    close = closest(value, options)
    guess = f"did you mean {close}? ({group}={close}); " if close else ""
    return f"{group}={value}: no such {group}; {guess}the options: {', '.join(options)}"


def no_such_key(key: str, value: str, keys: Sequence[str] | None, every: Iterable[str] = ()) -> str:
    """``trainer.max_stepz=3: no such key; did you mean trainer.max_steps? (trainer.max_steps=3)``
    -- a mistyped key (train.py's, and the hooks' ``strategy.<key>=<value>``). ``keys``: those of
    the node ``key`` would be in, among which the last part of ``key`` is guessed (with none close:
    listed); None when that node itself does not exist: ``key`` whole is guessed among ``every``."""
    parent, _, leaf = key.rpartition(".")
    if keys is None:
        close = closest(key, every)
    else:
        close = closest(leaf, keys)
        close = f"{parent}.{close}" if close and parent else close
    if close:
        return f"{key}={value}: no such key; did you mean {close}? ({close}={value})"
    where = f"the keys of {parent or 'the config'}: {', '.join(keys)}" if keys else \
        "every key: python train.py --cfg job"
    return f"{key}={value}: no such key; {where}"
