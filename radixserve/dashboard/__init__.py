"""The live dashboard's static page (``static/``: one HTML page, one script, one style sheet).

Both the server and the router serve it at ``/dashboard``; the script polls ``/dashboard/state``
on the same origin about once a second and draws what that one call returns (docs/dashboard.md).
No build step and nothing fetched from elsewhere: the page works on a machine with no internet.
This package holds only the files and their content types, so both sides can serve it without
importing each other.
"""

from __future__ import annotations

from importlib import resources

PAGE = "dashboard.html"
# the files the page loads, under /dashboard/static/<name>
ASSETS = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}


def read(name: str) -> bytes:
    """One file of ``static/``; ``PAGE`` or a key of ``ASSETS``, else ``KeyError``."""
    if name != PAGE and name not in ASSETS:
        raise KeyError(name)
    return resources.files(__package__).joinpath("static", name).read_bytes()


def is_public(path: str) -> bool:
    """The page and its files: served without ``--api-key`` (they hold no data; the figures come
    from ``/dashboard/state``, which wants the key)."""
    return path == "/dashboard" or path.startswith("/dashboard/static/")
