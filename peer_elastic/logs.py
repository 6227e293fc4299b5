"""Logging with the peer's identity on every line.

``setup()`` (called by :func:`peer_elastic.join`) gives the ``peer_elastic`` logger a handler
whose lines carry the member id, rank and generation, unless the application configured
logging itself. Quiet by default (warnings and errors); ``PEER_ELASTIC_LOG_LEVEL=INFO``
(or DEBUG) shows every membership change and reset.
"""

from __future__ import annotations

import logging
import sys

from peer_elastic.settings_table import LOG_LEVEL

_context = {"pe_member": "-", "pe_rank": "-", "pe_gen": "-"}

FORMAT = ("%(asctime)s peer-elastic[%(pe_member)s rank=%(pe_rank)s gen=%(pe_gen)s] "
          "%(levelname)s %(name)s: %(message)s")


class ContextFilter(logging.Filter):
    """Adds the peer's identity to every record (usable in any handler's format)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _context.items():
            setattr(record, key, value)
        return True


def set_context(member: str | None = None, rank: int | None = None,
                generation: int | None = None) -> None:
    if member is not None:
        _context["pe_member"] = member
    if rank is not None:
        _context["pe_rank"] = str(rank) if rank >= 0 else "standby"
    if generation is not None:
        _context["pe_gen"] = str(generation)


def setup(level: str | None = None) -> None:
    """Configure the ``peer_elastic`` logger once (idempotent)."""
    logger = logging.getLogger("peer_elastic")
    level_name = (level or LOG_LEVEL.value()).upper()
    logger.setLevel(getattr(logging, level_name, logging.WARNING))
    if any(isinstance(f, ContextFilter) for f in logger.filters):
        return
    logger.addFilter(ContextFilter())
    if not logging.getLogger().handlers:  # the application did not configure logging
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        handler.addFilter(ContextFilter())
        logger.addHandler(handler)
        logger.propagate = False
