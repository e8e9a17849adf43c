"""The three environment controls, parsed once and validated against the registered patch ids.

FLASHFIX_DISABLE   a comma-separated list of patch ids, ``all`` (every patch) or ``memory``
                   (every patch that raises GPU memory over the release's sizing) among them
                   (empty items are ignored)
FLASHFIX_STRICT    ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (default off)
FLASHFIX_LOG_LEVEL what ``logging`` accepts: a level name in any case (``warn`` and
                   ``fatal`` included) or a number (default ``INFO``)

A malformed value produces one message that names the variable, the value and what is
accepted (for FLASHFIX_DISABLE, the valid patch ids). Outside strict mode the bad part is
ignored and flashfix carries on; in strict mode it is a ``ConfigError``.
"""

import logging
import os
from collections import namedtuple

TRUE = ("1", "true", "yes", "on")
FALSE = ("", "0", "false", "no", "off")
LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


def log_level(raw):
    """The ``logging`` level for ``raw`` (a name, in any case, or a number), or None."""
    text = raw.strip()
    if not text:
        return logging.INFO
    try:
        return int(text)
    except ValueError:
        pass
    level = logging.getLevelName(text.upper())  # a known name gives its number
    return level if isinstance(level, int) else None


class ConfigError(ValueError):
    """A FLASHFIX_* environment variable holds a value flashfix does not accept."""


class Config(namedtuple("Config", "disable_all disabled strict log_level problems disable_memory",
                         defaults=(False, frozenset(), False, logging.INFO, (), False))):
    """The controls, read once: ``problems`` holds one human sentence per malformed value. (A
    named tuple, not a dataclass: ``dataclasses`` imports ``inspect``.)"""

    __slots__ = ()

    def is_disabled(self, patch_id, memory=None):
        """``memory``: the patch's ``memory`` statement (disabled by ``memory`` where it has one)."""
        return self.disable_all or patch_id in self.disabled or bool(memory and self.disable_memory)

    def disabled_reason(self, patch_id, memory=None):
        if not self.disable_all and patch_id not in self.disabled and memory:
            return "disabled by FLASHFIX_DISABLE=memory (the release's sizing kept; the fix adds %s)" % memory
        return "disabled by FLASHFIX_DISABLE"


def names_patches(environ=None):
    """Does FLASHFIX_DISABLE name patch ids (anything but ``all``)? Only then does ``parse``
    need every registered id."""
    disable = (os.environ if environ is None else environ).get("FLASHFIX_DISABLE", "")
    return any(item.strip().lower() not in ("", "all", "memory") for item in disable.split(","))


def parse(valid_ids, environ=None):
    """Read the FLASHFIX_* variables; ``valid_ids`` are the registered patch ids."""
    env = os.environ if environ is None else environ
    problems = []

    strict_raw = env.get("FLASHFIX_STRICT", "").strip().lower()
    strict = strict_raw in TRUE
    if not strict and strict_raw not in FALSE:
        problems.append("FLASHFIX_STRICT=%r is not a boolean; use 1 or 0 (treated as 0)" % env["FLASHFIX_STRICT"])

    level = log_level(env.get("FLASHFIX_LOG_LEVEL", ""))
    if level is None:
        level = logging.INFO
        problems.append("FLASHFIX_LOG_LEVEL=%r is not a level; use one of %s or a number (using INFO)"
                        % (env["FLASHFIX_LOG_LEVEL"], ", ".join(LEVELS)))

    disable_raw = env.get("FLASHFIX_DISABLE", "").strip()
    items = [item.strip() for item in disable_raw.split(",") if item.strip()]
    disable_all = any(item.lower() == "all" for item in items)
    disable_memory = any(item.lower() == "memory" for item in items)
    ids = [item for item in items if item.lower() not in ("all", "memory")]
    unknown = [item for item in ids if item not in valid_ids]
    if unknown:
        problems.append("FLASHFIX_DISABLE=%r names unknown patch id(s) %s; valid: all, memory, %s (unknown ids ignored)"
                        % (disable_raw, ", ".join(repr(u) for u in unknown), ", ".join(sorted(valid_ids))))
    return Config(disable_all, frozenset(item for item in ids if item in valid_ids), strict, level, tuple(problems),
                  disable_memory)
