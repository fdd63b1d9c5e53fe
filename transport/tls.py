"""TLS for the NSQ TCP and HTTP(S) listeners: nsqd 1.3's ``--tls-*`` flags as an
``ssl.SSLContext``.

nsqd's flags map onto Python's ``ssl`` module as follows:

* ``--tls-cert`` / ``--tls-key``: the server's certificate chain and key (both or
  neither);
* ``--tls-root-ca-file``: the CAs a client certificate is checked against (else the
  system's);
* ``--tls-client-auth-policy``: ``""`` checks a client certificate if one is given
  (Go's ``VerifyClientCertIfGiven``), ``require-verify`` requires one that verifies.
  nsqd's ``require`` takes *any* certificate without checking it (Go's
  ``RequireAnyClientCert``); Python's ``ssl`` cannot accept a certificate it has not
  verified, so here ``require`` needs ``--tls-root-ca-file`` and is
  ``require-verify`` against it (:func:`check` says so at start-up);
* ``--tls-min-version``: ``tls1.0`` .. ``tls1.3`` (nsqd's ``ssl3.0`` is refused: no
  OpenSSL this package runs on speaks it).  The default is ``tls1.2``, not nsqd's
  ``tls1.0``: OpenSSL 3 refuses 1.0 and 1.1 at its default security level anyway.
"""

from __future__ import annotations

import ssl
from typing import Any

__all__ = ["CLIENT_AUTH_POLICIES", "MIN_VERSIONS", "REQUIRED", "check", "context_for",
           "peer_details", "required_mode", "server_context"]

MIN_VERSIONS = {
    "tls1.0": ssl.TLSVersion.TLSv1,
    "tls1.1": ssl.TLSVersion.TLSv1_1,
    "tls1.2": ssl.TLSVersion.TLSv1_2,
    "tls1.3": ssl.TLSVersion.TLSv1_3,
}
CLIENT_AUTH_POLICIES = ("", "require", "require-verify")
REQUIRED = {"false": "false", "f": "false", "0": "false", "true": "true", "t": "true",
            "1": "true", "tcp-https": "tcp-https"}
"""``--tls-required``'s spellings, lower-cased (Go's ``strconv.ParseBool`` forms nsqd
takes, and ``tcp-https``: TLS for NSQ TCP, plain HTTP still served), to their meaning."""


def required_mode(value: str) -> str | None:
    """``false``, ``true`` or ``tcp-https`` for a ``--tls-required`` value (None: bad)."""
    return REQUIRED.get(value.strip().lower())


def check(cert: str, key: str, *, root_ca: str, policy: str, min_version: str,
          required: str) -> str | None:
    """Why these flags cannot work together (the sentence names the flag), or None."""
    if bool(cert) != bool(key):
        return "--tls-cert and --tls-key go together: give both or neither"
    if policy not in CLIENT_AUTH_POLICIES:
        return (f"--tls-client-auth-policy must be require or require-verify (or empty), "
                f"got {policy!r}")
    if min_version not in MIN_VERSIONS:
        return (f"--tls-min-version must be one of {', '.join(MIN_VERSIONS)}, "
                f"got {min_version!r}")
    mode = required_mode(required)
    if mode is None:
        return f"--tls-required must be true, false or tcp-https, got {required!r}"
    if not cert and (policy or mode != "false"):
        return "cannot require TLS client connections without --tls-cert and --tls-key"
    if policy == "require" and not root_ca:
        return ("--tls-client-auth-policy=require needs --tls-root-ca-file here: Python's "
                "TLS cannot accept a client certificate without verifying it")
    return None


def context_for(options: Any) -> ssl.SSLContext | None:
    """The server context the broker's ``--tls-*`` options ask for (None: no TLS)."""
    if not options.tls_cert:
        return None
    return server_context(options.tls_cert, options.tls_key,
                          root_ca=options.tls_root_ca_file,
                          policy=options.tls_client_auth_policy,
                          min_version=options.tls_min_version)


def server_context(cert: str, key: str, *, root_ca: str = "", policy: str = "",
                   min_version: str = "tls1.2") -> ssl.SSLContext:
    """The listeners' server-side context (raises OSError/ssl.SSLError on a bad file)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = MIN_VERSIONS[min_version]
    ctx.load_cert_chain(cert, key)
    if root_ca:
        ctx.load_verify_locations(cafile=root_ca)
    else:
        ctx.load_default_certs(ssl.Purpose.CLIENT_AUTH)
    ctx.verify_mode = ssl.CERT_REQUIRED if policy else ssl.CERT_OPTIONAL
    return ctx


def peer_details(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> dict[str, str]:
    """What nsqd's ``/stats`` shows of a TLS connection: version (``TLS1.3``, nsqd's
    spelling), cipher suite, and the client certificate's common name ("" where there
    is none)."""
    if ssl_object is None:
        return {}
    cipher = ssl_object.cipher()
    cert = ssl_object.getpeercert() or {}
    common_name = next((value for rdn in cert.get("subject", ()) for name, value in rdn
                        if name == "commonName"), "")
    return {"tls_version": (ssl_object.version() or "").replace("TLSv", "TLS"),  # nsqd's
            "tls_cipher_suite": cipher[0] if cipher else "",
            "tls_common_name": common_name}
