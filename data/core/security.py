"""Bind policy and CURVE authentication for the learner's sockets.

Loopback binds (127.0.0.0/8, ::1, localhost) need nothing. Any other bind address needs
CURVE keys (made by ``tools/gen_keys.py``): the learner's secret certificate and a folder of
authorised actor public certificates, checked by a ZAP authenticator. Binding elsewhere
without keys is refused unless ``allow_insecure`` is set explicitly.

An actor id is bound to its key: ``<actor_id>.key`` in the authorised-keys folder is the
public key of actor ``<actor_id>`` (``tools/gen_keys.py`` names them so). One key, one id:
:func:`authorized_actor_ids` refuses a folder where one key appears under two names, and the
learner refuses a hello whose actor id is not the one its key was issued for.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("tandem.data.core.security")

_auth_lock = threading.Lock()
_authenticators: dict[int, ThreadAuthenticator] = {}


def is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind_policy(host: str, security: dict) -> None:
    """Raise ValueError for a bind the security settings do not allow: a non-loopback
    address without CURVE keys (unless ``allow_insecure``), or keys that do not load."""
    secret = security.get("server_secret_key")
    if not secret:
        if not is_loopback(host) and not security.get("allow_insecure", False):
            raise ValueError(
                f"refusing to bind {host!r} without CURVE keys: make them with "
                "`python -m tools.gen_keys DIR` and set transport.security.server_secret_key and "
                "transport.security.authorized_keys_dir, or pass "
                "transport.security.allow_insecure=true to accept unauthenticated actors"
            )
        return
    keys_dir = security.get("authorized_keys_dir")
    if not keys_dir or not Path(keys_dir).is_dir():
        raise ValueError(f"transport.security.authorized_keys_dir {keys_dir!r} is not a folder")
    _, secret_key = zmq.auth.load_certificate(secret)
    if secret_key is None:
        raise ValueError(f"{secret} holds no secret key (use the .key_secret file)")


def configure_server_socket(sock: zmq.Socket, host: str, security: dict) -> None:
    """Apply CURVE server settings to ``sock`` before bind, or refuse an insecure bind."""
    check_bind_policy(host, security)
    secret = security.get("server_secret_key")
    if not secret:
        if not is_loopback(host):
            log.warning("binding %s WITHOUT authentication or encryption (allow_insecure)", host)
        return
    keys_dir = security["authorized_keys_dir"]
    public, secret_key = zmq.auth.load_certificate(secret)
    _ensure_authenticator(sock.context, keys_dir)
    sock.curve_secretkey = secret_key
    sock.curve_publickey = public
    sock.curve_server = True


def authorized_actor_ids(keys_dir: str | Path) -> dict[str, str]:
    """{z85 public key (the ZAP User-Id of a CURVE peer): actor id} from the ``*.key`` files
    of ``keys_dir``, each file's name being its actor's id. Raises ValueError when one key is
    filed under two ids."""
    out: dict[str, str] = {}
    for path in sorted(Path(keys_dir).glob("*.key")):
        public, _ = zmq.auth.load_certificate(str(path))
        key = public.decode("ascii") if isinstance(public, bytes) else str(public)
        if key in out:
            raise ValueError(f"{keys_dir}: one key is filed under two actor ids, {out[key]!r} "
                             f"and {path.stem!r}; one key, one id")
        out[key] = path.stem
    return out


def _ensure_authenticator(ctx: zmq.Context, keys_dir: str) -> None:
    with _auth_lock:
        if id(ctx) in _authenticators:
            return
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve(domain="*", location=str(keys_dir))
        _authenticators[id(ctx)] = auth


def configure_client_socket(sock: zmq.Socket, security: dict) -> None:
    """Apply CURVE client settings (actor side) when keys are configured."""
    client_secret = security.get("client_secret_key")
    server_public = security.get("server_public_key")
    if not client_secret and not server_public:
        return
    if not (client_secret and server_public):
        raise ValueError("CURVE needs both transport.security.client_secret_key and server_public_key")
    pub, sec = zmq.auth.load_certificate(client_secret)
    if sec is None:
        raise ValueError(f"{client_secret} holds no secret key (use the .key_secret file)")
    server_key, _ = zmq.auth.load_certificate(server_public)
    sock.curve_secretkey = sec
    sock.curve_publickey = pub
    sock.curve_serverkey = server_key
