"""Text for people, from anything: one cleaner of what the platform prints or publishes, one log helper that every
pod program prints through, one line splitter (the rank tagger's and `make logs`' alike) and one duration
formatter."""

import re
import sys

MAX_TEXT = 400  # characters of one published string
# Control, format and separator characters: a line break (also U+0085, U+2028, U+2029), a carriage return, a
# terminal escape or a bidirectional override in a tenant's name or message never reaches a log or an API object.
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]+")


def clean(value, limit: int = MAX_TEXT) -> str:
    """`value` as one line for a person or an API object: no control, format or separator characters, at most
    `limit` characters."""
    return _UNPRINTABLE.sub(" ", str(value))[:limit]


class Log:
    """One program's log lines: `<program>: <message>`, each message cleaned to one line (what a tenant's program
    chose, a tag name or an error, is part of many messages), flushed at once."""

    def __init__(self, program: str, stream=None, limit: int = 2000):
        self.program, self.stream, self.limit = program, stream, limit
        self._said: set[str] = set()

    def __call__(self, message: str) -> None:
        print(f"{self.program}: {clean(message, self.limit)}", file=self.stream or sys.stdout, flush=True)

    def once(self, key: str, message: str) -> None:
        """The message the first time `key` comes up in this process, then nothing."""
        if key not in self._said:
            self._said.add(key)
            self(message)


def error_line(err: BaseException, limit: int = 200) -> str:
    """An exception for one line of a message: `TypeName: the first line of its text` (at most `limit` characters
    of it), or the type's name alone when it has no text."""
    first = str(err).splitlines()[0][:limit] if str(err).strip() else ""
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def lines(text):
    """The lines of a log, split on the newline alone (str or bytes): a tenant's U+2028, form feed or carriage
    return stays inside its line, so no rank's text can start a line of its own where the tagger's tag is trusted."""
    newline = b"\n" if isinstance(text, bytes) else "\n"
    parts = text.split(newline)
    return parts[:-1] if parts and not parts[-1] else parts


def complete_lines(buffer):
    """(the complete lines of a stream's buffer, what is left after the last newline): lines() for a stream."""
    *complete, rest = buffer.split(b"\n" if isinstance(buffer, bytes) else "\n")
    return complete, rest


def duration(seconds, style: str = "short") -> str:
    """Seconds for a person: `short` 41s, 2m03s, 1h02m (how long something took); `clock` 1:02:03 (an ETA)."""
    if not isinstance(seconds, int | float) or isinstance(seconds, bool) or seconds != seconds:
        return ""
    minutes, secs = divmod(int(max(0, seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    if style == "clock":
        return f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
