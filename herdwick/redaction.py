"""A URL fit for a message or a log line: its password left out.

The settings name the database and Redis URLs they refuse; neither message may carry
the password. The user stays, to tell which credentials were meant.
"""

from __future__ import annotations

import urllib.parse


def redacted(url: str) -> str:
    """`url` without its password (`user@host...`, or just the hosts)."""
    parts = urllib.parse.urlsplit(url)
    user, at, hosts = parts.netloc.rpartition("@")
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user.partition(':')[0]}@{hosts}"
                                                  if at else hosts))
