"""Passwords in tracking and database URIs: found as the store's driver finds them, and masked for printing.

`urllib.parse.urlsplit(uri).password` misses two kinds that SQLAlchemy (MLflow's database stores) and libpq do
use: a password in the query string (`postgresql://qb@host/db?password=...`, handed to the driver as a
connection argument) and one holding `/`, `?` or `#` (`postgresql://qb:ab/cd@host/db`: urlsplit ends the
netloc at the `/`). SQLAlchemy's own URL parser reads both, so it is the parser here; a string it cannot parse
(a plain path) falls back to urlsplit.
"""

from __future__ import annotations

import urllib.parse

# query keys that carry a secret to a driver (libpq: password, sslpassword; MySQL drivers: passwd, password)
SECRET_KEYS = frozenset({"password", "passwd", "pwd", "sslpassword"})


def _url(uri: str):  # sqlalchemy.engine.URL, or None for a string it does not parse
    from sqlalchemy.engine import make_url  # ~0.2 s: only for a URI that can hold a secret at all (see has_password)

    try:
        return make_url(uri)
    except Exception:  # noqa: BLE001 - any string SQLAlchemy refuses (a path, a bad port) has no URL password
        return None


def has_password(uri: str) -> bool:
    """Whether `uri` carries a password, in its user info or its query string."""
    uri = str(uri)
    if "@" not in uri and "?" not in uri:  # user info needs an @, a query a ?: the common case costs nothing
        return False
    url = _url(uri)
    if url is None:
        return urllib.parse.urlsplit(uri).password is not None
    return url.password is not None or any(k.lower() in SECRET_KEYS for k in url.query)


def secrets(uri: str) -> list[str]:
    """The secret values `uri` holds (its password, query passwords): to mask them in text that quotes them."""
    uri = str(uri)
    if not has_password(uri):
        return []
    url = _url(uri)
    if url is None:
        return [p] if (p := urllib.parse.urlsplit(uri).password) else []
    found = [str(url.password)] if url.password is not None else []
    for k, v in url.query.items():
        if k.lower() in SECRET_KEYS:
            found += [v] if isinstance(v, str) else list(v)
    return [s for s in found if s]


def redact(uri: str) -> str:
    """`uri` with every password masked (`***`), for anything printed or logged; unchanged when it holds none."""
    uri = str(uri)
    if not has_password(uri):
        return uri
    url = _url(uri)
    if url is None:
        parts = urllib.parse.urlsplit(uri)
        return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)))
    query = {k: ("***" if k.lower() in SECRET_KEYS else v) for k, v in url.query.items()}
    return url.set(query=query).render_as_string(hide_password=True).replace("=%2A%2A%2A", "=***")


def redact_overrides(overrides: list[str]) -> list[str]:
    """Hydra overrides (`key=value`) with a password in any value masked: a command's record of its options."""
    return [f"{o.split('=', 1)[0]}={redact(o.split('=', 1)[1])}" if "=" in o else o for o in overrides]
