"""Argument types, the help format and the usage error shared by the ``glm5-dsa`` subcommands.

Every numeric flag is parsed by one of these validating types, so a bad value (``0``
iterations, a negative size) is an argparse usage error, exit status 2, before any work
starts, never a traceback or a negative figure printed with status 0. A value that is
wrong only against the preset (a context beyond ``max_position_embeddings``, a chunk longer
than the context) or the host (``--tp`` beyond its devices) is a ``UsageError`` raised by
the subcommand's checks before any work: ``glm5_dsa_jax.cli.main`` prints it as one line,
``glm5-dsa CMD: error: ...``, and exits with status 2.
"""

from __future__ import annotations

import argparse
import inspect
import textwrap


class UsageError(Exception):
    """A flag value or the environment the command cannot run with: one line, exit status 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default (``(default: 5)``), unless the help already
    says what the default is (``(default: ...)`` written out, for a default computed at run
    time); descriptions keep their paragraphs (blank-line separated) and ``  indented``
    lines."""

    def _get_help_string(self, action):
        h = action.help or ""
        if "(default" in h or action.default is None or (action.nargs == 0 and action.default is False):
            return h  # the default written out, none, or a switch (off unless given)
        return super()._get_help_string(action)

    def _fill_text(self, text, width, indent):
        out = []
        for para in inspect.cleandoc(text.replace("``", "")).split("\n\n"):
            if any(line.startswith("  ") for line in para.splitlines()):  # a list: as written
                out.append("\n".join(indent + line for line in para.splitlines()))
            else:
                out.append(textwrap.fill(" ".join(para.split()), width, initial_indent=indent,
                                         subsequent_indent=indent))
        return "\n\n".join(out)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose help is ``HelpFormatter``'s, and so are its subcommands'
    (``add_subparsers`` makes parsers of the parent's class)."""

    def __init__(self, *a, **kw):
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*a, **kw)

    def error(self, message):
        """A usage error as one line on stderr (not the usage block), exit status 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def check_context(context: int, cfg, flag: str = "--context") -> None:
    """``UsageError`` unless ``context`` tokens fit the model's positions
    (``max_position_embeddings``)."""
    if context > cfg.max_position_embeddings:
        raise UsageError(f"{flag} {context:,} is beyond what the model holds: "
                         f"max_position_embeddings is {cfg.max_position_embeddings:,}")


def _int(s: str) -> int:
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None


def positive_int(s: str) -> int:
    """argparse type: an integer >= 1."""
    v = _int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (>= 1), got {v}")
    return v


def nonnegative_int(s: str) -> int:
    """argparse type: an integer >= 0."""
    v = _int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer (>= 0), got {v}")
    return v


def positive_int_list(s: str) -> list[int]:
    """argparse type: comma-separated integers, each >= 1, at least one."""
    vals = [positive_int(v.strip()) for v in s.split(",") if v.strip()]
    if not vals:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {s!r}")
    return vals


def positive_float(s: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {s}")
    return v
