"""CURVE on a real socket pair: an authorised actor gets through, an unknown key does not."""

import zmq

from data.core.codec import decode, encode
from data.core.security import configure_client_socket, configure_server_socket
from tools.gen_keys import make_keys


def test_curve_admits_authorised_keys_only(tmp_path, ports):
    keys = make_keys(tmp_path / "keys", ["learner", "arm-1"])
    rogue = make_keys(tmp_path / "rogue", ["learner", "rogue"])
    ctx = zmq.Context()
    try:
        server = ctx.socket(zmq.ROUTER)
        server.setsockopt(zmq.LINGER, 0)
        configure_server_socket(server, "127.0.0.1", {
            "server_secret_key": str(keys["learner"][1]),
            "authorized_keys_dir": str(tmp_path / "keys" / "actors")})
        server.bind(f"tcp://127.0.0.1:{ports[0]}")

        def client(secret):
            c = ctx.socket(zmq.DEALER)
            c.setsockopt(zmq.LINGER, 0)
            configure_client_socket(c, {"client_secret_key": str(secret),
                                        "server_public_key": str(keys["learner"][0])})
            c.connect(f"tcp://127.0.0.1:{ports[0]}")
            c.send_multipart(encode("ping", {"t": 1.0}))
            return c

        good = client(keys["arm-1"][1])
        assert server.poll(5000)
        ident, *frames = server.recv_multipart()
        assert decode(frames).type == "ping"
        bad = client(rogue["rogue"][1])
        assert not server.poll(1500), "an unauthorised key got a message through"
        good.close(0)
        bad.close(0)
        server.close(0)
    finally:
        ctx.destroy(0)
