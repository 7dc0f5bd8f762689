"""The ``--data`` of an offline builder (``mmalign mine``, ``mmalign curate``): a directory of
``.tar`` shards, a brace spec or a list, local or remote, read as training reads them.

The shards are checked before any work starts (a missing local shard, an unreadable
remote one: one line naming it), so a long pass does not fail on its last shard.
"""

from __future__ import annotations

from pathlib import Path

from mmalign.errors import ConfigError, UsageError

__all__ = ["input_shards"]


def input_shards(data: str | list[str], flag: str = "--data") -> list[str]:
    """The shard URLs of ``data``; a directory gives its ``*.tar`` in name order."""
    from mmalign.data.shards import check_urls, expand_urls

    if isinstance(data, str) and Path(data).is_dir():
        urls = sorted(str(p) for p in Path(data).glob("*.tar"))
        if not urls:
            raise UsageError(f"{flag}: {data} holds no .tar shards")
    else:
        urls = expand_urls(data)
    try:
        check_urls(urls, flag)
    except ConfigError as e:  # a flag, not a config key: say so in the user's terms
        raise UsageError(str(e).replace(f"config key '{flag}'", flag)) from None
    return urls
