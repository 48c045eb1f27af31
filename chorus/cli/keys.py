"""``chorus keys hash``: the SHA-256 of an API key, for ``auth.keys``."""

from __future__ import annotations

import argparse


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--key", help="the key (default: prompt for it)")
    p.add_argument("--generate", action="store_true", help="make a new random key")


def hash_command(args: argparse.Namespace) -> int:
    import getpass
    import secrets

    from chorus.server.gateway.auth import hash_key

    raw = args.key or (secrets.token_urlsafe(32) if args.generate else getpass.getpass("API key: "))
    if args.generate and not args.key:
        print(f"key:    {raw}   (give this to the client; it is not stored)")
    print(f"sha256: {hash_key(raw)}")
    return 0


