"""CURVE on the ZeroMQ listener: the broker's key pair, the clients it lets in, and the
client side's socket options.

``--zmq-curve-secret-key FILE`` is a ZeroMQ secret certificate (the ZPL text format of
``zmq.auth.create_certificates`` and czmq's ``zcert``).  If FILE does not exist, a key
pair is made: the secret certificate is written there (mode 0600) and the public one
beside it (``name.key`` for ``name.key_secret``, else ``FILE.key``), and the public key
is logged, for clients to be given.

``--zmq-curve-allow PATH`` lists the clients let in: a directory of public
certificates (``*.key``, as ``zmq.auth.load_certificates`` reads them) or a file of
Z85 public keys, one per line (the first word of a line; a line whose first word is
``#`` is a comment).  Without it, any client that
knows the server's public key gets in (the traffic is encrypted, the client is not
identified).  Keys are checked by pyzmq's ZAP handler on the listener's context,
during the handshake, so a refused peer never reaches the broker's loop; each refused
key is logged once.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils import z85

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

# (zmq.auth, its ZAP thread and certificate files, is imported where keys are used:
# 2 ms that every broker process and client without CURVE paid)

__all__ = ["Allowed", "KeyPair", "client_options", "load_allowed", "load_or_create_keys",
           "start_authenticator"]

log = logging.getLogger(__name__)

KeyPair = tuple[bytes, bytes]  # (public, secret), Z85


def public_path(secret_path: str) -> str:
    """Where the public certificate of `secret_path` lives."""
    suffix = "_secret"
    return secret_path[:-len(suffix)] if secret_path.endswith(".key" + suffix) \
        else secret_path + ".key"


def load_or_create_keys(path: str) -> KeyPair:
    """The broker's key pair from `path`, made (and saved) first if it does not exist;
    OSError or ValueError saying what is wrong."""
    if not os.path.exists(path):
        public, secret = zmq.curve_keypair()
        _write_cert(path, public, secret)
        _write_cert(public_path(path), public, None)
        log.warning("made a CURVE key pair: %s; clients need its public key %s",
                    path, public.decode())
        return public, secret
    from zmq.auth import load_certificate  # noqa: PLC0415

    public, secret = load_certificate(path)
    if secret is None or public is None:
        raise ValueError(f"{path} holds no secret key (a secret certificate is needed)")
    return public, secret


def _write_cert(path: str, public: bytes, secret: bytes | None) -> None:
    lines = ["#   ZeroMQ CURVE " + ("**Secret** " if secret else "Public ") + "Certificate",
             "#   (written by zmqnsq)" if not secret else
             "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.",
             "", "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o644)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")


def load_allowed(path: str) -> frozenset[bytes]:
    """The Z85 public keys `path` lets in (a directory of certificates or a key file)."""
    from zmq.auth import load_certificate  # noqa: PLC0415

    p = Path(path)
    if p.is_dir():
        keys = set()
        for cert in sorted(p.glob("*.key")):
            public, _ = load_certificate(str(cert))
            if public:
                keys.add(public)
        return frozenset(keys)
    keys = set()
    for number, line in enumerate(p.read_text().splitlines(), 1):
        words = line.split()
        # (Z85 has "#" among its characters: a comment is a line whose first word is "#")
        if not words or words[0] == "#":
            continue
        text = words[0]
        if len(text) != 40:
            raise ValueError(f"{path}:{number}: a Z85 public key has 40 characters, "
                             f"got {len(text)}")
        try:
            z85.decode(text)
        except (ValueError, KeyError) as e:
            raise ValueError(f"{path}:{number}: not a Z85 key ({e})") from e
        keys.add(text.encode())
    return frozenset(keys)


class Allowed:
    """The ZAP handler's credentials provider: the listed keys; a refused one is logged
    once (a peer retrying every 100 ms must not fill the log)."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys
        self.refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        if key not in self.refused and len(self.refused) < 10_000:
            self.refused.add(key)
            log.warning("refused a ZeroMQ client whose CURVE key is not allowed: %s",
                        key.decode("ascii", "replace"))
        return False


def start_authenticator(ctx: zmq.Context[Any], allowed: frozenset[bytes] | None
                        ) -> ThreadAuthenticator:
    """pyzmq's ZAP handler on `ctx`: the `allowed` keys, or any key when None."""
    from zmq.auth import CURVE_ALLOW_ANY  # noqa: PLC0415
    from zmq.auth.thread import ThreadAuthenticator  # noqa: PLC0415

    auth = ThreadAuthenticator(ctx, log=logging.getLogger(__name__ + ".zap"))
    auth.start()
    if allowed is None:
        auth.configure_curve(domain="*", location=CURVE_ALLOW_ANY)
    else:
        auth.configure_curve_callback(domain="*", credentials_provider=Allowed(allowed))
    return auth


def server_options(sock: zmq.Socket[Any], keys: KeyPair) -> None:
    sock.curve_publickey, sock.curve_secretkey = keys
    sock.curve_server = True


def client_options(sock: zmq.Socket[Any], server_key: bytes | str,
                   keypair: KeyPair | None) -> None:
    """A client socket that speaks CURVE to the server whose public key is `server_key`,
    as `keypair` (a fresh one when None: for a server that lets any key in)."""
    public, secret = keypair or zmq.curve_keypair()
    sock.curve_serverkey = server_key.encode() if isinstance(server_key, str) else server_key
    sock.curve_publickey = public.encode() if isinstance(public, str) else public
    sock.curve_secretkey = secret.encode() if isinstance(secret, str) else secret
