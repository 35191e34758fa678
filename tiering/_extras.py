"""The optional parts of `tiering` and what each needs (layer 0).

Installed alone, `tiering` brings the engine, its CPU tier and the disk tier;
each part below needs a package of its own, installed with the extra of the
same name (``pip install '.[redis,events]'`` in a checkout, or ``[all]``):

=========  ==============  ==================================================
extra      package         for
=========  ==============  ==================================================
redis      redis-py        the Redis tier (`tiering.secondary.redis`)
events     pyzmq           the ZMQ publisher and subscriber of KV events
plot       matplotlib      ``tiering simulate --plot``
auth       cryptography    keyed values tagged with AES-GMAC (HMAC without)
=========  ==============  ==================================================

`require` is called where such a part is configured (a tier or a publisher
built, a flag read), so that a missing package is one `ConfigError` there,
naming the extra, and never an ``ImportError`` later, in the middle of a run
or once per call of vLLM's scheduler. The modules that import the package at
their top (`tiering.events.publisher`...) are imported only after it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from tiering.errors import ConfigError

__all__ = ["EXTRAS", "install_line", "require"]

#: Each extra of the distribution (``pyproject.toml``) and the package it installs.
EXTRAS = {"redis": "redis-py", "events": "pyzmq", "plot": "matplotlib", "auth": "cryptography"}


def install_line(extra: str) -> str:
    """The command that installs the optional part ``extra``."""
    if extra not in EXTRAS:
        raise ValueError(f"no extra {extra!r}; the extras: {', '.join(EXTRAS)}")
    return f"pip install 'tiering[{extra}]'"


def require(
    module: str, extra: str, for_what: str, *, error: type[ConfigError] = ConfigError
) -> ModuleType:
    """``module``, imported; else ``error`` (a `ConfigError`) saying that ``for_what``
    needs the package of ``extra`` and how to install it.

    A package that is there but cannot be imported (one of its own modules or
    imports missing or broken) is the same error, with the reason: only the
    package itself not found says that it is not installed.
    """
    line = install_line(extra)
    top = module.partition(".")[0]
    try:
        importlib.import_module(top)  # the package itself first, whatever is cached below it
        return importlib.import_module(module)
    except ImportError as exc:
        package = EXTRAS[extra]
        if isinstance(exc, ModuleNotFoundError) and exc.name == top:
            raise error(f"{for_what} needs {package}, an optional part: {line}") from None
        raise error(
            f"{for_what} needs {package}, an optional part, and it cannot be imported "
            f"({exc}): {line}"
        ) from None
