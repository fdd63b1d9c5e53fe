"""Protocol errors of the broker, with nsqd's codes (``internal/protocol/errors.go``).

Theory of operation
-------------------
Every error a client can cause is a :class:`BrokerError`: a machine ``code``
(``E_BAD_TOPIC``), a human ``text`` and a ``fatal`` flag.  The protocol layers
turn it into an error frame whose payload is ``str(err)``, i.e.
``"E_CODE text"`` exactly as nsqd sends it, and close the connection after a
fatal one.  nsqd treats every error as fatal except the three about a message
the client no longer holds (``E_FIN_FAILED``, ``E_REQ_FAILED``,
``E_TOUCH_FAILED``): a late FIN after a timeout is normal life, not a broken
client.

Errors cross process boundaries (actor replies are msgpack), so an error
travels as the tuple :meth:`BrokerError.to_wire` ``-> (code, text, fatal)``
and :func:`from_wire` rebuilds the same subclass on the other side.

One class per code lets callers ``except BadTopic``; helper constructors
(:func:`bad_topic`, :func:`fin_failed`, ...) produce nsqd's sentences.  Raise
them with ``from e`` when they wrap a lower-level cause.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

__all__ = [
    "CODES",
    "NON_FATAL_CODES",
    "AuthDisabled",
    "AuthError",
    "AuthFailed",
    "AuthFirst",
    "BadBody",
    "BadChannel",
    "BadMessage",
    "BadTopic",
    "BrokerError",
    "DpubFailed",
    "FinFailed",
    "IdentifyFailed",
    "Invalid",
    "MpubFailed",
    "PubFailed",
    "ReqFailed",
    "TouchFailed",
    "Unauthorized",
    "bad_body",
    "bad_channel",
    "bad_message",
    "bad_topic",
    "body_too_big",
    "error_class",
    "fin_failed",
    "from_wire",
    "invalid",
    "message_too_big",
    "req_failed",
    "touch_failed",
]


class BrokerError(Exception):
    """Root of the broker's protocol errors: ``code``, ``text`` and ``fatal``.

    Subclasses fix ``code`` and the default ``fatal``; an instance may override
    ``fatal`` (nsqd's rare non-fatal ``E_INVALID``).  ``BrokerError`` itself
    can carry any code (one read from the wire that we do not know).
    """

    code: ClassVar[str] = "E_INVALID"
    default_fatal: ClassVar[bool] = True

    def __init__(self, text: str, *, fatal: bool | None = None, code: str | None = None) -> None:
        super().__init__(text)
        self.text = text
        if code is not None:
            self.code = code  # type: ignore[misc]  # instance override for unknown codes
        self.fatal = self.default_fatal if fatal is None else fatal

    def __str__(self) -> str:
        return f"{self.code} {self.text}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.text!r}, fatal={self.fatal})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BrokerError):
            return NotImplemented
        return self.to_wire() == other.to_wire()

    def __hash__(self) -> int:
        return hash(self.to_wire())

    def __reduce__(self) -> tuple[object, ...]:
        # keep fatal/code across pickling (multiprocessing)
        return (from_wire, (self.to_wire(),))

    def to_wire(self) -> tuple[str, str, bool]:
        """``(code, text, fatal)``: plain types for msgpack."""
        return (self.code, self.text, self.fatal)

    def frame_payload(self) -> bytes:
        """The bytes of nsqd's error frame: ``b"E_CODE text"``."""
        return str(self).encode("utf-8", "replace")


class Invalid(BrokerError):
    """A command that is malformed or not allowed in the connection's state."""

    code = "E_INVALID"


class BadBody(BrokerError):
    """A command body (IDENTIFY, AUTH, MPUB) that is missing, too big or undecodable."""

    code = "E_BAD_BODY"


class BadTopic(BrokerError):
    """A topic name that breaks NSQ's naming rule."""

    code = "E_BAD_TOPIC"


class BadChannel(BrokerError):
    """A channel name that breaks NSQ's naming rule."""

    code = "E_BAD_CHANNEL"


class BadMessage(BrokerError):
    """A message that is empty, too big or truncated."""

    code = "E_BAD_MESSAGE"


class PubFailed(BrokerError):
    """The topic could not accept a PUB (exiting, storage failure)."""

    code = "E_PUB_FAILED"


class MpubFailed(BrokerError):
    """The topic could not accept an MPUB; none of its messages were queued."""

    code = "E_MPUB_FAILED"


class DpubFailed(BrokerError):
    """The topic could not accept a DPUB."""

    code = "E_DPUB_FAILED"


class FinFailed(BrokerError):
    """FIN of a message id this client does not hold in flight (non-fatal)."""

    code = "E_FIN_FAILED"
    default_fatal = False


class ReqFailed(BrokerError):
    """REQ of a message id this client does not hold in flight (non-fatal)."""

    code = "E_REQ_FAILED"
    default_fatal = False


class TouchFailed(BrokerError):
    """TOUCH of a message id this client does not hold in flight (non-fatal)."""

    code = "E_TOUCH_FAILED"
    default_fatal = False


class IdentifyFailed(BrokerError):
    """IDENTIFY negotiated incompatible features."""

    code = "E_IDENTIFY_FAILED"


class AuthDisabled(BrokerError):
    """AUTH sent to a broker without authentication."""

    code = "E_AUTH_DISABLED"


class AuthFirst(BrokerError):
    """A command that needs AUTH first."""

    code = "E_AUTH_FIRST"


class AuthFailed(BrokerError):
    """The auth server refused or could not be reached."""

    code = "E_AUTH_FAILED"


class AuthError(BrokerError):
    """An internal error while answering AUTH."""

    code = "E_AUTH_ERROR"


class Unauthorized(BrokerError):
    """Authenticated, but not allowed on this topic/channel."""

    code = "E_UNAUTHORIZED"


_CLASSES: tuple[type[BrokerError], ...] = (
    Invalid,
    BadBody,
    BadTopic,
    BadChannel,
    BadMessage,
    PubFailed,
    MpubFailed,
    DpubFailed,
    FinFailed,
    ReqFailed,
    TouchFailed,
    IdentifyFailed,
    AuthDisabled,
    AuthFirst,
    AuthFailed,
    AuthError,
    Unauthorized,
)
_BY_CODE: dict[str, type[BrokerError]] = {cls.code: cls for cls in _CLASSES}

CODES: frozenset[str] = frozenset(_BY_CODE)
"""Every code nsqd's protocol V2 sends."""
NON_FATAL_CODES: frozenset[str] = frozenset(c.code for c in _CLASSES if not c.default_fatal)
"""Codes after which the connection stays open."""


def error_class(code: str) -> type[BrokerError]:
    """The class for ``code`` (``BrokerError`` for an unknown code)."""
    return _BY_CODE.get(code, BrokerError)


def from_wire(wire: Sequence[object]) -> BrokerError:
    """Rebuild an error from :meth:`BrokerError.to_wire` output (a tuple or msgpack list)."""
    if len(wire) != 3:
        msg = f"a wire error is (code, text, fatal), got {wire!r}"
        raise ValueError(msg)
    code, text, fatal = wire
    if not isinstance(code, str) or not isinstance(text, str):
        msg = f"a wire error is (code, text, fatal), got {wire!r}"
        raise ValueError(msg)
    cls = error_class(code)
    if cls is BrokerError:
        return BrokerError(text, fatal=bool(fatal), code=code)
    return cls(text, fatal=bool(fatal))


# ---------------------------------------------------------------------------
# Helper constructors with nsqd's sentences.  ``command`` is the verb that
# failed ("PUB", "SUB", ...); message ids are shown as text.


def _id_text(msg_id: bytes | str) -> str:
    return msg_id.decode("ascii", "replace") if isinstance(msg_id, bytes) else msg_id


def _quote(name: str | bytes) -> str:
    if isinstance(name, bytes):
        name = name.decode("utf-8", "replace")
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


def invalid(text: str, *, fatal: bool = True) -> Invalid:
    """``E_INVALID`` with ``text`` (e.g. ``"cannot FIN in current state"``)."""
    return Invalid(text, fatal=fatal)


def bad_topic(name: str | bytes, command: str = "PUB") -> BadTopic:
    """``E_BAD_TOPIC PUB topic name "x y" is not valid``."""
    return BadTopic(f"{command} topic name {_quote(name)} is not valid")


def bad_channel(name: str | bytes, command: str = "SUB") -> BadChannel:
    """``E_BAD_CHANNEL SUB channel name "x y" is not valid``."""
    return BadChannel(f"{command} channel name {_quote(name)} is not valid")


def bad_message(text: str) -> BadMessage:
    """``E_BAD_MESSAGE`` with ``text`` (e.g. ``"PUB invalid message body size 0"``)."""
    return BadMessage(text)


def message_too_big(size: int, limit: int, command: str = "PUB") -> BadMessage:
    """``E_BAD_MESSAGE PUB message too big 2000000 > 1048576``."""
    return BadMessage(f"{command} message too big {size} > {limit}")


def bad_body(text: str) -> BadBody:
    """``E_BAD_BODY`` with ``text`` (e.g. ``"MPUB invalid message count 0"``)."""
    return BadBody(text)


def body_too_big(size: int, limit: int, command: str = "MPUB") -> BadBody:
    """``E_BAD_BODY MPUB body too big 6000000 > 5242880``."""
    return BadBody(f"{command} body too big {size} > {limit}")


def fin_failed(msg_id: bytes | str, reason: str = "ID not in flight") -> FinFailed:
    """``E_FIN_FAILED FIN 0a1b... failed ID not in flight`` (non-fatal)."""
    return FinFailed(f"FIN {_id_text(msg_id)} failed {reason}")


def req_failed(msg_id: bytes | str, reason: str = "ID not in flight") -> ReqFailed:
    """``E_REQ_FAILED REQ 0a1b... failed ID not in flight`` (non-fatal)."""
    return ReqFailed(f"REQ {_id_text(msg_id)} failed {reason}")


def touch_failed(msg_id: bytes | str, reason: str = "ID not in flight") -> TouchFailed:
    """``E_TOUCH_FAILED TOUCH 0a1b... failed ID not in flight`` (non-fatal)."""
    return TouchFailed(f"TOUCH {_id_text(msg_id)} failed {reason}")
